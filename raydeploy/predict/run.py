"""`raydeploy predict`'s run: lines stream from the input through a bounded window over the gang, and rows
are written in input order as soon as the head of the window is done.

At most `window` lines (4 x the gang's capacity of `engine.max_slots` plus a bounded queue) are between the
input and the output at once, and at most the capacity of them are at the gang; a line is read and tokenized
only when the window has room. A failed line becomes an error row (`--on-error skip`) or stops the run after
every earlier row is written (`fail`). A gang failure mid-run (host death) ends in-flight requests with
retriable errors; they are resubmitted once the supervisor has rebuilt the gang, up to `cluster.max_restarts`
times, after which the line gets an error row. A gang that does not come back stops the run (exit 1), every
finished row written: run it again to resume.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydeploy.config import Config
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.step import SamplingParams
from raydeploy.gang.bringup import GangError
from raydeploy.predict.input import BadLine, Example, PredictInputError, input_lines, parse_line
from raydeploy.predict.output import OutputLock, OutputWriter, error_row, result_row, resume_rows

WINDOW_PER_CAPACITY = 4
"""Lines in the window per request the gang holds at once: room for short lines to finish behind a long one."""


class PredictRunError(RuntimeError):
    """The run stopped: a failed line under --on-error fail, or a gang that did not come back."""


@dataclass
class Outcome:
    """The tokens generated for one example, or why there are none (`error`, `error_type`)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    retriable: bool = False
    error_type: str | None = None


def make_request(ex: Example, temperature: float | None, cfg: Config, attempt: int = 0) -> GenerationRequest:
    """The line's request: the config's engine.sampling, `temperature` (the --temperature flag) over it when
    given, seeded by the line's index."""
    sampling = SamplingParams.resolve(cfg.engine.sampling, temperature=temperature, seed=ex.index)
    return GenerationRequest(request_id=f"predict-{ex.index}-{attempt}", prompt_token_ids=ex.prompt_token_ids,
                             max_tokens=ex.max_tokens, sampling=sampling)


async def _generate_one(gang: Any, feeds: Any, req: GenerationRequest) -> Outcome:
    out = Outcome()
    stream = feeds.stream(gang.coordinator(), req)
    try:
        async for batch in stream:
            for ev in batch:
                if ev.token_id is not None:
                    out.token_ids.append(int(ev.token_id))
                if ev.finish_reason is not None:
                    out.finish_reason, out.error, out.retriable = ev.finish_reason, ev.error, ev.retriable
    finally:
        await stream.aclose()  # a request timed out here is aborted at rank 0 now
    return out


def _failed(message: str, error_type: str) -> Outcome:
    return Outcome(finish_reason="error", error=message, error_type=error_type)


