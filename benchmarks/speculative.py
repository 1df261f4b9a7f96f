"""Speculative decoding (prompt lookup, `engine.speculative.method: ngram`, or a draft model, `draft`) against plain
decoding, same run.

One process, one CPU device (a gang host's share of the embedded default), the real demo model, the serving
scheduler (`decode_steps` 4), as rank 0 runs it; greedy requests. One engine with the verify programs serves
both arms: the peer is the same engine under a scheduler with speculation off (it runs exactly the plain step
programs), measured in interleaved rounds (medians reported):

- one stream, TPOT (decode seconds per token after the first) with ngram against without, on workloads where
  lookup helps (rewrite a paragraph fixing only its spelling; rename a variable in a piece of code) and on one
  where it does not (an open-ended story); goals >= 1.8x faster and >= 0.95x. Each answer ends where the model
  ends it (its eos) or at --new-tokens: what a user asking for the rewrite gets. (Forced past its eos, the demo
  model starts an unrelated conversation, where lookup has nothing to copy: `--ignore-eos` measures that);
- 16 streams (the story and the rewrite, alternating): aggregate decode tok/s with ngram against without while
  all 16 decode (eos ignored, so all 16 run to --new-tokens); goal >= 0.95x (the per-step back-off, `max_rows`,
  keeps their multi-pass plans).

`--method draft` measures the draft-model method the same way (`--draft-checkpoint`, by default the served model
itself: a draft that proposes exactly the target's greedy tokens, the upper bound of acceptance, at the cost of a
draft as large as the target); its results go to benchmarks/results/speculative_draft.json.

Every speculative output is checked token for token against the plain one, so a faster run cannot hide a wrong
token. Not over HTTP: the ingress adds the same per-token cost to both arms.

    .venv/bin/python benchmarks/speculative.py        # writes benchmarks/results/speculative.json
    .venv/bin/python benchmarks/speculative.py --rounds 1 --new-tokens 64
    .venv/bin/python benchmarks/speculative.py --method draft --no-16-streams
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
RESULTS = REPO / "benchmarks" / "results" / "speculative.json"

PARAGRAPH = ("The quick brown fox jumpd over the lazy dog. It was a sunny day, and the feilds were full of "
             "flowers. The farmer walked slowley to the barn, carrying a bucket of water for the horses. "
             "Evrything seemed peaceful, untill a loud noise came from the forest behind the house.")
CODE = ('def total(items):\n    x = 0\n    for item in items:\n        if item.price > 0:\n'
        '            x += item.price * item.quantity\n    return x\n\n\ndef average(items):\n'
        '    x = total(items)\n    return x / len(items) if items else 0\n')
WORKLOADS = {
    "rewrite": f"Rewrite this paragraph, fixing only the spelling mistakes. Output only the paragraph.\n\n{PARAGRAPH}",
    "code": f"Rename the variable x to running_sum in this code. Output only the code.\n\n{CODE}",
    "story": "Write a long story about a dragon who learns to bake bread.",
}


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128, help="most tokens per stream")
    ap.add_argument("--ignore-eos", action="store_true", help="one-stream answers run past their eos to --new-tokens")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default benchmarks/results/speculative.json, speculative_draft.json for draft)")
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    ap.add_argument("--draft-checkpoint", default=None,
                    help="the draft model of --method draft (default: the served model drafts for itself)")
    ap.add_argument("--no-16-streams", dest="many", action="store_false", help="measure one stream only")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for both arms (for example model.param_dtype=bfloat16 on a GPU)")
    ap.add_argument("--tolerate-divergence", action="store_true",
                    help="record where a speculative output first differs from the plain one instead of stopping "
                         "(accelerators: the verify chunk's kernels may round a near tie the other way)")
    args = ap.parse_args()
    _env()

    import jax
    from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)
    from transformers import AutoTokenizer

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.config import load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh

    base = ["engine.max_slots=16", "model.max_seq_len=1024", "mesh.axes.dp=1", "cluster.num_hosts=1", *args.overrides]
    method = args.method
    plain_cfg = load_config(None, base)
    spec_sets = [f"engine.speculative.method={method}"]
    if method == "draft":
        spec_sets.append(f"engine.speculative.draft_checkpoint={args.draft_checkpoint or plain_cfg.model.checkpoint}")
    cfg = load_config(None, [*base, *spec_sets])
    out_path = args.out or (RESULTS if method == "ngram" else RESULTS.with_name(f"speculative_{method}.json"))
    path = resolve_checkpoint(cfg.model.checkpoint)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    engine = build_engine(cfg, mesh, path).engine
    engine.warmup()
    prompts = {}
    for name, text in WORKLOADS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        prompts[name] = tuple(int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids))

    def run(names: list[str], spec: bool, ignore_eos: bool) -> tuple[float, list[float], list[list[int]], dict]:
        """Streams of these workloads from one submit: aggregate decode tok/s while all decode, each one's TPOT,
        their tokens and the scheduler's speculative figures."""
        sched = Scheduler.for_engine(engine, cfg if spec else plain_cfg)
        runner = LocalRunner(engine, sched)
        stamps: list[list[float]] = [[] for _ in names]
        out: list[list[int]] = [[] for _ in names]

        def sink(i: int):
            def put(ev) -> None:
                if ev.token_id is not None:
                    stamps[i].append(time.perf_counter())
                    out[i].append(ev.token_id)
                if ev.finish_reason in ("error", "abort"):
                    raise RuntimeError(f"stream {i}: {ev.error}")
            return put

        with runner.loop.lock:
            for i, name in enumerate(names):
                sched.submit(GenerationRequest(f"{name}{i}", prompts[name], args.new_tokens, ignore_eos=ignore_eos),
                             sink(i))
        runner.run_until_idle()
        tpots = [(s[-1] - s[0]) / max(len(s) - 1, 1) for s in stamps]
        t0, t1 = max(s[0] for s in stamps), min(s[-1] for s in stamps)
        inside = sum(1 for s in stamps for t in s if t0 < t <= t1)
        stats = {k: v for k, v in sched.stats().items() if k.startswith("spec_decode")}
        return (inside / (t1 - t0) if t1 > t0 else float("nan")), tpots, out, stats

    divergence: dict[str, list[int]] = {}

    def check(name: str, got: list[list[int]], want: list[list[int]]) -> None:
        """Speculative tokens must equal the plain ones; with --tolerate-divergence, the first differing index of
        each differing stream is recorded instead."""
        if got == want:
            return
        if not args.tolerate_divergence:
            raise RuntimeError(f"{name}: speculative tokens differ from the plain ones")
        for g, w in zip(got, want, strict=True):
            if g != w:
                divergence.setdefault(name, []).append(
                    next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w))))

    many = [("story", "rewrite")[i % 2] for i in range(16)]
    for name in WORKLOADS:  # untimed: first calls of each program after warmup
        run([name], True, args.ignore_eos)
    rows: dict[str, list[float]] = {}
    answers: dict[str, list[list[int]]] = {}
    figures: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name in WORKLOADS:
            _, (plain,), want, _ = run([name], False, args.ignore_eos)
            _, (fast,), got, stats = run([name], True, args.ignore_eos)
            check(name, got, want)
            answers[name] = got
            rows.setdefault(f"tpot_{name}_plain_s", []).append(plain)
            rows.setdefault(f"tpot_{name}_{method}_s", []).append(fast)
            figures[name] = stats
        if not args.many:
            continue
        plain, _, want, _ = run(many, False, True)
        fast, _, got, stats = run(many, True, True)
        check("16_streams", got, want)
        rows.setdefault("tok_s_16_plain", []).append(plain)
        rows.setdefault(f"tok_s_16_{method}", []).append(fast)
        figures["16_streams"] = stats
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {f"tpot_{n}_speedup": med[f"tpot_{n}_plain_s"] / med[f"tpot_{n}_{method}_s"] for n in WORKLOADS}
    if args.many:
        ratios[f"tok_s_16_{method}_over_plain"] = med[f"tok_s_16_{method}"] / med["tok_s_16_plain"]
    spec = cfg.engine.speculative
    described = (f"ngram, num_tokens {spec.num_tokens}, ngram {spec.ngram_min}..{spec.ngram_max}, max_rows "
                 f"{spec.max_rows}" if method == "ngram" else
                 f"draft {spec.draft_checkpoint}, num_tokens {spec.num_tokens}, max_rows {spec.max_rows}")
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "flags": cpu_flags(),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)},
        "config": {"max_slots": 16, "decode_steps": cfg.engine.decode_steps, "sampling": "greedy",
                   "new_tokens": args.new_tokens, "one_stream_ignore_eos": args.ignore_eos,
                   "speculative": described},
        "tokens_per_answer": {name: len(toks[0]) for name, toks in answers.items()},
        "overrides": args.overrides, "divergence_first_index": divergence,
        "rounds": args.rounds, "median": med, "ratios": ratios, "all": rows, "spec_figures_last_round": figures,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(med | ratios, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
