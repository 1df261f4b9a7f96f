"""Limits at the ingress's front door, and admission capacity that is given back on every path.

`FrontDoor` is a pure ASGI middleware around the app (no body buffering, so streams and disconnects pass
straight through). For every HTTP request but the probes (`PROBE_PATHS`) it

- refuses at once with 503 and Retry-After when the ingress already holds `max_ingress_requests` requests
  (reading a body, waiting for capacity, generating or streaming), so excess load gets a quick answer instead
  of piling up in Serve's proxy;
- refuses with 429 and Retry-After when the request's API key already has `max_concurrent_per_key` requests
  in this ingress (only when the limit is set; the key is identified by its position among the configured
  keys and never named);
- bounds the reading of the body: `receive` is wrapped so that a body not complete `body_read_timeout_s`
  after the request arrived raises `BodyReadTimeout`, which the app answers with 408 and `Connection: close`.
  A slow client then holds nothing: its request leaves the count and uvicorn closes its connection;
- opens a `ReleaseScope` for the request: every `Admission` (a request's share of the ServingCore's
  capacity) taken while serving it is released when the app's call for that request ends, however it ends
  (answered, streamed, cancelled, the client gone before the stream's body started).

`Admission` is the ticket itself: its release is idempotent (a `weakref.finalize`, which runs its callback at
most once), so the stream's own `finally`, the response's background task, the request's scope and, as a
last resort, garbage collection may all release it and it counts once.

Behind Ray Serve the proxy does not buffer bodies: the replica pulls each body message from the proxy when
the app calls `receive` (Serve's `ASGIReceiveProxy`), so the same deadline applies there; Serve counts a slow
body as an ongoing request of the ingress replica until the 408.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from raydeploy.config import Config
from raydeploy.serve.auth import ApiKeyCheck
from raydeploy.serve.errors import APIError, Overloaded, error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Never refused by the front door's bounds (they read no body and take no capacity)."""
PROBE_HEADROOM = 64
"""Requests Serve lets into an ingress replica beyond `max_ingress_requests`: room for probes and refusals."""


@dataclass(frozen=True)
class FrontDoorLimits:
    body_read_timeout_s: float = 10.0
    max_ingress_requests: int = 256
    max_concurrent_per_key: int | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> FrontDoorLimits:
        s = cfg.serving
        return cls(body_read_timeout_s=s.body_read_timeout_s, max_ingress_requests=ingress_bound(cfg),
                   max_concurrent_per_key=s.max_concurrent_per_key or None)


def ingress_bound(cfg: Config) -> int:
    """`serving.max_ingress_requests`, or its default: room for four times what the gangs can admit."""
    s = cfg.serving
    if s.max_ingress_requests is not None:
        return s.max_ingress_requests
    return max(256, 4 * (cfg.engine.max_slots * cfg.replicas.max + s.max_queue))


class BodyReadTimeout(APIError):
    status = 408
    type = "invalid_request_error"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s:g} s (serving.body_read_timeout_s)",
                         code="body_timeout")
        self.timeout_s = timeout_s

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the rest of the body may still come: the connection is not reusable

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (BodyReadTimeout, (self.timeout_s,))


class IngressFull(Overloaded):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the server is holding its limit of {limit} requests (serving.max_ingress_requests); "
                         f"retry shortly", retry_after_s=1.0)


class KeyBusy(APIError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, limit: int) -> None:
        super().__init__(f"this API key already has {limit} requests in progress, its limit "
                         f"(serving.max_concurrent_per_key = {limit}); retry when one finishes",
                         code="rate_limit_exceeded", retry_after_s=1.0)


# -- admission tickets ---------------------------------------------------------------------------------


class Admission:
    """`n_jobs` sequences of a ServingCore's capacity, held by one request. `release()` gives them back once,
    however often it is called; if nobody calls it, garbage collection does."""

    def __init__(self, n_jobs: int, give_back: Callable[[int], None]) -> None:
        self.n_jobs = n_jobs
        self._finalizer = weakref.finalize(self, give_back, n_jobs)
        self._finalizer.atexit = False
        scope = _REQUEST_SCOPE.get()
        if scope is not None:
            scope.add(self)

    def release(self) -> None:
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive


