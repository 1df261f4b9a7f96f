"""Offline batch inference over the gang: `raydeploy predict CONFIG --input in.jsonl --output out.jsonl`.

Each input line is `{"prompt": "..."}` or `{"messages": [{"role", "content"}, ...]}`, optionally with
`"id"` and `"max_tokens"`. Every line is read, parsed and tokenized before the gang starts, so a bad line
(not JSON, no prompt, a prompt too long for the model) is reported with its line number at once, and
either skipped or fatal (`--on-bad-line`). Prompts are fed to the rank-0 coordinator with continuous
batching (at most `max_slots` plus a bounded queue in flight), and results are written in input order,
one JSON line each, flushed as soon as every earlier line is written. The output is therefore always a
complete prefix of the work in input order, which makes the job resumable: lines already in the output
(matched by input line number) are skipped, and a torn last line from a killed run is dropped.
A gang failure mid-run (host death) ends in-flight requests with retriable errors; they are resubmitted
once the supervisor has rebuilt the gang, up to `cluster.max_restarts` times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydeploy.config import Config
from raydeploy.engine.request import GenerationRequest
from raydeploy.engine.step import SamplingParams


class PredictInputError(ValueError):
    """A bad input line under --on-bad-line fail, or an input/output file that cannot be used."""


@dataclass(frozen=True)
class Example:
    """One prompt to generate for; `index` is its 1-based line number in the input file."""

    index: int
    id: Any
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class BadLine:
    index: int
    reason: str


@dataclass
class Outcome:
    """The tokens generated for one example."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    retriable: bool = False


# -- input ------------------------------------------------------------------------------------------------


def parse_line(text: str, index: int, codec: Any, cfg: Config, default_max_tokens: int) -> Example:
    """One input line -> Example; raises ValueError with the reason when the line cannot be used."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, found {type(row).__name__}")
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt == has_messages:
        raise ValueError('needs exactly one of "prompt" (a string) or "messages" (a list of {role, content})')
    if has_prompt:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError('"prompt" must be a non-empty string')
        ids = codec.encode(row["prompt"])
    else:
        msgs = row["messages"]
        if (not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs)):
            raise ValueError('"messages" must be a non-empty list of {"role": str, "content": str}')
        ids = codec.encode_chat(codec.chat_prompt(msgs))
    max_tokens = row.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f'"max_tokens" must be a positive integer, found {max_tokens!r}')
    if max_tokens > cfg.engine.max_new_tokens:
        raise ValueError(f'"max_tokens" {max_tokens} exceeds engine.max_new_tokens {cfg.engine.max_new_tokens}')
    limit = min(cfg.model.max_seq_len - max_tokens, cfg.engine.prefill_buckets[-1])
    if not ids:
        raise ValueError("the prompt has no tokens")
    if len(ids) > limit:
        raise ValueError(f"prompt has {len(ids)} tokens; model.max_seq_len {cfg.model.max_seq_len} with max_tokens "
                         f"{max_tokens} leaves room for {limit}")
    return Example(index, row.get("id", index), tuple(int(t) for t in ids), max_tokens)


def read_examples(path: Path, codec: Any, cfg: Config, default_max_tokens: int,
                  on_bad_line: str = "skip") -> tuple[list[Example], list[BadLine]]:
    """Every usable line of `path`; bad lines are returned (skip) or raise PredictInputError (fail)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PredictInputError(f"cannot read input {path}: {e}") from None
    examples: list[Example] = []
    bad: list[BadLine] = []
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            examples.append(parse_line(text, i, codec, cfg, default_max_tokens))
        except ValueError as e:
            if on_bad_line == "fail":
                raise PredictInputError(f"{path}:{i}: {e}") from None
            bad.append(BadLine(i, str(e)))
    return examples, bad


# -- output (resume) ----------------------------------------------------------------------------------------