async def generate_all(gang: Any, items: Iterable[Example | BadLine], temperature: float | None, cfg: Config,
                       write: Callable[[Example | BadLine, Outcome], None], in_flight: int, progress: Any = None,
                       *, on_error: str = "skip", window: int | None = None) -> None:
    """Generate every item, `in_flight` requests at the gang at once and at most `window` items taken from
    `items` and not yet written; call `write(item, outcome)` in input order, each as soon as every earlier one
    is written. A BadLine, or a line whose generation failed, is written with an error outcome (`on_error`
    skip) or raises PredictRunError naming it, every earlier item written (fail). Retriable gang failures are
    retried once the gang is ready again; a gang that does not come back raises PredictRunError."""
    from raydeploy.gang.feed import Feeds

    window = window or WINDOW_PER_CAPACITY * in_flight
    feeds = Feeds()  # one token stream from rank 0 for all the requests in flight
    sem = asyncio.Semaphore(in_flight)
    timeout_s = cfg.serving.request_timeout_s
    max_attempts = cfg.cluster.max_restarts + 1
    ready_timeout_s = cfg.cluster.placement_timeout_s + cfg.cluster.init_timeout_s + cfg.cluster.rpc_timeout_s
    # the gang generation requests go to, as last seen ready: a request that fails waits for a later one
    seen = {"generation": (await asyncio.to_thread(gang.state))["generation"]}

    async def run(ex: Example) -> Outcome:
        async with sem:
            for attempt in range(max_attempts):
                sent_to = seen["generation"]
                try:
                    out = await asyncio.wait_for(_generate_one(gang, feeds, make_request(ex, temperature, cfg, attempt)),
                                                 timeout_s)
                except TimeoutError:
                    return _failed(f"no result within serving.request_timeout_s={timeout_s:g}s", "timeout")
                except GangError as e:  # the gang is restarting: not ready to take the request
                    if not e.retriable or attempt + 1 == max_attempts:
                        raise
                    out = Outcome(finish_reason="error", error=str(e), retriable=True)
                if out.finish_reason != "error":
                    return out
                if not out.retriable:
                    return _failed(out.error or "the engine failed the request", "generation_error")
                if attempt + 1 == max_attempts:
                    return _failed(f"failed on {attempt + 1} gang generation(s) (cluster.max_restarts="
                                   f"{cfg.cluster.max_restarts}); last: {out.error}", "gang_failure")
                st = await asyncio.to_thread(gang.wait_ready, ready_timeout_s, newer_than=sent_to)
                seen["generation"] = max(seen["generation"], st["generation"])
            raise AssertionError("unreachable")

    loop = asyncio.get_running_loop()
    pending: deque[tuple[Example | BadLine, asyncio.Future[Outcome]]] = deque()
    source: Iterator[Example | BadLine] = iter(items)
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < window:
                item = next(source, None)  # read and tokenize the next line only now
                if item is None:
                    exhausted = True
                elif isinstance(item, BadLine):
                    fut: asyncio.Future[Outcome] = loop.create_future()
                    fut.set_result(_failed(item.reason, "invalid_input"))
                    pending.append((item, fut))
                else:
                    pending.append((item, asyncio.ensure_future(run(item))))
            if not pending:
                return
            item, fut = pending.popleft()
            try:
                out = await fut
            except GangError as e:
                raise PredictRunError(f"input line {item.index}: {e}") from None
            if out.finish_reason == "error" and on_error == "fail":
                raise PredictRunError(f"input line {item.index}: {out.error_type}: {out.error} (--on-error fail; "
                                      f"every earlier line is written)")
            write(item, out)
            if progress is not None:
                progress.update(1)
    finally:
        for _, f in pending:
            f.cancel()
        await asyncio.gather(*(f for _, f in pending), return_exceptions=True)
        await feeds.close()


def _codec_for(cfg: Config, checkpoint_path: str) -> Any:
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(checkpoint_path)


@dataclass
class _Tally:
    rows: int = 0
    errors: int = 0
    tokens: int = 0


