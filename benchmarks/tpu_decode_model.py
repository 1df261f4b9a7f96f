"""Modelled decode throughput of TPU configs, bfloat16 against int8 weights and an int8 KV cache: a MODEL, not a
measurement (no TPU here).

The figures are `plan`'s; `--compiled` adds the second, which does not hold up (below):

- `compiled` (only with `--compiled`): the compiler's own cost analysis of the real decode programs, compiled deviceless through libtpu for
  the target chip (`raydeploy compile`'s path). XLA's cost analysis counts a while loop's body once whatever its
  trips, so the layer scan of a full model is counted as one layer; a 1-layer model's program has no loop and is
  counted whole. So the program is compiled for the model with `num_hidden_layers: 1`; its bytes and flops less
  the LM head's (its weight shard read once, 2 x rows x its elements) are one layer's, and the model's are
  layers x that + the LM head's. The programs are compiled with a short `max_seq_len` so the KV pool they take is
  small (the Pallas attention kernel has no cost estimate: XLA counts the whole pool operand it is given, not the
  pages a row reads); the KV a row reads at `--context` tokens is added from the plan's bytes per token.
  It overcounts by 5-30x: XLA's "bytes accessed" sums every fusion's operands and outputs, on-chip (VMEM)
  traffic included, and the per-step sampling and state arrays of the 1-layer program get multiplied by the
  layers with the layer (2026-11-28, v5e-16 Llama-3-8B bf16 at batch 1: 26.3 ms against 4.9 ms by the weight
  bytes alone, which the roofline cannot undercut). Kept to show why the plan's bytes are the model's. Step time = `raydeploy.compile.roofline_s` (the larger of
  bytes / HBM bandwidth and flops / bf16 peak, published chip figures).
- `plan`: `raydeploy plan`'s model (`raydeploy.plan.decode_model`): the weight shard's bytes and 2 x active
  parameters per row, from the plan's byte counts. With an int8 KV cache the KV is read at 1 byte an element
  (plus scales); `dequant_copy_*` beside it models the TPU path as it is today, whose wrapper writes and reads
  back a bfloat16 copy of the attended pages (+ 4 bytes an element: `dequant_copy_row`).

Each at batch 1 and with every slot decoding, at the config's max_slots and at the largest max_slots that fits
(`raydeploy plan`'s suggestion, 10% of HBM left). Beside them the published anchor: JetStream serving Llama-3-8B
on a v5e-8, 10,873 tok/s with int8 weights and 8,249 in bfloat16.

    python benchmarks/tpu_decode_model.py [--context 1024] [--json] [--out benchmarks/results/tpu_decode_model.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ANCHOR = {"what": "JetStream, Llama-3-8B, TPU v5e-8 (published)", "int8_tok_s": 10873, "bf16_tok_s": 8249}

CASES = [  # (label, config, overrides, full-slots counts to model besides the suggestion)
    ("v5e-16 Llama-3-8B bf16", "configs/tpu-v5e-16.yaml", []),
    ("v5e-16 Llama-3-8B int8 weights", "configs/tpu-v5e-16.yaml", ["model.quantization=int8"]),
    ("v5e-16 Llama-3-8B int8 weights + int8 KV", "configs/tpu-v5e-16.yaml",
     ["model.quantization=int8", "engine.kv_dtype=int8"]),
    ("v5e-8 Llama-3-70B int8 weights + int8 KV, 32 slots", "configs/tpu-v5e-8-llama3-70b-int8.yaml",
     ["engine.max_slots=32"]),
]
SHORT_SEQ = 256
"""max_seq_len of the programs compiled for the cost analysis (a small pool; the KV read is added per token)."""


def compiled_layer_costs(config: str, overrides: list[str], rows: list[int]) -> dict[int, dict[str, float]]:
    """Per decode row count: (bytes, flops) of one step from the compiled cost analysis of the 1-layer model's
    program, scaled to the model's depth (module docstring)."""
    from raydeploy.compile import prepare_environment, target_devices
    from raydeploy.config import load_config
    from raydeploy.engine.programs import ProgramSet
    from raydeploy.model.sharding import build_mesh, merge_rules
    from raydeploy.plan import _shard_numel, make_plan, model_config_path, model_family

    cfg = load_config(REPO / config, overrides)
    prepare_environment(cfg)
    raw = json.loads(model_config_path(cfg).read_text())
    layers = int(raw["num_hidden_layers"])
    per_depth: dict[int, dict[int, tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for depth in (1,):
            path = Path(tmp) / f"d{depth}" / "config.json"
            path.parent.mkdir()
            path.write_text(json.dumps({**raw, "num_hidden_layers": depth}))
            c = load_config(REPO / config, [*overrides, f"model.hf_config={path}", f"model.max_seq_len={SHORT_SEQ}",
                                            "engine.max_new_tokens=64"])
            plan = make_plan(c)
            family, model, _ = model_family(c)
            mesh = build_mesh(plan.mesh, target_devices(c))
            ps = ProgramSet(family.with_quantization(c.model.quantization), model, mesh, merge_rules(c.mesh.rules),
                            c.model, c.engine)
            specs = family.param_specs(model)
            head = specs.get("lm_head.kernel") or specs["embed.embedding"]
            head_numel = _shard_numel(head, {**family.rules, **merge_rules(c.mesh.rules)}, c.mesh_shape)
            head_bytes = head_numel * (2 if c.model.param_dtype == "bfloat16" else 4)
            per_depth[depth] = {}
            for r in rows:
                shape = ps.program_for(r, ps.page_buckets[-1], True)
                t0 = time.perf_counter()
                compiled = ps.lower(shape).compile()
                cost = compiled.cost_analysis() or {}
                cost = cost[0] if isinstance(cost, list) else cost
                per_depth[depth][r] = (float(cost.get("bytes accessed", 0.0)), float(cost.get("flops", 0.0)))
                print(f"  compiled {shape.name} at {depth} layer(s) in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
    out = {}
    for r in rows:
        b1, f1 = per_depth[1][r]
        layer_b, layer_f = b1 - head_bytes, f1 - 2 * r * head_numel
        out[r] = {"bytes": head_bytes + layers * layer_b, "flops": 2 * r * head_numel + layers * layer_f,
                  "layer_bytes": layer_b}
    return out


def dequant_copy_row(plan, chip, streams: int, rows: int, context: int) -> dict:
    """The same step with the KV traffic of the TPU attention path as it is: jax 0.10.2's kernel takes one scalar
    scale, so every attended int8 element is read (with its scale), written to a bfloat16 copy and read back from
    it (docs/quantization.md): + 4 bytes an element over the plan's int8 bytes."""
    from raydeploy.compile import roofline_s

    elements = plan.kv_bytes_per_token_per_device * (1 - plan.kv_scale_bytes_per_device / plan.kv_bytes_per_device)
    kv = rows * context * (plan.kv_bytes_per_token_per_device + 4 * elements)
    flops = 2 * plan.active_param_count / (plan.total_devices // max(plan.dp_groups, 1)) * rows
    step = roofline_s(chip, flops, plan.param_bytes_per_device + kv)
    return {"dequant_copy_step_ms": round(step * 1e3, 3), "dequant_copy_tok_s": round(streams / step)}


def model_case(label: str, config: str, overrides: list[str], context: int, compiled: bool = False) -> dict:
    from raydeploy.compile import roofline_s
    from raydeploy.config import load_config
    from raydeploy.plan import chip_figures, decode_model, make_plan, with_slots

    cfg = load_config(REPO / config, overrides)
    plan = make_plan(cfg)
    chip = chip_figures(cfg)
    assert chip is not None and plan.slots is not None, config
    groups = plan.dp_groups
    sizes = sorted({cfg.engine.max_slots, plan.slots.max_slots})
    rows = sorted({1, *(n // groups for n in sizes)})
    costs = compiled_layer_costs(config, overrides, rows) if compiled else {}
    res: dict = {
        "case": label, "config": config, "overrides": overrides, "chip": chip.name, "hbm_gbps": chip.hbm_gbps,
        "bf16_tflops": chip.bf16_tflops, "devices": plan.total_devices, "dp_groups": groups,
        "weight_gib_per_chip": round(plan.param_bytes_per_device / 2**30, 3),
        "weight_scale_mib_per_chip": round(plan.weight_scale_bytes_per_device / 2**20, 2),
        "kv_gib_per_chip": round(plan.kv_bytes_per_device / 2**30, 3),
        "kv_kib_per_token_per_chip": round(plan.kv_bytes_per_token_per_device / 1024, 3),
        "max_slots": cfg.engine.max_slots, "suggested_max_slots": plan.slots.max_slots,
        "suggested_kv_gib_per_chip": round(plan.slots.kv_bytes_per_device / 2**30, 3),
        "context": context, "rows": {},
    }
    for streams in sorted({1, *sizes}):
        r = 1 if streams == 1 else streams // groups
        analytic = decode_model(make_plan(with_slots(cfg, max(streams, groups))), chip, streams, context)[-1]
        row = {"rows_per_group": r, "step_ms": analytic.step_ms, "tok_s": round(analytic.tok_s),
               "per_stream_tok_s": round(analytic.per_stream_tok_s), "bound": analytic.bound}
        if plan.kv_dtype == "int8" and cfg.cluster.platform == "tpu":
            row.update(dequant_copy_row(plan, chip, streams, r, context))
        if compiled:
            c = costs[r]
            kv_read = r * context * plan.kv_bytes_per_token_per_device
            step = roofline_s(chip, c["flops"], c["bytes"] + kv_read)
            row.update(compiled_gb_per_step=round((c["bytes"] + kv_read) / 1e9, 3),
                       compiled_step_ms=round(step * 1e3, 3), compiled_tok_s=round(streams / step))
        res["rows"][f"{streams} streams"] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024, help="attended tokens per row (prompt + generated)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--compiled", action="store_true",
                    help="also the compiled cost analysis' figures (minutes: deviceless compiles; they overcount)")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = {"what": "MODEL, not a measurement: roofline of the plan's bytes per chip (raydeploy.plan.decode_model)",
               "anchor": ANCHOR, "cases": [model_case(lb, c, o, args.context, args.compiled) for lb, c, o in CASES]}
    import jax

    results["jax"] = jax.__version__
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(results["what"] + f"; {args.context}-token context per stream")
    for c in results["cases"]:
        print(f"{c['case']} ({c['chip']}, {c['devices']} chips): weights {c['weight_gib_per_chip']} GiB/chip "
              f"(scales {c['weight_scale_mib_per_chip']} MiB), KV {c['kv_gib_per_chip']} GiB/chip at "
              f"{c['max_slots']} slots, largest max_slots that fits {c['suggested_max_slots']}")
        for k, v in c["rows"].items():
            print(f"  {k}: {v['step_ms']} ms/step, {v['tok_s']} tok/s ({v['per_stream_tok_s']} per stream, "
                  f"{v['bound']}-bound)" + (f"; compiled cost analysis {v['compiled_step_ms']} ms/step"
                                            if "compiled_step_ms" in v else "")
                  + (f"; with the TPU path's bfloat16 copy of the KV {v['dequant_copy_tok_s']} tok/s"
                     if "dequant_copy_tok_s" in v else ""))
    print(f"anchor: {ANCHOR['what']}: {ANCHOR['int8_tok_s']} tok/s int8, {ANCHOR['bf16_tok_s']} bf16")


if __name__ == "__main__":
    main()
