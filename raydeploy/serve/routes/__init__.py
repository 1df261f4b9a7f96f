"""The ingress's routes, one FastAPI router per API: `openai` (/v1), `legacy` (the EasyDeL JAXServer's /chat
and /instruct) and `ops` (probes, /status, /metrics, the chat page), over the `Ingress` of `shared`.
`raydeploy.serve.app.create_app` assembles them with the middlewares and the error mapping."""