def run_predict(cfg: Config, args: argparse.Namespace, *, engine: str | None = None, gang: Any = None) -> int:
    """`raydeploy predict`: lock the output, check the rows already there against the input, generate the
    rest over the gang and append their rows in input order. Returns the exit status.

    `gang`: a ready gang to use (and leave running) instead of starting one (Ray must be initialised)."""
    from raydeploy.gang.gang import resolve_checkpoint_path

    engine = engine or getattr(args, "engine", None) or "real"
    on_error = getattr(args, "on_error", None) or "skip"
    t0 = time.perf_counter()
    in_path, out_path = Path(args.input), Path(args.output)
    checkpoint_path = resolve_checkpoint_path(cfg)
    codec = _codec_for(cfg, checkpoint_path)
    max_tokens = args.max_tokens if args.max_tokens is not None else cfg.engine.max_new_tokens
    tally = _Tally()

    def say(msg: str) -> None:
        print(f"raydeploy predict: {msg}", file=sys.stderr)

    def write(writer: OutputWriter, item: Example | BadLine, out: Outcome) -> None:
        if out.finish_reason == "error":
            row = error_row(item, out.error or "", out.error_type or "error")
            tally.errors += 1
            say(f"{in_path}:{item.index}: {row['error']['type']}: {out.error} (error row written)")
        else:
            assert isinstance(item, Example)
            row = result_row(item, out.token_ids, out.finish_reason, codec)
            tally.tokens += len(out.token_ids)
        writer.write(row)
        tally.rows += 1

    try:
        try:
            fin = in_path.open("rb")
        except OSError as e:
            raise PredictInputError(f"cannot read input {in_path}: {e}") from None
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with fin, OutputLock(out_path):
            lines = input_lines(fin)
            done = resume_rows(out_path, in_path, lines)
            say(f"{done} line(s) already in {out_path}")
            items = (parse_line(line, codec, cfg, max_tokens) for line in lines)
            with OutputWriter(out_path) as writer, _progress() as bar:
                # lines up to the first usable one need no gang: a run with nothing to generate starts none
                first = None
                for item in items:
                    if isinstance(item, Example):
                        first = item
                        break
                    if on_error == "fail":
                        raise PredictRunError(f"input line {item.index}: invalid_input: {item.reason} "
                                              f"(--on-error fail; every earlier line is written)")
                    write(writer, item, _failed(item.reason, "invalid_input"))
                gen_s = 0.0
                if first is not None:
                    with _gang(cfg, args, engine, gang, checkpoint_path) as g:
                        in_flight = cfg.engine.max_slots + min(cfg.serving.max_queue, cfg.engine.max_slots)
                        t_gen = time.perf_counter()
                        asyncio.run(generate_all(g, itertools.chain([first], items), args.temperature, cfg,
                                                 lambda it, out: write(writer, it, out), in_flight, bar,
                                                 on_error=on_error))
                        gen_s = time.perf_counter() - t_gen
        rate = f" ({tally.rows / gen_s:.2f} rows/s, {tally.tokens / gen_s:.1f} tokens/s)" if gen_s > 0 else ""
        say(f"wrote {tally.rows} row(s) ({tally.errors} error row(s)) to {out_path}: {tally.tokens} tokens in "
            f"{gen_s:.1f}s{rate}; total {time.perf_counter() - t0:.1f}s")
        return 0
    except (PredictInputError, PredictRunError, GangError) as e:
        if isinstance(e, GangError):  # bring-up failed: no line is to blame
            e = PredictRunError(f"the gang did not come up ({e.phase or 'bring-up'}): {e}")
        if tally.rows:
            say(f"{tally.rows} row(s) written to {out_path} before stopping; run again to resume")
        say(str(e).replace("input line ", f"{in_path}:", 1) if str(e).startswith("input line ") else str(e))
        return 1


class _gang:
    """The gang for a run: `gang` as given, or one started (with Ray, if not connected) and shut down after."""

    def __init__(self, cfg: Config, args: argparse.Namespace, engine: str, gang: Any, checkpoint_path: str) -> None:
        self.cfg, self.args, self.engine, self.gang, self.checkpoint_path = cfg, args, engine, gang, checkpoint_path
        self.own = gang is None
        self.started_ray = False

    def __enter__(self) -> Any:
        from raydeploy.gang.gang import start_gang
        from raydeploy.serve.run import connect_ray

        c = self.cfg.cluster
        if self.own:
            self.started_ray = connect_ray(getattr(self.args, "address", None) or c.ray_address)
            try:
                self.gang = start_gang(self.cfg, engine=self.engine,
                                       checkpoint_path=None if self.engine == "toy" else self.checkpoint_path)
            except BaseException:
                self.__exit__()
                raise
        try:
            self.gang.wait_ready(c.placement_timeout_s + c.init_timeout_s + c.rpc_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self.gang

    def __exit__(self, *exc: object) -> None:
        if self.own and self.gang is not None:
            self.gang.shutdown(self.cfg.cluster.rpc_timeout_s)
            self.gang = None
        if self.started_ray:
            import ray

            ray.shutdown()
            self.started_ray = False


class _progress:
    """tqdm on stderr (quiet when stderr is not a terminal and RAYDEPLOY_PROGRESS is unset); rows written."""

    def __init__(self) -> None:
        from tqdm import tqdm

        disable = not (sys.stderr.isatty() or os.environ.get("RAYDEPLOY_PROGRESS"))
        self.bar = tqdm(unit="row", file=sys.stderr, disable=disable)

    def __enter__(self) -> Any:
        return self.bar

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def examples_from_prompts(prompts: Iterable[str], codec: Any, max_tokens: int) -> list[Example]:
    """Examples from raw prompts (benchmarks, tests)."""
    return [Example(i, i, tuple(codec.encode(p)), max_tokens) for i, p in enumerate(prompts, start=1)]