class ReleaseScope:
    """The tickets taken while serving one request: released together when the request's app call ends."""

    def __init__(self) -> None:
        self._tickets: list[Admission] = []

    def add(self, ticket: Admission) -> None:
        self._tickets.append(ticket)

    def close(self) -> None:
        for t in self._tickets:
            t.release()
        self._tickets.clear()


_REQUEST_SCOPE: contextvars.ContextVar[ReleaseScope | None] = contextvars.ContextVar("raydeploy_release_scope",
                                                                                    default=None)


# -- the middleware ------------------------------------------------------------------------------------


class FrontDoor:
    """The ASGI middleware described in the module docstring."""

    def __init__(self, app: Any, limits: FrontDoorLimits, keys: ApiKeyCheck | None = None) -> None:
        self.app = app
        self.limits = limits
        self.keys = keys if keys is not None and keys.enabled and limits.max_concurrent_per_key else None
        self._lock = threading.Lock()
        self.held = 0
        """Requests inside the ingress now (not probes)."""
        self.per_key: Counter[int] = Counter()
        self.refused = Counter[str]()
        """Refusals by reason: 'ingress_full', 'key_busy', 'body_timeout'."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        lim = self.limits
        key = self._key_of(scope)
        with self._lock:
            refusal: APIError | None = None
            if self.held >= lim.max_ingress_requests:
                refusal, reason = IngressFull(lim.max_ingress_requests), "ingress_full"
            elif key is not None and lim.max_concurrent_per_key and self.per_key[key] >= lim.max_concurrent_per_key:
                refusal, reason = KeyBusy(lim.max_concurrent_per_key), "key_busy"
            else:
                self.held += 1
                if key is not None:
                    self.per_key[key] += 1
        if refusal is not None:
            self.refused[reason] += 1
            await error_response(refusal)(scope, receive, send)
            return
        releases = ReleaseScope()
        token = _REQUEST_SCOPE.set(releases)
        started = False

        async def noting_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._bounded(receive), noting_send)
        except BodyReadTimeout as e:  # raised past the app's handlers: answer it here if nothing was sent
            if started:
                raise
            await error_response(e)(scope, receive, send)
        finally:
            _REQUEST_SCOPE.reset(token)
            releases.close()
            with self._lock:
                self.held -= 1
                if key is not None:
                    self.per_key[key] -= 1
                    if not self.per_key[key]:
                        del self.per_key[key]

    def _key_of(self, scope: Scope) -> int | None:
        if self.keys is None:
            return None
        auth = x_key = None
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                auth = value.decode("latin-1")
            elif name == b"x-api-key":
                x_key = value.decode("latin-1")
        return self.keys.key_index(auth, x_key)

    def _bounded(self, receive: Receive) -> Receive:
        """`receive` with a deadline on the body: the whole of it must arrive within body_read_timeout_s of the
        request's arrival. After the body (or a disconnect), messages pass through unbounded (a stream's wait
        for a disconnect is not a body read)."""
        timeout_s = self.limits.body_read_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        body_done = False

        async def bounded() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.refused["body_timeout"] += 1
                raise BodyReadTimeout(timeout_s)
            try:
                async with asyncio.timeout(remaining):
                    message = await receive()
            except TimeoutError:
                self.refused["body_timeout"] += 1
                raise BodyReadTimeout(timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        return bounded

    def snapshot(self) -> dict[str, Any]:
        """Figures for /status."""
        lim = self.limits
        return {"held": self.held, "max_ingress_requests": lim.max_ingress_requests,
                "max_concurrent_per_key": lim.max_concurrent_per_key, "body_read_timeout_s": lim.body_read_timeout_s,
                "refused": dict(self.refused)}
