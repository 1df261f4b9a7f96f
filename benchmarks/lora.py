"""What serving LoRA adapters costs the engine: 16 streams over 4 adapters against 16 streams on the base model,
same run.

One process, one CPU device (a gang host's share of the embedded default), the real demo model, the serving
scheduler (`decode_steps` 4), as rank 0 runs it. Two engines over the same weights: one with `lora.max_adapters`
4 of rank 16 (4 adapters loaded, each on all seven projections), one without LoRA (`max_adapters` 0: the
programs of before). In interleaved rounds (medians reported), aggregate decode tok/s while all 16 streams decode
(the window between the last first token and the first last token) of:

- 16 streams over the 4 adapters (4 each) on the LoRA engine;
- 16 streams on the base model on the LoRA engine (rows without an adapter in an engine with slots);
- 16 streams on the engine without LoRA (the peer for what having slots costs base-model rows).

The adapters are random (PEFT's file format, written here), B non-zero, so the adapter term is real work.

`--compile CONFIG` instead compiles the config's decode step program (one token per slot of a dp group, the
longest page bucket) for its target (a TPU slice deviceless, through libtpu) with and without 16 adapter slots of
rank 16, and reports `raydeploy plan`'s bytes per chip and modelled decode and the compiler's figures for both.

    .venv/bin/python benchmarks/lora.py              # writes benchmarks/results/lora.json
    .venv/bin/python benchmarks/lora.py --rounds 1 --new-tokens 48
    .venv/bin/python benchmarks/lora.py --compile configs/tpu-v5e-16.yaml   # benchmarks/results/lora_compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "lora.json"
COMPILE_RESULTS = REPO / "benchmarks" / "results" / "lora_compile.json"
ADAPTERS, RANK, STREAMS = 4, 16, 16
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))


def write_adapter(dst: Path, layout, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter directory on every target of `layout`, random A and B."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for t in layout.targets:
        part = "self_attn" if t.param.startswith("layers.attn.") else "mlp"
        for layer in range(layout.layers):
            key = f"base_model.model.model.layers.{layer}.{part}.{t.name}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, t.inputs)) / np.sqrt(t.inputs)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((t.outputs, rank))).astype(np.float32)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                        "target_modules": list(layout.names)}))
    save_file(tensors, str(dst / "adapter_model.safetensors"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens per stream (eos ignored)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compile", metavar="CONFIG", default=None,
                    help="compile CONFIG's decode step with and without 16 slots of rank 16 instead")
    args = ap.parse_args()
    _env()
    if args.compile:
        return compile_figures(args.compile, args.out or COMPILE_RESULTS)
    args.out = args.out or RESULTS

    import jax
    from machine import cpu_flags  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)
    from transformers import AutoTokenizer

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.config import load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.engine.step import SamplingParams
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh

    base = ["engine.max_slots=16", "model.max_seq_len=512", "mesh.axes.dp=1", "cluster.num_hosts=1"]
    cfg = load_config(None, [*base, f"lora.max_adapters={ADAPTERS}", f"lora.max_rank={RANK}"])
    plain_cfg = load_config(None, base)
    path = resolve_checkpoint(cfg.model.checkpoint)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    engine = build_engine(cfg, mesh, path).engine
    engine.warmup()
    plain = build_engine(plain_cfg, mesh, path).engine
    plain.warmup()
    layout = engine.adapters.layout
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ADAPTERS):
            write_adapter(Path(tmp) / f"a{i}", layout, RANK, seed=i)
            engine.adapters.load(i, str(Path(tmp) / f"a{i}"))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    prompt = tuple(int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids))

    def request(i: int, adapter: int) -> GenerationRequest:
        sp = SamplingParams(temperature=0.7, top_p=0.95, seed=i)
        if adapter < 0:
            return GenerationRequest(f"b{i}", prompt, args.new_tokens, sp, ignore_eos=True)
        return GenerationRequest(f"l{i}", prompt, args.new_tokens, sp, ignore_eos=True, adapter=f"a{adapter}",
                                 adapter_slot=adapter, adapter_key=f"a{adapter}#1")

    def run(eng, run_cfg, adapters: list[int]) -> float:
        """Streams with these adapter slots (-1: the base model), submitted together: the aggregate decode tok/s
        while every stream decodes."""
        sched = Scheduler.for_engine(eng, run_cfg)
        runner = LocalRunner(eng, sched)
        stamps: list[list[float]] = [[] for _ in adapters]
        ends: list[str | None] = [None] * len(adapters)

        def sink(i: int):
            def put(ev) -> None:
                if ev.token_id is not None:
                    stamps[i].append(time.perf_counter())
                if ev.finish_reason is not None:
                    ends[i] = ev.finish_reason if ev.error is None else f"{ev.finish_reason}: {ev.error}"
            return put

        with runner.loop.lock:
            for i, a in enumerate(adapters):
                sched.submit(request(i, a), sink(i))
        runner.run_until_idle()
        if any(e != "length" for e in ends):
            raise RuntimeError(f"streams ended {ends}")
        t0, t1 = max(s[0] for s in stamps), min(s[-1] for s in stamps)
        return sum(1 for s in stamps for t in s if t0 < t <= t1) / (t1 - t0)

    over_adapters = [i % ADAPTERS for i in range(STREAMS)]
    on_base = [-1] * STREAMS
    run(engine, cfg, over_adapters)  # untimed: the first calls after warmup
    run(plain, plain_cfg, on_base)
    rows: dict[str, list[float]] = {"tok_s_16_over_4_adapters": [], "tok_s_16_base_lora_engine": [],
                                    "tok_s_16_base_no_lora_engine": []}
    for _ in range(args.rounds):
        rows["tok_s_16_base_lora_engine"].append(run(engine, cfg, on_base))
        rows["tok_s_16_over_4_adapters"].append(run(engine, cfg, over_adapters))
        rows["tok_s_16_base_no_lora_engine"].append(run(plain, plain_cfg, on_base))
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "flags": cpu_flags(),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)},
        "config": {"max_slots": STREAMS, "decode_steps": cfg.engine.decode_steps, "lora.max_adapters": ADAPTERS,
                   "lora.max_rank": RANK, "adapter targets": list(layout.names), "new_tokens": args.new_tokens,
                   "sampling": "temperature 0.7, top_p 0.95", "matmul": engine.matmul},
        "rounds": args.rounds, "median": med, "all": rows,
        "ratios": {
            "over_adapters_over_base_same_engine": med["tok_s_16_over_4_adapters"] / med["tok_s_16_base_lora_engine"],
            "over_adapters_over_no_lora_engine": med["tok_s_16_over_4_adapters"] / med["tok_s_16_base_no_lora_engine"],
            "base_rows_lora_engine_over_no_lora_engine": med["tok_s_16_base_lora_engine"]
            / med["tok_s_16_base_no_lora_engine"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"] | result["ratios"], indent=2))
    return 0


def compile_decode(config: str, overrides: list[str]) -> dict:
    """`raydeploy plan`'s figures and the compiled decode step program's for CONFIG with `overrides`."""
    import dataclasses

    from raydeploy import compile as rc
    from raydeploy.config import load_config
    from raydeploy.engine.programs import ProgramSet
    from raydeploy.model.sharding import build_mesh, merge_rules
    from raydeploy.plan import make_plan, model_family

    cfg = load_config(config, overrides)
    plan = make_plan(cfg)
    family, model, _ = model_family(cfg)
    mesh = build_mesh(plan.mesh, rc.target_devices(cfg))
    ps = ProgramSet(family.with_quantization(cfg.model.quantization), model, mesh, merge_rules(cfg.mesh.rules),
                    cfg.model, cfg.engine, lora_cfg=cfg.lora)
    tokens = min(t for t in ps.token_buckets if t >= ps.slots_per_group)
    shape = max((s for s in ps.shapes() if s.kind == "step" and s.tokens == tokens), key=lambda s: s.pages)
    t0 = time.perf_counter()
    compiled = ps.lower(shape).compile()
    rep = rc._report(shape.name, compiled, time.perf_counter() - t0, rc.chip_for(cfg), model.num_layers)
    return {"program": shape.name, "lora_bytes_per_chip": plan.lora_bytes_per_device,
            "weight_bytes_per_chip": plan.param_bytes_per_device, "kv_bytes_per_chip": plan.kv_bytes_per_device,
            "peak_bytes": rep.peak_bytes, "temp_bytes": rep.temp_bytes, "flops": rep.flops,
            "bytes_accessed": rep.bytes_accessed, "roofline_ms": rep.roofline_s * 1e3 if rep.roofline_s else None,
            "compile_s": rep.compile_s,
            "plan_modelled_decode": [dataclasses.asdict(m) for m in plan.slots.modelled_config] if plan.slots else None,
            "plan_max_slots_that_fit": plan.slots.max_slots if plan.slots else None}


def compile_figures(config: str, out: Path) -> int:
    import jax

    result = {"config": config, "jax": jax.__version__,
              "no_lora": compile_decode(config, []),
              "lora_16_slots_rank_16": compile_decode(config, ["lora.max_adapters=16", "lora.max_rank=16"])}
    a, b = result["no_lora"], result["lora_16_slots_rank_16"]
    result["ratios"] = {k: b[k] / a[k] for k in ("peak_bytes", "flops", "bytes_accessed", "roofline_ms") if a[k]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
