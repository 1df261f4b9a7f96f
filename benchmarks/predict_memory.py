"""Peak memory of the `raydeploy predict` driver against the length of its input, this tree against a peer tree.

The driver runs in a child process per (tree, input length) and reports its own peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`) after `run_predict` has written every row. The gang is a stand-in
coordinator inside the child that answers each request with its tokens at once (the feed calls a real rank 0
serves: submit / feed / abort / close_feed), so the figure is the driver's alone and a 400k-line run takes
seconds, not the hour a real model would; the driver's own work (reading, tokenizing with the demo model's
tokenizer, the window, ordering, writing) is the real code. The peer is another checkout of raydeploy
(`git worktree add /tmp/old-predict <commit>`), driven the same way.

    flock /tmp/raydeploy-heavy.lock .venv/bin/python benchmarks/predict_memory.py [--lines 100000 400000]
        [--peer /tmp/old-predict] [--gang instant|toy]

`--gang toy` runs the stand-in engine on a real local Ray cluster instead (the driver starts it, as
`raydeploy predict --engine toy` does), so Ray's own per-request state in the driver is counted too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GANGS = {"instant": "in-process stand-in coordinator answering each request at once (the driver alone)",
         "toy": "local Ray, a 2-host gang of the stand-in engine (--engine toy), started by the driver"}
TOPICS = ["rivers", "the moon", "jazz", "bread", "glaciers", "chess", "rain", "maps", "owls", "tea", "wind"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def write_input(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(1, n + 1):
            f.write(json.dumps({"prompt": f"Line {i}: write one sentence about {TOPICS[i % len(TOPICS)]}.",
                                "id": f"q{i}", "max_tokens": 4}) + "\n")


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _InstantCoordinator:
    """Answers each request at once with tokens last+1, last+2, ... (the calls a feed makes of rank 0)."""

    def __init__(self) -> None:
        self._actor_id = types.SimpleNamespace(hex=lambda: "instant")
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.submit, self.feed = _Method(self._submit), _Method(self._feed)
        self.abort, self.close_feed = _Method(lambda request_id: None), _Method(self._close)

    def _queue(self, name: str) -> asyncio.Queue[Any]:
        return self.queues.setdefault(name, asyncio.Queue())

    async def _submit(self, req: Any, name: str) -> None:
        from raydeploy.engine.request import TokenEvent

        last = req.prompt_token_ids[-1]
        self._queue(name).put_nowait([TokenEvent(req.request_id, last + i + 1, 0.0, i,
                                                 "length" if i + 1 == req.max_tokens else None)
                                      for i in range(req.max_tokens)])

    async def _feed(self, name: str) -> Any:
        async def ready(batch: Any) -> Any:
            return batch

        q = self._queue(name)
        while (batch := await q.get()) is not None:
            yield ready(batch)

    async def _close(self, name: str) -> None:
        self._queue(name).put_nowait(None)


class _InstantGang:
    def __init__(self) -> None:
        self.coord = _InstantCoordinator()

    def coordinator(self, timeout_s: float = 30.0) -> Any:
        return self.coord

    def state(self) -> dict[str, Any]:
        return {"state": "ready", "generation": 1}

    def wait_ready(self, timeout_s: float, poll_s: float = 0.2, newer_than: int | None = None) -> dict[str, Any]:
        return self.state()


def child(src: str, inp: str, out: str, gang: str) -> None:
    """Run one driver from the tree at `src` and print its peak RSS as JSON."""
    import resource

    sys.path.insert(0, src)
    import raydeploy
    from raydeploy.config import load_config
    from raydeploy.predict import run_predict

    assert Path(raydeploy.__file__).resolve().is_relative_to(Path(src).resolve()), raydeploy.__file__
    cfg = load_config(str(REPO / "configs" / "predict-small.yaml"))
    args = argparse.Namespace(input=inp, output=out, max_tokens=None, temperature=0.0, on_bad_line="skip",
                              on_error="skip", address=None, engine="toy")
    samples: list[tuple[float, int, float]] = []
    stop = threading.Event()

    def sample() -> None:  # (seconds, output bytes, RSS MiB) every second: is growth linear in the rows?
        while not stop.wait(1.0):
            rss_kib = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                           if line.startswith("VmRSS:"))
            size = os.path.getsize(out) if os.path.exists(out) else 0
            samples.append((round(time.perf_counter() - t0, 1), size, round(rss_kib / 1024, 1)))

    t0 = time.perf_counter()
    threading.Thread(target=sample, daemon=True).start()
    # toy: the driver starts a local Ray and a 2-host gang of the stand-in engine, as `--engine toy` does
    rc = run_predict(cfg, args, gang=_InstantGang() if gang == "instant" else None, engine="toy")
    seconds = time.perf_counter() - t0
    stop.set()
    rows = sum(1 for _ in open(out, "rb"))
    print(json.dumps({"rc": rc, "rows": rows, "seconds": round(seconds, 1),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "rss_samples": samples[:: max(1, len(samples) // 24)]}))


def measure(src: Path, n: int, workdir: Path, gang: str) -> dict[str, Any]:
    inp, out = workdir / f"in-{n}.jsonl", workdir / f"out-{n}-{src.name}.jsonl"
    if not inp.exists():
        write_input(inp, n)
    out.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, __file__, "--child", str(src), str(inp), str(out), gang], capture_output=True,
                       text=True, timeout=3600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if r.returncode != 0:
        raise RuntimeError(f"driver from {src} failed: {r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0 and res["rows"] == n, {k: v for k, v in res.items() if k != "rss_samples"}
    return res


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
        return 0
    sys.path.insert(0, str(REPO))
    from benchmarks.machine import cpu_flags

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, nargs="+", default=[100_000, 400_000])
    ap.add_argument("--peer", default="/tmp/old-predict", help="another raydeploy checkout to compare against")
    ap.add_argument("--gang", choices=["instant", "toy"], default="instant",
                    help="instant: a stand-in coordinator in the driver's process (the driver alone; default); "
                         "toy: a real local Ray cluster and a 2-host gang of the stand-in engine (slower)")
    ap.add_argument("--trees", nargs="+", choices=["this", "peer"], default=["this", "peer"])
    ap.add_argument("--output", default=None,
                    help="default benchmarks/results/predict_memory.json (predict_memory_toy.json with --gang toy)")
    a = ap.parse_args()
    peer = Path(a.peer)
    peer_commit = subprocess.run(["git", "-C", str(peer), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
    this_commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rdp-mem-", dir="/tmp") as d:
        for n in a.lines:
            for name, src in [(t, REPO if t == "this" else peer) for t in a.trees]:
                res = measure(src, n, Path(d), a.gang)
                runs.append({"tree": name, "lines": n, **res})
                print(f"{name:5s} {n:>8d} lines: peak driver RSS {res['peak_rss_mib']:8.1f} MiB, {res['seconds']}s; "
                      f"(s, output bytes, RSS MiB) {res['rss_samples'][::4]}", flush=True)
    result = {"benchmark": "predict driver peak RSS vs input lines",
              "gang": GANGS[a.gang],
              "this_commit": this_commit, "peer": str(peer), "peer_commit": peer_commit, "runs": runs,
              "machine": {"cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(), "python": platform.python_version(),
                          "cpu_model": cpu_model()}}
    output = a.output or str(REPO / "benchmarks" / "results" /
                             ("predict_memory.json" if a.gang == "instant" else "predict_memory_toy.json"))
    Path(output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
