"""`raydeploy serve`: join or start Ray, start the gang, serve it over HTTP, drain and tear down on a signal.

`start_serving(cfg)` is the reusable part (the CLI, tests and benchmarks use it): it deploys the Serve
application (the ingress and the gang replicas, each starting its own gang) and returns a `Serving` handle.
HTTP answers at once (/health 200, /ready 503) while the gangs start, load and compile; `/ready` turns 200
when the first gang is ready.
`run_serve(cfg, args)` adds the driver around it: checks that serving.host:port can be listened on before
it starts a local Ray (one line naming the address and the override when it cannot), prints where it
listens and when it is ready, waits for Ctrl-C / SIGTERM, then drains in-flight requests (Serve's graceful
shutdown), shuts the gang down and stops Serve (and Ray, if it started Ray itself), each step bounded.
With a local Ray the command runs in a session of its own behind a launcher that forwards signals
(raydeploy.serve.launcher), so a signal to the caller's whole process group does not reach Ray's processes.
If they get it anyway (every process of a systemd unit, say), the GCS is gone: there is nothing left to drain,
and the driver stops at once (exit 0) instead of waiting on it.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raydeploy.compat import disable_ray_auto_init
from raydeploy.config import Config

if TYPE_CHECKING:
    from raydeploy.gang.engines import EngineSource

DRAIN_TIMEOUT_S = 30.0
"""Seconds Serve waits for in-flight requests to finish at shutdown (beside the margin below)."""
SHUTDOWN_MARGIN_S = 30.0
"""Seconds more the driver allows for Serve's own shutdown, and for stopping a local Ray."""


@dataclass
class Serving:
    """A running deployment: the gang replicas (`gangs`, a raydeploy.gang.directory.GangSet) and the ingress."""

    cfg: Config
    gangs: Any
    url: str

    def wait_ready(self, timeout_s: float, count: int | None = None) -> dict[str, Any]:
        """Wait until `count` gangs (default replicas.min) are ready."""
        return self.gangs.wait_ready(timeout_s, count)

    def shutdown(self) -> None:
        """Drain (in-flight requests finish), stop every gang replica and its gang, then Serve."""
        from ray import serve

        from raydeploy.serve.deployment import APP_NAME

        try:
            serve.delete(APP_NAME, _blocking=True)
        finally:
            serve.shutdown()


LOCAL_RAY_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5",
                 "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
"""Set (unless already set) before a local Ray starts:
- its log monitor, which only forwards worker output to drivers (this one asks for none), then rescans the log
  directory for new files every 5 s instead of every 0.1 s. Measured on the 2-core machine serving 16 streams: the
  monitor's share of a core 7.6% -> 3.4%, CPU the hosts' steps get back;
- Serve's handles (the ingress's token streams from the gang replicas) over gRPC between the replicas instead of
  Ray's object transfers: on the same machine one stream 78.9 -> 89.2 tok/s and 16 streams 428.2 -> 451.8 tok/s
  (`benchmarks/serve_load.py`, one run each; docs/performance.md)."""


def connect_ray(address: str | None, *, temp_dir: str | None = None, num_cpus: int | None = None) -> bool:
    """Join `address` (or $RAY_ADDRESS) or start a local Ray; returns True when Ray was started here."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace="raydeploy", log_to_driver=False)
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = {"include_dashboard": False, "namespace": "raydeploy", "log_to_driver": False}
    if temp_dir:
        kwargs["_temp_dir"] = temp_dir
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ray.init(**kwargs)
    return True


def start_serving(cfg: Config, *, checkpoint_path: str | None = None,
                  engine: str | EngineSource = "real") -> Serving:
    """Deploy the gang replicas and the HTTP ingress on cfg.serving.host:port (Ray must be initialised);
    returns once the replicas have started (their gangs go on starting: see `Serving.wait_ready`).

    engine "toy" runs the gangs' stand-in engine (no weights) behind the real HTTP stack; the checkpoint
    still provides the tokenizer. Tests inject faults into every gang replica's first gang with an engine source
    (raydeploy.testing.faults.FaultyEngine).
    """
    from ray import serve

    from raydeploy.gang.directory import GangSet
    from raydeploy.gang.gang import resolve_checkpoint_path
    from raydeploy.serve.deployment import APP_NAME, build_serve_app

    path = checkpoint_path or resolve_checkpoint_path(cfg)
    app = build_serve_app(cfg, path, engine=engine)  # checks the API key source before anything starts
    serve.start(http_options={"host": cfg.serving.host, "port": cfg.serving.port})
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except BaseException:
        serve.shutdown()
        raise
    host = "127.0.0.1" if cfg.serving.host in ("0.0.0.0", "::") else cfg.serving.host
    return Serving(cfg, GangSet(APP_NAME, cfg, rpc_timeout_s=min(cfg.cluster.rpc_timeout_s, 60.0)),
                   f"http://{host}:{cfg.serving.port}")


class AddressUnavailable(RuntimeError):
    """serving.host:serving.port cannot be listened on; found before Ray starts."""


def check_address_free(host: str, port: int) -> None:
    """Bind `host:port` for a moment, as the Serve proxy will, or raise `AddressUnavailable` naming the address
    and the override to use. SO_REUSEADDR as in the proxy: a port in TIME_WAIT is free, a listening one is not."""
    if port == 0:
        return  # any free port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
            reason = e.strerror or str(e)
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                hint = "choose another port with --set serving.port=PORT (or stop what holds it)"
            else:
                hint = "check serving.host (--set serving.host=HOST)"
            raise AddressUnavailable(f"cannot listen on {where}: {reason}; {hint}") from None


def _bringup_timeout_s(cfg: Config) -> float:
    c = cfg.cluster
    per_try = c.placement_timeout_s + c.init_timeout_s + 2 * c.rpc_timeout_s
    return per_try * (c.max_restarts + 1) + c.restart_backoff_s * (2 ** c.max_restarts)


def gcs_reachable(gcs_address: str, timeout_s: float = 1.0) -> bool:
    """Whether Ray's GCS at `host:port` accepts a TCP connection within `timeout_s`."""
    host, _, port = gcs_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    return True


