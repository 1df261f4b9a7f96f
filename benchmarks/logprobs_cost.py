"""What logprobs beyond the sampled token's cost the engine: streams with `top_logprobs=20` against streams
without, and a 1000-token prompt prefilled with prompt logprobs (20 alternatives) against a plain prefill, in the
same run, interleaved rounds (medians reported).

One process, one CPU device (a gang host's share of the embedded default), the real demo model and the serving
scheduler (`decode_steps` 4), prefix caching off so every prefill computes its whole prompt:

- TPOT (decode seconds per token after the first) of 1 and of 8 greedy streams with `top_logprobs=20` against the
  same streams without (the alternatives are a `lax.top_k` of the rows' logits under a cond, read back with the
  tokens; goal: at most 1.1x).
- TPOT of the same plain streams on a second engine whose step programs leave the logprob computations out
  (their outputs zeros): what requests without logprobs pay for the flags, the skipped loop and cond, and the
  extra outputs.
- Prefill time (submit to first token, `max_tokens` 1) of a 1000-token prompt with `prompt_logprobs=20` against
  without: the LM head then runs at every place, in blocks of `PLACE_BLOCK` (`raydeploy.engine.logprobs`), and the
  places' results come back.

The outputs are checked: the same tokens with and without logprobs, 20 sorted alternatives per token led by the
greedy one, one prompt entry per prompt token.

    .venv/bin/python benchmarks/logprobs_cost.py        # writes benchmarks/results/logprobs_cost.json
    .venv/bin/python benchmarks/logprobs_cost.py --rounds 1 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "logprobs_cost.json"
PROMPT_TOKENS = 1000


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per decode stream (eos ignored)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    _env()

    import jax
    import numpy as np
    from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)
    from transformers import AutoTokenizer

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.config import load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.engine.step import MAX_TOP_LOGPROBS
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh

    cfg = load_config(None, ["engine.max_slots=8", "model.max_seq_len=2048", "mesh.axes.dp=1", "cluster.num_hosts=1",
                             "engine.prefix_caching=false"])
    path = resolve_checkpoint(cfg.model.checkpoint)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    engine = build_engine(cfg, mesh, path).engine
    engine.warmup()
    bare = build_engine(cfg, mesh, path).engine

    def no_logprobs(model, matmul, h_gtd, tokens, logits, inp):  # StepBodies._logprobs, left out
        import jax.numpy as jnp

        from raydeploy.engine.logprobs import PLACE_COLUMNS, ROW_COLUMNS

        return (jnp.zeros((ROW_COLUMNS, logits.shape[0]), jnp.float32),
                jnp.zeros((PLACE_COLUMNS, tokens.shape[0]), jnp.float32))

    bare.programs_set.bodies._logprobs = no_logprobs  # before its programs are traced
    bare.warmup()
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(200))
    long_prompt = tuple(tok(text)["input_ids"][:PROMPT_TOKENS])
    assert len(long_prompt) == PROMPT_TOKENS
    short = tuple(tok("Write a short story about a lighthouse keeper and a storm.")["input_ids"])

    def run(reqs: list[GenerationRequest], eng=engine) -> list[list]:
        """Run requests together from one submit; each one's events with their arrival times."""
        runner = LocalRunner(eng, Scheduler.for_engine(eng, cfg))
        got: list[list] = [[] for _ in reqs]

        def sink(i: int):
            return lambda ev: got[i].append((time.perf_counter(), ev))

        t0 = time.perf_counter()
        with runner.loop.lock:
            for i, r in enumerate(reqs):
                runner.scheduler.submit(r, sink(i))
        runner.run_until_idle()
        for i, events in enumerate(got):
            end = events[-1][1]
            if end.finish_reason not in ("length", "stop"):
                raise RuntimeError(f"request {reqs[i].request_id}: {end.finish_reason} {end.error}")
        return [[(t - t0, ev) for t, ev in events] for events in got]

    def decode(streams: int, top: int, eng=engine) -> tuple[float, list[list[int]]]:
        """Median TPOT over `streams` greedy streams (`top` alternatives each) and their tokens."""
        reqs = [GenerationRequest(f"d{i}", short + (i,), args.new_tokens, ignore_eos=True, top_logprobs=top)
                for i in range(streams)]
        out = run(reqs, eng)
        tpots, tokens = [], []
        for events in out:
            toks = [(t, ev) for t, ev in events if ev.token_id is not None]
            tpots.append((toks[-1][0] - toks[0][0]) / (len(toks) - 1))
            tokens.append([ev.token_id for _, ev in toks])
            if top:
                for _, ev in toks:
                    alts = ev.top_logprobs
                    assert len(alts) == top and alts[0][0] == ev.token_id
                    assert all(a[1] >= b[1] for a, b in zip(alts, alts[1:], strict=False))
        return statistics.median(tpots), tokens

    def prefill(prompt_logprobs: int | None) -> tuple[float, int]:
        """Seconds from submit to the first token of the long prompt, and its first token."""
        (events,) = run([GenerationRequest("p", long_prompt, 1, prompt_logprobs=prompt_logprobs)])
        first_t, first = events[0]
        if prompt_logprobs is not None:
            assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == PROMPT_TOKENS
            assert all(len(e.top) == prompt_logprobs for e in first.prompt_logprobs[1:])
        return first_t, int(first.token_id)

    # untimed: every program's first run (the logprob branches included)
    decode(1, MAX_TOP_LOGPROBS)
    decode(8, 0)
    decode(1, 0, bare)
    decode(8, 0, bare)
    prefill(MAX_TOP_LOGPROBS)
    prefill(None)
    rows: dict[str, list[float]] = {k: [] for k in (
        "tpot_1_plain_s", "tpot_1_top20_s", "tpot_8_plain_s", "tpot_8_top20_s", "tpot_1_bare_s", "tpot_8_bare_s",
        "prefill_1000_plain_s",
        "prefill_1000_prompt_logprobs20_s")}
    for _ in range(args.rounds):
        for streams in (1, 8):
            plain, plain_tokens = decode(streams, 0)
            top, top_tokens = decode(streams, MAX_TOP_LOGPROBS)
            bare_s, bare_tokens = decode(streams, 0, bare)
            assert plain_tokens == top_tokens == bare_tokens, "alternatives changed the greedy tokens"
            rows[f"tpot_{streams}_bare_s"].append(bare_s)
            rows[f"tpot_{streams}_plain_s"].append(plain)
            rows[f"tpot_{streams}_top20_s"].append(top)
        plain_s, plain_first = prefill(None)
        lp_s, lp_first = prefill(MAX_TOP_LOGPROBS)
        assert plain_first == lp_first
        rows["prefill_1000_plain_s"].append(plain_s)
        rows["prefill_1000_prompt_logprobs20_s"].append(lp_s)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "flags": cpu_flags(),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)},
        "config": {"max_slots": 8, "decode_steps": cfg.engine.decode_steps, "prefill_chunk": cfg.engine.prefill_chunk,
                   "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_TOKENS, "sampling": "greedy",
                   "prefix_caching": False, "matmul": engine.matmul},
        "rounds": args.rounds, "median": med, "all": rows,
        "ratios": {
            "tpot_1_top20_over_plain": med["tpot_1_top20_s"] / med["tpot_1_plain_s"],
            "tpot_8_top20_over_plain": med["tpot_8_top20_s"] / med["tpot_8_plain_s"],
            "tpot_1_plain_over_bare": med["tpot_1_plain_s"] / med["tpot_1_bare_s"],
            "tpot_8_plain_over_bare": med["tpot_8_plain_s"] / med["tpot_8_bare_s"],
            "prefill_1000_prompt_logprobs20_over_plain": med["prefill_1000_prompt_logprobs20_s"]
            / med["prefill_1000_plain_s"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"] | result["ratios"], indent=2))
    np.testing.assert_array_less(0, list(med.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
