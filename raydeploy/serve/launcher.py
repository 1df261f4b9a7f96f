"""`raydeploy serve` with a local Ray: the server runs in a session of its own, this process forwards signals.

A stop signal sent to a whole process group (`kill -- -PGID`, a supervisor that signals the group, Ctrl-C at
a terminal) would otherwise reach the Ray processes that `ray.init` started beside the server: Ray's GCS and
raylet share their parent's process group, and on SIGTERM they stop at once, so Serve cannot drain and the
driver waits on a dead GCS. Here the invoking process stays in the caller's group as a thin launcher; it
starts the same command again in a new session (`start_new_session`), so neither the server nor its Ray
processes are in that group. Each SIGINT, SIGTERM or SIGHUP the launcher receives goes to the server, which
drains and stops its Ray (raydeploy.serve.run), and the launcher exits with the server's exit code.
On Linux the server also gets SIGTERM if the launcher dies (PR_SET_PDEATHSIG), so a launcher killed with
SIGKILL still leaves nothing running. Where every process gets the signal anyway (systemd's default
`KillMode=control-group`), raydeploy.serve.run sees Ray's processes gone and stops without draining.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

SESSION_ENV = "RAYDEPLOY_SERVE_OWN_SESSION"
"""Set to "1" in the server's environment: it is the process in its own session (it does not launch again)."""

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def in_own_session() -> bool:
    """Whether this process is the server that a launcher started."""
    return os.environ.get(SESSION_ENV) == "1"


def _stop_with_parent(parent_pid: int) -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux), or exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def run_in_own_session(argv: Sequence[str]) -> int:
    """Run `raydeploy <argv>` in a new session, forward SIGINT/SIGTERM/SIGHUP to it, return its exit code."""
    parent = os.getpid()  # preexec_fn is safe here: the launcher has started no threads
    env = {**os.environ, SESSION_ENV: "1"}
    child = subprocess.Popen([sys.executable, "-m", "raydeploy.cli", *argv], env=env, stdin=subprocess.DEVNULL,
                             start_new_session=True, preexec_fn=lambda: _stop_with_parent(parent))

    def forward(signum: int, _frame: FrameType | None) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass  # it has just exited

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        # The server bounds its own bring-up and teardown (raydeploy.serve.run); this only mirrors its life.
        code = child.wait()
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
