"""Operations: the probes (/health, /ready), /status, Prometheus /metrics and the chat page (/)."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response

from raydeploy.serve.redact import without_addresses
from raydeploy.serve.routes.shared import ingress

STATIC_DIR = Path(__file__).parent.with_name("static")

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    st = await ingress(request).core.backend.state()  # "ready" while at least one gang is
    state = st.get("state", "unknown")
    gangs = {"ready_gangs": st.get("ready_gangs"), "total_gangs": st.get("total_gangs")}
    if state == "ready":
        return JSONResponse({"ready": True, "state": state, **gangs})
    headers = {} if state == "failed" else {"Retry-After": "5"}
    return JSONResponse({"ready": False, "state": state, "restarts": st.get("restarts"), **gangs,
                         "error": {"message": f"no model gang is ready (state {state})", "type": "server_error",
                                   "param": None, "code": "not_ready"}},
                        status_code=503, headers=headers)


@router.get("/status")
async def status(request: Request) -> Response:
    ing = ingress(request)
    ing.authorize(request)
    core, info, metrics = ing.core, ing.info, ing.core.metrics
    st = await core.backend.state()
    gang = await core.backend.status()
    _, stats, age_s = await ing.figures.read_now()  # fresh for operators (a key guards /status); /metrics caches
    served = metrics.requests_served
    front_door = request.app.state.front_door
    return JSONResponse(without_addresses({  # no coordinator ip:port, node IPs or addresses in errors
        "status": "Ready" if st.get("state") == "ready" else str(st.get("state", "unknown")).capitalize(),
        "state": st.get("state"), "restarts": st.get("restarts"), "last_error": st.get("last_error"),
        "ready_gangs": st.get("ready_gangs"), "total_gangs": st.get("total_gangs"),
        "model": core.limits.model_name, "config": info.config, "devices": info.devices,
        "process_count": info.process_count, "mesh": info.mesh,
        "uptime_s": round(time.time() - info.started_at, 3),
        "number_of_served_request_until_last_up_time": served, "requests_served": served,
        "serving": metrics.snapshot() | {"queue_capacity": core.limits.max_queue, "admitted": core.in_flight},
        "front_door": front_door.snapshot() if front_door else None,
        "engine": stats if st.get("state") == "ready" else {}, "engine_age_s": age_s, "gang": gang,
    }))


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    ing = ingress(request)
    st, stats, age_s = await ing.figures.get()  # cached: a scrape never waits on a gang or takes its locks
    return PlainTextResponse(ing.core.metrics.render(st, stats, age_s), media_type="text/plain; version=0.0.4")


@router.get("/")
async def page() -> Response:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")