def load_done(path: Path) -> set[int]:
    """Input line numbers already in `path`; a torn last line (a killed run) is cut off the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with path.open("r+b") as f:
            f.truncate(len(keep))
    done: set[int] = set()
    for n, line in enumerate(keep.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            done.add(int(json.loads(line)["index"]))
        except (ValueError, KeyError, TypeError):
            raise PredictInputError(f"{path}:{n}: not a raydeploy predict output line; refusing to resume "
                                    f"into it (choose another --output)") from None
    return done


def result_row(ex: Example, out: Outcome, codec: Any) -> dict[str, Any]:
    return {"index": ex.index, "id": ex.id, "text": codec.decode(out.token_ids), "token_ids": out.token_ids,
            "finish_reason": out.finish_reason, "prompt_tokens": len(ex.prompt_token_ids),
            "completion_tokens": len(out.token_ids)}


# -- generation over the gang -----------------------------------------------------------------------------------


def make_request(ex: Example, temperature: float, cfg: Config, attempt: int = 0) -> GenerationRequest:
    s = cfg.engine.sampling
    sampling = SamplingParams(temperature=temperature, top_p=s.top_p if temperature > 0 else 1.0,
                              top_k=s.top_k if temperature > 0 else 0,
                              repetition_penalty=s.repetition_penalty, seed=ex.index)
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


async def generate_all(gang: Any, examples: list[Example], temperature: float, cfg: Config,
                       write: Any, in_flight: int, progress: Any = None) -> None:
    """Generate every example with at most `in_flight` requests at once; call `write(ex, outcome)` in input
    order. Retriable gang failures are retried after the gang is ready again."""
    from raydeploy.gang.feed import Feeds

    feeds = Feeds()  # one token stream from rank 0 for all the requests in flight
    sem = asyncio.Semaphore(in_flight)
    timeout_s = cfg.serving.request_timeout_s
    max_attempts = cfg.cluster.max_restarts + 1
    ready_timeout_s = cfg.cluster.placement_timeout_s + cfg.cluster.init_timeout_s + cfg.cluster.rpc_timeout_s
    # the gang generation requests go to, as last seen ready: a request that fails waits for a later one
    seen = {"generation": (await asyncio.to_thread(gang.state))["generation"]}

    async def run(ex: Example) -> Outcome:
        from raydeploy.gang.bringup import GangError

        async with sem:
            for attempt in range(max_attempts):
                sent_to = seen["generation"]
                try:
                    out = await asyncio.wait_for(_generate_one(gang, feeds, make_request(ex, temperature, cfg, attempt)),
                                                 timeout_s)
                except TimeoutError:
                    raise PredictInputError(f"input line {ex.index}: no result within serving.request_timeout_s="
                                            f"{timeout_s:g}s") from None
                except GangError as e:  # the gang is restarting: not ready to take the request
                    if not e.retriable or attempt + 1 == max_attempts:
                        raise
                    out = Outcome(finish_reason="error", error=str(e), retriable=True)
                if out.finish_reason != "error":
                    return out
                if not out.retriable or attempt + 1 == max_attempts:
                    raise RuntimeError(f"input line {ex.index}: generation failed after {attempt + 1} attempt(s): "
                                       f"{out.error}")
                st = await asyncio.to_thread(gang.wait_ready, ready_timeout_s, newer_than=sent_to)
                seen["generation"] = max(seen["generation"], st["generation"])
            raise AssertionError("unreachable")

    tasks = [asyncio.ensure_future(run(ex)) for ex in examples]
    try:
        for ex, task in zip(examples, tasks, strict=True):
            write(ex, await task)
            if progress is not None:
                progress.update(1)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await feeds.close()


def _codec_for(cfg: Config, checkpoint_path: str) -> Any:
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(checkpoint_path)


def run_predict(cfg: Config, args: argparse.Namespace, *, engine: str | None = None, gang: Any = None) -> int:
    """`raydeploy predict`: read, skip what is done, generate the rest over the gang, append in order.

    `gang`: a ready gang to use (and leave running) instead of starting one (Ray must be initialised)."""
    from raydeploy.gang.gang import resolve_checkpoint_path, start_gang

    engine = engine or getattr(args, "engine", None) or "real"

    t0 = time.perf_counter()
    in_path, out_path = Path(args.input), Path(args.output)
    checkpoint_path = resolve_checkpoint_path(cfg)
    codec = _codec_for(cfg, checkpoint_path)
    max_tokens = args.max_tokens if args.max_tokens is not None else cfg.engine.max_new_tokens
    try:
        examples, bad = read_examples(in_path, codec, cfg, max_tokens, args.on_bad_line)
        done = load_done(out_path)
    except PredictInputError as e:
        print(f"raydeploy predict: {e}", file=sys.stderr)
        return 1
    for b in bad:
        print(f"raydeploy predict: {in_path}:{b.index}: skipped: {b.reason}", file=sys.stderr)
    todo = [ex for ex in examples if ex.index not in done]
    print(f"raydeploy predict: {len(examples)} prompt(s), {len(bad)} bad line(s) skipped, "
          f"{len(examples) - len(todo)} already in {out_path}, {len(todo)} to generate", file=sys.stderr)
    if not todo:
        return 0

    from raydeploy.serve.run import connect_ray

    own_gang = gang is None
    started_ray = connect_ray(getattr(args, "address", None) or cfg.cluster.ray_address) if own_gang else False
    try:
        if own_gang:
            gang = start_gang(cfg, engine=engine, checkpoint_path=None if engine == "toy" else checkpoint_path)
        c = cfg.cluster
        gang.wait_ready(c.placement_timeout_s + c.init_timeout_s + c.rpc_timeout_s)
        in_flight = cfg.engine.max_slots + min(cfg.serving.max_queue, cfg.engine.max_slots)
        n_tokens = 0
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with out_path.open("a", encoding="utf-8") as f, _progress(len(todo)) as bar:
            def write(ex: Example, out: Outcome) -> None:
                nonlocal n_tokens
                f.write(json.dumps(result_row(ex, out, codec), ensure_ascii=False) + "\n")
                f.flush()
                n_tokens += len(out.token_ids)

            t_gen = time.perf_counter()
            asyncio.run(generate_all(gang, todo, args.temperature, cfg, write, in_flight, bar))
            gen_s = time.perf_counter() - t_gen
        print(f"raydeploy predict: wrote {len(todo)} line(s) to {out_path}: {n_tokens} tokens in {gen_s:.1f}s "
              f"({len(todo) / gen_s:.2f} prompts/s, {n_tokens / gen_s:.1f} tokens/s); total "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
        return 0
    except (PredictInputError, RuntimeError) as e:
        print(f"raydeploy predict: {e}", file=sys.stderr)
        return 1
    finally:
        if own_gang and gang is not None:
            gang.shutdown(cfg.cluster.rpc_timeout_s)
        if started_ray:
            import ray

            ray.shutdown()


class _progress:
    """tqdm on stderr (quiet when stderr is not a terminal and RAYDEPLOY_PROGRESS is unset)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        disable = not (sys.stderr.isatty() or os.environ.get("RAYDEPLOY_PROGRESS"))
        self.bar = tqdm(total=total, unit="prompt", file=sys.stderr, disable=disable)

    def __enter__(self) -> Any:
        return self.bar

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def examples_from_prompts(prompts: Iterable[str], codec: Any, max_tokens: int) -> list[Example]:
    """Examples from raw prompts (benchmarks, tests)."""
    return [Example(i, i, tuple(codec.encode(p)), max_tokens) for i, p in enumerate(prompts, start=1)]