def run_bounded(fn: Callable[[], None], timeout_s: float, give_up: Callable[[], bool],
                poll_s: float = 0.2) -> str:
    """Run `fn` in a daemon thread; "done" when it returns (re-raising what it raised), "timeout" after
    `timeout_s`, "gave up" as soon as `give_up()` is true (e.g. Ray's GCS is gone, so `fn` would only wait for
    it). A call left behind dies with the process."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            raised.append(e)

    worker = threading.Thread(target=target, name=getattr(fn, "__name__", "bounded"), daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while worker.is_alive():
        worker.join(poll_s)
        if not worker.is_alive():
            break
        if give_up():
            return "gave up"
        if time.monotonic() > deadline:
            return "timeout"
    if raised:
        raise raised[0]
    return "done"


def _say(line: str, err: bool = False) -> None:
    print(f"raydeploy serve: {line}", file=sys.stderr if err else sys.stdout, flush=True)


def _watch(serving: Serving, stop: threading.Event, outcome: dict[str, Any], t0: float) -> None:
    """Report the gangs' state as it changes until `stop`; on a bring-up that fails or never ends, record the
    error in `outcome` and set `stop`. Runs in its own thread, so a signal is answered even while a status call
    waits (on a Ray whose processes the same signal has stopped, say)."""
    from raydeploy.gang.bringup import GangError

    cfg = serving.cfg
    last: tuple[str, int, int] | None = None
    ever_ready = False
    deadline = t0 + _bringup_timeout_s(cfg)
    try:
        while not stop.is_set():
            st = serving.gangs.state()
            if stop.is_set():
                return
            now = (st["state"], st["ready_gangs"], st["total_gangs"])
            if now != last:
                last = now
                extra = f" ({st['last_error']})" if st.get("last_error") and st["state"] != "ready" else ""
                _say(f"{st['ready_gangs']} of {st['total_gangs']} gang(s) ready, state {st['state']}{extra} after "
                     f"{time.monotonic() - t0:.1f}s")
                if st["state"] == "ready" and not ever_ready:
                    ever_ready = True
                    _say(f"ready: {serving.url}/v1 (OpenAI API), {serving.url}/ (chat page)")
            if st["state"] == "failed" and not ever_ready:
                outcome["error"] = f"the gang failed: {st.get('last_error')}"
                break
            if not ever_ready and time.monotonic() > deadline:
                raise GangError(f"no gang ready after {time.monotonic() - t0:.0f}s (state {st['state']})",
                                phase="serve")
            stop.wait(1.0)
    except Exception as e:  # noqa: BLE001 - the main thread reports it and exits 1
        if not stop.is_set():
            outcome["error"] = str(e)
    stop.set()


def _teardown(serving: Serving | None, started_ray: bool, gcs_address: str) -> bool:
    """Drain and stop Serve, then the local Ray (when started here), each bounded. A signal sent to the whole
    process group (systemd, `kill -- -PGID`) also stops Ray's own processes; then there is nothing left to
    drain, and waiting on the dead GCS would only end, a minute later, in an error."""
    import ray

    def gcs_gone() -> bool:
        return not gcs_reachable(gcs_address, timeout_s=0.5)

    gone = False
    if serving is not None:
        if gcs_gone():
            gone = True
            _say("Ray's processes have already stopped (the signal reached them too); nothing left to drain")
        else:
            _say("shutting down (in-flight requests drain first)")
            how = run_bounded(serving.shutdown, DRAIN_TIMEOUT_S + SHUTDOWN_MARGIN_S, gcs_gone)
            if how == "gave up":
                gone = True
                _say("Ray's processes stopped while draining (the signal reached them too); stopping")
            elif how == "timeout":
                _say(f"draining took longer than {DRAIN_TIMEOUT_S + SHUTDOWN_MARGIN_S:.0f}s; stopping", err=True)
    if started_ray and run_bounded(ray.shutdown, SHUTDOWN_MARGIN_S, lambda: False) != "done":
        _say(f"the local Ray did not stop within {SHUTDOWN_MARGIN_S:.0f}s", err=True)
    return gone


def _exit_status(raised: BaseException | None, outcome: dict[str, Any]) -> int:
    """What `run_serve` would have returned: 1 on an error (raised, or a failed bring-up), else 0."""
    return 1 if raised is not None or "error" in outcome else 0


def run_serve(cfg: Config, args: argparse.Namespace) -> int:
    stop = threading.Event()
    signals = {}
    outcome: dict[str, Any] = {}

    def on_signal(signum: int, _frame: Any) -> None:
        if not stop.is_set():
            _say(f"{signal.Signals(signum).name} received; draining")
        stop.set()

    address = getattr(args, "address", None) or cfg.cluster.ray_address
    if not (address or os.environ.get("RAY_ADDRESS")):
        # Ray is started here, so the Serve proxy will listen on this machine: say now if it cannot, not
        # after Ray and the gang have started and the proxy has failed
        try:
            check_address_free(cfg.serving.host, cfg.serving.port)
        except AddressUnavailable as e:
            _say(str(e), err=True)
            return 1
        from raydeploy.serve.launcher import in_own_session, run_in_own_session

        argv = getattr(args, "argv", None)  # set by the CLI: the command line to start again
        if argv is not None and not in_own_session() and hasattr(os, "setsid"):
            return run_in_own_session(argv)
    started_ray = connect_ray(address)
    import ray

    # a Ray call still running in a thread when a signal stops Ray's processes must not start a new local Ray
    disable_ray_auto_init()

    gcs_address: str = ray.get_runtime_context().gcs_address
    # After ray.init: Ray's driver installs its own SIGTERM handling (exit at once), which would skip draining.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signals[sig] = signal.signal(sig, on_signal)
    serving: Serving | None = None
    started: list[Serving] = []

    ray_gone = False

    def gcs_gone_after_signal() -> bool:
        return stop.is_set() and not gcs_reachable(gcs_address, timeout_s=0.5)

    try:
        t0 = time.monotonic()
        # In a thread: a signal that also stopped Ray's processes must not leave this waiting on them
        how = run_bounded(lambda: started.append(start_serving(cfg, engine=getattr(args, "engine", "real"))),
                          _bringup_timeout_s(cfg), gcs_gone_after_signal)
        if how == "gave up":
            ray_gone = True
            _say("Ray's processes have stopped while the server was starting (the signal reached them too)")
            return 0
        if how == "timeout":
            _say(f"the server did not start within {_bringup_timeout_s(cfg):.0f}s", err=True)
            return 1
        serving = started[0]
        r = cfg.replicas
        count = f"{r.min}" if r.min == r.max else f"{r.min}-{r.max} (autoscaled)"
        _say(f"listening on {serving.url} (model {cfg.model.name or cfg.model.checkpoint}, {count} gang(s) of "
             f"{cfg.cluster.num_hosts} host(s) x {cfg.cluster.devices_per_host} device(s)); {serving.url}/ready "
             "turns 200 when a gang is ready")
        watcher = threading.Thread(target=_watch, args=(serving, stop, outcome, t0), name="gang-watch", daemon=True)
        watcher.start()
        while not stop.wait(1.0):  # a timed wait: the main thread runs the signal handlers
            pass
        if "error" in outcome:
            _say(outcome["error"], err=True)
            return 1
        return 0
    finally:
        stop.set()
        ray_gone = _teardown(serving, started_ray, gcs_address) or ray_gone
        for sig, handler in signals.items():
            signal.signal(sig, handler)
        _say("stopped")
        if ray_gone:
            # Ray's processes died under this one: the interpreter's exit would run Ray's own exit hooks against
            # them (and wait on a call still stuck in a thread), so leave now, with the status already decided
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_exit_status(sys.exc_info()[1], outcome))
