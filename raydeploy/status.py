"""`raydeploy status [URL]`: ask a running deployment how it is, over HTTP, and print it readably.

GETs URL/ready (no auth; 200 ready, 503 not yet) and URL/status (needs an API key when the deployment
has keys: --api-key or $RAYDEPLOY_API_KEY). Per host it shows, besides its process and phase, how many
programs its warmup loaded from the persistent compile cache and how many it compiled. Exit codes: 0 ready, 3 reachable but not ready, 1 cannot
reach it or it answered with an error. Every request is bounded by --timeout-s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
NOT_READY_EXIT = 3


class StatusError(RuntimeError):
    """The deployment cannot be reached or answered with an error; says which URL and why."""


def fetch_json(url: str, api_key: str | None, timeout_s: float) -> tuple[int, Any]:
    """(HTTP status, decoded JSON body) of a GET; 4xx/5xx are returned, not raised."""
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - user-given http(s) URL
            code, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        code, body = e.code, e.read()
    except urllib.error.URLError as e:
        raise StatusError(f"cannot reach {url}: {getattr(e, 'reason', e)} (is `raydeploy serve` running "
                          f"there?)") from None
    except TimeoutError:
        raise StatusError(f"cannot reach {url}: no answer within {timeout_s:g}s") from None
    except OSError as e:
        raise StatusError(f"cannot reach {url}: {e}") from None
    try:
        return code, json.loads(body.decode("utf-8") or "null")
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StatusError(f"{url} answered HTTP {code} with a body that is not JSON: {body[:120]!r}") from None


def _error_message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return json.dumps(body)[:200]


def get_status(base_url: str, api_key: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """{"ready": bool, "ready_body": ..., "status": ... or None, "status_error": str or None}."""
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise StatusError(f"URL must start with http:// or https://, found {base_url!r}")
    code, ready_body = fetch_json(f"{base}/ready", None, timeout_s)
    out: dict[str, Any] = {"url": base, "ready": code == 200, "ready_body": ready_body, "status": None,
                           "status_error": None}
    code, body = fetch_json(f"{base}/status", api_key, timeout_s)
    if code == 200:
        out["status"] = body
    elif code == 401:
        out["status_error"] = ("/status needs an API key: pass --api-key or set RAYDEPLOY_API_KEY "
                               f"({_error_message(body)})")
    else:
        out["status_error"] = f"/status answered HTTP {code}: {_error_message(body)}"
    return out


def format_status(info: dict[str, Any]) -> str:
    rb = info["ready_body"] if isinstance(info["ready_body"], dict) else {}
    lines = [f"url           {info['url']}",
             f"ready         {'yes' if info['ready'] else 'no'} (gang state {rb.get('state', '?')}"
             + (f", {rb['ready_gangs']} of {rb.get('total_gangs')} gang(s) ready)" if rb.get("ready_gangs") is not None
                else ")")]
    st = info["status"]
    if info["status_error"]:
        lines.append(f"status        {info['status_error']}")
    if isinstance(st, dict):
        cfg = st.get("config") or {}
        lines += [
            f"state         {st.get('state')}, restarts {st.get('restarts')}, last error {st.get('last_error') or '-'}",
            f"model         {st.get('model')}",
            f"mesh          {st.get('mesh')} over {st.get('devices')} device(s) in {st.get('process_count')} "
            f"process(es)",
            f"uptime        {st.get('uptime_s')} s",
            f"requests      served {st.get('requests_served')}",
        ]
        if cfg:
            lines.append("config        " + ", ".join(f"{k}={v}" for k, v in cfg.items() if not isinstance(v, dict)))
        serving = st.get("serving") or {}
        if serving:
            lines.append("serving       " + ", ".join(f"{k}={v}" for k, v in serving.items()
                                                      if not isinstance(v, dict | list)))
        engine = st.get("engine") or {}
        if engine:
            lines.append("engine        " + ", ".join(f"{k}={v}" for k, v in engine.items()
                                                      if not isinstance(v, dict | list)))
        summary = st.get("gang") or {}
        listed = summary.get("gangs")
        gangs: list[Any] = listed if isinstance(listed, list) else [summary]
        for gang in gangs:
            if not isinstance(gang, dict):
                continue
            if gang.get("gang"):
                lines.append(f"gang          {gang['gang']}: {gang.get('state')}, restarts {gang.get('restarts')}, "
                             f"last error {gang.get('last_error') or '-'}")
            lines += _gang_lines(gang)
    return "\n".join(lines)


def _gang_lines(gang: dict[str, Any]) -> list[str]:
    lines = []
    placement = gang.get("placement") or {}
    if placement.get("slice"):
        lines.append(f"placement     TPU slice {placement['slice']}, bundle per rank {placement.get('rank_bundle')} "
                     f"(ranks follow TPU_WORKER_ID)")
    for h in gang.get("host_status") or []:
        if isinstance(h, dict):
            lines.append("host          " + ", ".join(f"{k}={v}" for k, v in h.items()
                                                      if not isinstance(v, dict | list)))
    for row in gang.get("hosts") or []:
        if isinstance(row, dict) and isinstance(row.get("programs"), dict):
            p = row["programs"]
            lines.append(f"programs      host {row.get('rank')}: {p.get('loaded', 0)} loaded from the compile "
                         f"cache, {p.get('compiled', 0)} compiled")
    return lines


def run_status(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("RAYDEPLOY_API_KEY")
    timeout_s = getattr(args, "timeout_s", None) or DEFAULT_TIMEOUT_S
    try:
        info = get_status(args.url, api_key, timeout_s)
    except StatusError as e:
        print(f"raydeploy status: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_status(info))
    if info["status_error"] and info["ready"]:
        return 1
    return 0 if info["ready"] else NOT_READY_EXIT
