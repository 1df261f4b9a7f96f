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

`CapacityQueue` hands the tickets out: sequences up to a capacity (the ServingCore's: slots of the ready gangs
plus the gangs' queue), and beyond it a bounded first-come-first-served line of waiting requests
(`serving.max_waiting`), each waiting at most `serving.queue_wait_s` before a 503 with Retry-After. A load
client that sends a thousand prompts at once is served, not turned away; a waiting request leaves the line as
soon as its client disconnects (the request's `ReleaseScope` watches the connection once the body is read) or
its task is cancelled (Ray Serve's proxy cancels the replica's call when the client goes).

Behind Ray Serve the proxy does not buffer bodies: the replica pulls each body message from the proxy when
the app calls `receive` (Serve's `ASGIReceiveProxy`), so the same deadline applies there; Serve counts a slow
body as an ongoing request of the ingress replica until the 408.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
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


WAITED_RETRY_AFTER_S = 5.0
"""Retry-After of a request that waited its whole serving.queue_wait_s: the server has been full that long."""
CAPACITY_REFRESH_S = 1.0
"""How often the first waiting request reads the gangs' capacity afresh (a gang that turned ready adds room)."""
INGRESS_HEADROOM = 256
"""Requests an ingress holds by default beyond those admitted and waiting: bodies being read, quick refusals."""


def ingress_bound(cfg: Config) -> int:
    """`serving.max_ingress_requests`, or its default: what the gangs can admit at most (every gang ready), the
    line of waiting requests, and INGRESS_HEADROOM."""
    s = cfg.serving
    if s.max_ingress_requests is not None:
        return s.max_ingress_requests
    return cfg.engine.max_slots * cfg.replicas.max + s.max_queue + s.max_waiting + INGRESS_HEADROOM


def queue_wait_s(cfg: Config) -> float:
    """`serving.queue_wait_s`, or its default: the request timeout (the wait counts toward it)."""
    s = cfg.serving
    return s.request_timeout_s if s.queue_wait_s is None else s.queue_wait_s


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


class WaitingFull(Overloaded):
    def __init__(self, limit: int) -> None:
        line = (f"{limit} requests already wait for room, its limit" if limit else "no request may wait for room")
        super().__init__(f"the server is at capacity and {line} (serving.max_waiting = {limit}); retry shortly",
                         retry_after_s=1.0)
        self.limit = limit

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (WaitingFull, (self.limit,))


class WaitedTooLong(Overloaded):
    def __init__(self, wait_s: float) -> None:
        super().__init__(f"the server stayed at capacity for the {wait_s:g} s this request may wait for room "
                         f"(serving.queue_wait_s); retry later", retry_after_s=WAITED_RETRY_AFTER_S)
        self.wait_s = wait_s

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (WaitedTooLong, (self.wait_s,))


class ClientGone(APIError):
    """The client disconnected while its request waited: nobody reads the answer (499, as nginx logs it)."""

    status = 499
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("the client disconnected while the request waited for capacity", code="client_closed")

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (ClientGone, ())


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
    """The tickets taken while serving one request, released together when the request's app call ends; and the
    request's connection, watched for a disconnect while the request waits for capacity."""

    def __init__(self, receive: BodyDeadline | None = None) -> None:
        self._tickets: list[Admission] = []
        self._receive = receive

    def add(self, ticket: Admission) -> None:
        self._tickets.append(ticket)

    def close(self) -> None:
        for t in self._tickets:
            t.release()
        self._tickets.clear()

    async def client_gone(self) -> None:
        """Returns once the client has disconnected. It reads the request's messages, so it watches only a
        request whose body has been read (after the body, ASGI's next message is the disconnect; both uvicorn and
        Serve's proxy give it again to a later reader, such as a stream's own watch); otherwise it never returns."""
        receive = self._receive
        if receive is None or not receive.body_read:
            await asyncio.Event().wait()  # nothing to watch: the caller's own bound ends the wait
        assert receive is not None
        while (await receive())["type"] != "http.disconnect":
            pass


def request_scope() -> ReleaseScope | None:
    """The scope of the request being served (None outside the front door: tests that call the core directly)."""
    return _REQUEST_SCOPE.get()


_REQUEST_SCOPE: contextvars.ContextVar[ReleaseScope | None] = contextvars.ContextVar("raydeploy_release_scope",
                                                                                    default=None)


class BodyDeadline:
    """`receive` with a deadline on the body: the whole of it must arrive within `timeout_s` of the request's
    arrival (`BodyReadTimeout` after). After the body (or a disconnect), messages pass through unbounded (a
    stream's wait for a disconnect is not a body read)."""

    def __init__(self, receive: Receive, timeout_s: float, refused: Counter[str]) -> None:
        self._receive = receive
        self.timeout_s = timeout_s
        self._refused = refused
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self.body_read = False
        """Whether the whole body has arrived (or the client has gone)."""

    async def __call__(self) -> Message:
        if self.body_read:
            return await self._receive()
        remaining = self._deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            self._refused["body_timeout"] += 1
            raise BodyReadTimeout(self.timeout_s)
        try:
            async with asyncio.timeout(remaining):
                message = await self._receive()
        except TimeoutError:
            self._refused["body_timeout"] += 1
            raise BodyReadTimeout(self.timeout_s) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_read = True
        return message


@dataclass
class _Waiter:
    n_jobs: int
    wake: asyncio.Future[None]
    granted: bool = False


class CapacityQueue:
    """Sequences admitted against a capacity, and a bounded first-come-first-served line of requests waiting for
    room (the module docstring). Thread-safe: a ticket may be released by garbage collection on any thread, and
    the waiters it lets in are woken on their own event loop."""

    def __init__(self, max_waiting: int, wait_s: float, *, refresh_s: float = CAPACITY_REFRESH_S) -> None:
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._line: deque[_Waiter] = deque()
        self.capacity = 0
        """Sequences that may be admitted at once, as last read (`take`)."""
        self.in_flight = 0
        """Sequences admitted and not yet released."""
        self.waited = 0
        """Requests that had to wait, and were admitted."""
        self.refused = Counter[str]()
        """Requests that left the line unadmitted, by reason: 'line_full', 'wait_timeout', 'client_gone',
        'cancelled'."""

    @property
    def waiting(self) -> int:
        """Requests in the line now."""
        return len(self._line)

    @property
    def waiting_sequences(self) -> int:
        """Sequences of the requests in the line now."""
        with self._lock:
            return sum(w.n_jobs for w in self._line)

    async def take(self, n_jobs: int, read_capacity: Callable[[], Awaitable[int]],
                   client_gone: Callable[[], Coroutine[Any, Any, None]] | None = None) -> Admission:
        """A ticket for `n_jobs` sequences: at once when they fit and nobody waits before them, else after waiting
        in line, at most `wait_s` (`WaitedTooLong`). A full line is `WaitingFull` at once; a client gone while
        waiting (`client_gone` returned) is `ClientGone`; a cancelled task leaves the line too."""
        capacity = await read_capacity()
        with self._lock:
            self.capacity = capacity
            self._grant()  # the capacity may have grown: those already waiting go first
            if not self._line and self.in_flight + n_jobs <= capacity:
                self.in_flight += n_jobs
                return Admission(n_jobs, self._give_back)
            if len(self._line) >= self.max_waiting:
                self.refused["line_full"] += 1
                raise WaitingFull(self.max_waiting)
            waiter = _Waiter(n_jobs, asyncio.get_running_loop().create_future())
            self._line.append(waiter)
        handed = False
        reason = "cancelled"
        try:
            await self._wait(waiter, read_capacity, client_gone)
            ticket = Admission(n_jobs, self._give_back)
            handed = True
            self.waited += 1
            return ticket
        except WaitedTooLong:
            reason = "wait_timeout"
            raise
        except ClientGone:
            reason = "client_gone"
            raise
        finally:
            if not handed:
                self._leave(waiter, reason)

    async def _wait(self, waiter: _Waiter, read_capacity: Callable[[], Awaitable[int]],
                    client_gone: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        gone: asyncio.Task[None] | None = loop.create_task(client_gone()) if client_gone is not None else None
        try:
            while not waiter.granted:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise WaitedTooLong(self.wait_s)
                watched: set[asyncio.Future[Any]] = {waiter.wake} | ({gone} if gone is not None else set())
                await asyncio.wait(watched, timeout=min(remaining, self.refresh_s),
                                   return_when=asyncio.FIRST_COMPLETED)
                if waiter.granted:
                    return
                if gone is not None and gone.done():
                    gone.result()  # a failed watch is raised, not taken for a disconnect
                    raise ClientGone()
                if self._line and self._line[0] is waiter:  # the head re-reads the capacity: a gang may be ready
                    capacity = await read_capacity()
                    with self._lock:
                        self.capacity = capacity
                        self._grant()
        finally:
            if gone is not None:
                gone.cancel()

    def _leave(self, waiter: _Waiter, reason: str) -> None:
        """A waiter that will not take its ticket: out of the line, or its room given back if it was granted just
        now; either may let the next in."""
        with self._lock:
            if waiter.granted:
                self.in_flight -= waiter.n_jobs
            else:
                self._line.remove(waiter)
                self.refused[reason] += 1
            self._grant()

    def _give_back(self, n_jobs: int) -> None:
        with self._lock:
            self.in_flight -= n_jobs
            self._grant()

    def _grant(self) -> None:
        """Admit waiters from the head of the line while they fit (strictly in order). Holds the lock."""
        while self._line and self.in_flight + self._line[0].n_jobs <= self.capacity:
            waiter = self._line.popleft()
            waiter.granted = True
            self.in_flight += waiter.n_jobs
            waiter.wake.get_loop().call_soon_threadsafe(_wake, waiter.wake)

    def snapshot(self) -> dict[str, Any]:
        """Figures for /status."""
        return {"capacity": self.capacity, "admitted": self.in_flight, "waiting": self.waiting,
                "max_waiting": self.max_waiting, "queue_wait_s": self.wait_s, "waited": self.waited,
                "refused": dict(self.refused)}


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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
        bounded = BodyDeadline(receive, lim.body_read_timeout_s, self.refused)
        releases = ReleaseScope(bounded)
        token = _REQUEST_SCOPE.set(releases)
        started = False

        async def noting_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded, noting_send)
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

    def snapshot(self) -> dict[str, Any]:
        """Figures for /status."""
        lim = self.limits
        return {"held": self.held, "max_ingress_requests": lim.max_ingress_requests,
                "max_concurrent_per_key": lim.max_concurrent_per_key, "body_read_timeout_s": lim.body_read_timeout_s,
                "refused": dict(self.refused)}
