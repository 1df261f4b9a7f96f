"""What a JSON-schema constraint costs the engine: constrained streams against unconstrained ones, same run.

One process, one CPU device (a gang host's share of the embedded default), the real demo model, the serving
scheduler (`decode_steps` 4) with the grammar engine on it, as rank 0 runs it. Three figures, each against its peer
measured in the same run, in interleaved rounds (each ratio taken within its round, then the median over rounds):

- TPOT (decode seconds per token after the first) of one constrained stream against one unconstrained stream of
  the same prompt. A constrained row needs each token before its next mask, so its plans run one pass; the
  unconstrained stream's plans run `decode_steps` passes.
- 16 streams, 8 of them constrained, against 16 unconstrained streams: aggregate decode tok/s while all 16
  decode (the window between the last first token and the first last token: constrained outputs end where their
  grammar ends, so a whole-run average would time the longest output's tail alone), and the unconstrained rows'
  TPOT beside constrained ones against their TPOT among unconstrained ones. By default a plan that holds a
  constrained row runs one pass, so the unconstrained rows beside it do too.
- The same 16 half-constrained streams with `ConstrainedDraws.shared_passes` on: plans that mix both kinds run
  `decode_steps` passes, the constrained rows drawing in the first only (docs/structured-outputs.md): its tok/s
  and both kinds' TPOT, against the default's in the same rounds. This is the measurement behind the default.

The 16-stream runs are warmed once each (untimed) before the rounds. Each half-constrained run also records the
masks' fill time per token and per plan (`ConstrainedDraws.mask_s`), and the result the machine's load average
(other work on the machine spreads single rounds).

Every constrained output is checked against the schema (`jsonschema`), so a faster run cannot hide a broken mask.

    .venv/bin/python benchmarks/structured_decode.py        # writes benchmarks/results/structured_decode.json
    .venv/bin/python benchmarks/structured_decode.py --rounds 1 --new-tokens 48
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
RESULTS = REPO / "benchmarks" / "results" / "structured_decode.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "genre": {"enum": ["fiction", "science", "history", "poetry"]},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 3, "maxItems": 6},
        "chapters": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                             "pages": {"type": "integer", "minimum": 1, "maximum": 500}},
            "required": ["name", "pages"], "additionalProperties": False}},
    },
    "required": ["title", "genre", "year", "tags", "chapters"],
    "additionalProperties": False,
}
RATIOS = {  # name: (numerator, denominator) among the measured rows
    "tpot_constrained_over_unconstrained": ("tpot_constrained_s", "tpot_unconstrained_s"),
    "tok_s_16_half_constrained_over_unconstrained": ("tok_s_16_half_constrained", "tok_s_16_unconstrained"),
    "tpot_unconstrained_rows_beside_constrained_over_alone": ("tpot_16_half_unconstrained_rows_s",
                                                              "tpot_16_unconstrained_s"),
    "shared_passes_tok_s_16_half_constrained_over_unconstrained": ("tok_s_16_half_constrained_shared_passes",
                                                                   "tok_s_16_unconstrained"),
    "shared_passes_over_one_pass_tok_s_16_half": ("tok_s_16_half_constrained_shared_passes",
                                                  "tok_s_16_half_constrained"),
    "shared_passes_tpot_unconstrained_rows_over_alone": ("tpot_16_half_unconstrained_rows_shared_passes_s",
                                                         "tpot_16_unconstrained_s"),
    "shared_passes_tpot_constrained_rows_over_one_pass": ("tpot_16_half_constrained_rows_shared_passes_s",
                                                          "tpot_16_half_constrained_rows_s"),
}
PROMPT = "Describe a book as a JSON object with its title, genre, year, tags and chapters."


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens per unconstrained stream (eos ignored)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    _env()

    import jax
    import jsonschema
    from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)
    from transformers import AutoTokenizer

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.config import load_config
    from raydeploy.constraints import GrammarEngine
    from raydeploy.constraints.spec import Constraint
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.engine.step import SamplingParams
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh

    cfg = load_config(None, ["engine.max_slots=16", "model.max_seq_len=512", "mesh.axes.dp=1", "cluster.num_hosts=1"])
    path = resolve_checkpoint(cfg.model.checkpoint)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    engine = build_engine(cfg, mesh, path).engine
    engine.warmup()
    grammar = GrammarEngine.from_checkpoint(path, engine.vocab_size, engine.eos_ids)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    prompt = tuple(int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids))
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    sampling = SamplingParams(temperature=0.7, top_p=0.95)

    def request(i: int, constrained: bool) -> GenerationRequest:
        sp = SamplingParams(sampling.temperature, sampling.top_p, seed=i)
        if constrained:
            return GenerationRequest(f"c{i}", prompt, 400, sp, constraint=constraint)
        return GenerationRequest(f"u{i}", prompt, args.new_tokens, sp, ignore_eos=True)

    def run(kinds: list[bool], shared: bool = False) -> tuple[float, list[float], Scheduler]:
        """For streams of these kinds (True: constrained), run together from one submit: the aggregate decode tok/s
        while every stream decodes (tokens stamped between the last stream's first token and the first stream's
        last token: streams of unequal lengths would otherwise measure the longest one's tail alone), each
        stream's TPOT, and the scheduler (its mask counters). `shared`: mixed plans run every pass
        (`ConstrainedDraws.shared_passes`)."""
        sched = Scheduler.for_engine(engine, cfg, grammar=grammar)
        sched.constrained.shared_passes = shared
        runner = LocalRunner(engine, sched)
        stamps: list[list[float]] = [[] for _ in kinds]
        ids: list[list[int]] = [[] for _ in kinds]
        ends: list[tuple[str | None, str | None]] = [(None, None)] * len(kinds)

        def sink(i: int):
            def put(ev) -> None:
                if ev.token_id is not None:
                    stamps[i].append(time.perf_counter())
                    ids[i].append(ev.token_id)
                if ev.finish_reason is not None:
                    ends[i] = (ev.finish_reason, ev.error)
            return put

        with runner.loop.lock:
            for i, c in enumerate(kinds):
                sched.submit(request(i, c), sink(i))
        runner.run_until_idle()
        tpots = []
        for i, constrained in enumerate(kinds):
            if ends[i][0] in (None, "error", "abort"):
                raise RuntimeError(f"stream {i}: {ends[i]}")
            if constrained:
                jsonschema.validate(json.loads(tok.decode(ids[i], skip_special_tokens=True)), SCHEMA)
            tpots.append((stamps[i][-1] - stamps[i][0]) / max(len(stamps[i]) - 1, 1))
        t0 = max(s[0] for s in stamps)
        t1 = min(s[-1] for s in stamps)
        inside = sum(1 for s in stamps for t in s if t0 < t <= t1)
        return inside / (t1 - t0), tpots, sched

    half = [i % 2 == 0 for i in range(16)]
    # untimed: first calls after warmup, the grammar's first compile, and the first uses of each 16-stream mix
    for kinds, shared in (([True], False), ([False] * 16, False), (half, False), (half, True)):
        run(kinds, shared)
    load_before = os.getloadavg()[0]
    rows: dict[str, list[float]] = {k: [] for k in (
        "tpot_constrained_s", "tpot_unconstrained_s", "tok_s_16_unconstrained", "tpot_16_unconstrained_s",
        "tok_s_16_half_constrained", "tpot_16_half_unconstrained_rows_s", "tpot_16_half_constrained_rows_s",
        "mask_ms_per_token_16_half", "mask_ms_per_plan_16_half", "tok_s_16_half_constrained_shared_passes",
        "tpot_16_half_unconstrained_rows_shared_passes_s", "tpot_16_half_constrained_rows_shared_passes_s")}
    for _ in range(args.rounds):
        rows["tpot_unconstrained_s"].append(run([False])[1][0])
        rows["tpot_constrained_s"].append(run([True])[1][0])
        tok_s, tpots, _ = run([False] * 16)
        rows["tok_s_16_unconstrained"].append(tok_s)
        rows["tpot_16_unconstrained_s"].append(statistics.median(tpots))
        tok_s, tpots, sched = run(half)
        rows["tok_s_16_half_constrained"].append(tok_s)
        rows["tpot_16_half_constrained_rows_s"].append(statistics.median(tpots[0::2]))
        rows["tpot_16_half_unconstrained_rows_s"].append(statistics.median(tpots[1::2]))
        rows["mask_ms_per_token_16_half"].append(1e3 * sched.constrained.mask_s / sched.constrained.masks)
        rows["mask_ms_per_plan_16_half"].append(1e3 * sched.constrained.mask_s / sched.steps)
        tok_s, tpots, _ = run(half, shared=True)
        rows["tok_s_16_half_constrained_shared_passes"].append(tok_s)
        rows["tpot_16_half_constrained_rows_shared_passes_s"].append(statistics.median(tpots[0::2]))
        rows["tpot_16_half_unconstrained_rows_shared_passes_s"].append(statistics.median(tpots[1::2]))
    med = {k: statistics.median(v) for k, v in rows.items()}
    # each ratio within its round, then their median: the rounds pair runs made minutes apart, so outside load
    # that comes or goes between rounds (the machine is shared) moves both sides of a ratio alike
    per_round = {name: [a / b for a, b in zip(rows[num], rows[den], strict=True)]
                 for name, (num, den) in RATIOS.items()}
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "flags": cpu_flags(),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                    "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]}},
        "config": {"max_slots": 16, "decode_steps": cfg.engine.decode_steps, "sampling": "temperature 0.7, top_p 0.95",
                   "schema": "enum, integer bounds, arrays with min/max items, nested objects"},
        "rounds": args.rounds, "median": med, "all": rows,
        "ratios": {name: statistics.median(per_round[name]) for name in RATIOS},
        "ratios_per_round": per_round,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"] | result["ratios"] | {"machine": result["machine"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
