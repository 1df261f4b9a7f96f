"""Modelled decode throughput of a TPU config: a roofline, not a measurement.

A decode step reads every weight shard and the attended KV window of its chip once, and multiplies
2 x (active parameters on the chip) x (rows) flops. Its time is the larger of bytes / HBM bandwidth and
flops / peak bf16 flops (published chip figures in raydeploy.compile.CHIPS); each step gives one token per
decoded row. The weight and KV bytes per chip are the same figures `raydeploy plan` and `raydeploy compile`
report for the config (sharding rules applied). Compared with a published anchor: JetStream serving
Llama-3-8B on a v5e-8 in bfloat16 at about 8.2k tok/s.

    python benchmarks/tpu_decode_model.py [configs/tpu-v5e-16.yaml] [--context 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ANCHOR = {"what": "JetStream, Llama-3-8B, TPU v5e-8, bfloat16 (published)", "tok_s": 8200}


def model(config: str, context: int) -> dict:
    from raydeploy.compile import chip_for
    from raydeploy.config import load_config
    from raydeploy.model.spec import LlamaConfig
    from raydeploy.plan import make_plan, model_config_path

    cfg = load_config(config)
    plan = make_plan(cfg)
    chip = chip_for(cfg)
    if chip is None:
        raise SystemExit(f"{config}: no published chip figures for accelerator_type {cfg.cluster.accelerator_type}")
    llama = LlamaConfig.from_json(model_config_path(cfg))
    groups = plan.mesh.get("dp", 1)
    slots_per_group = cfg.engine.max_slots // groups
    chips_per_group = plan.total_devices // groups
    kv_item = 2 if cfg.model.dtype == "bfloat16" else 4
    # K and V of one token in every layer, split over the chips of a group (kv heads over tp)
    kv_token_chip = 2 * llama.num_layers * llama.num_kv_heads * llama.head_dim * kv_item / min(
        chips_per_group, llama.num_kv_heads)
    out = {"config": config, "chip": chip.name, "hbm_gbps": chip.hbm_gbps, "bf16_tflops": chip.bf16_tflops,
           "weight_gib_per_chip": round(plan.param_bytes_per_device / 2**30, 2), "context": context, "rows": {}}
    for rows in (1, slots_per_group):
        bytes_chip = plan.param_bytes_per_device + rows * context * kv_token_chip
        flops_chip = 2 * plan.param_count / chips_per_group * rows
        step_s = max(bytes_chip / (chip.hbm_gbps * 1e9), flops_chip / (chip.bf16_tflops * 1e12))
        tokens = rows if rows == 1 else rows * groups  # batch 1 is one row; full slots is every group's rows
        out["rows"][f"batch {tokens}"] = {"step_ms": round(step_s * 1e3, 2), "tok_s": round(tokens / step_s),
                                          "per_stream_tok_s": round(1 / step_s)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="configs/tpu-v5e-16.yaml")
    ap.add_argument("--context", type=int, default=1024, help="attended tokens per row (prompt + generated)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = {**model(args.config, args.context), "anchor": ANCHOR}
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"MODEL, not a measurement: {res['config']} on {res['chip']} ({res['hbm_gbps']} GB/s HBM, "
          f"{res['bf16_tflops']} TFLOP/s bf16), weights {res['weight_gib_per_chip']} GiB per chip, "
          f"{res['context']}-token context")
    for k, v in res["rows"].items():
        print(f"  {k}: {v['step_ms']} ms per step, {v['tok_s']} tok/s ({v['per_stream_tok_s']} tok/s per stream)")
    print(f"  anchor: {ANCHOR['what']}: about {ANCHOR['tok_s']} tok/s")


if __name__ == "__main__":
    main()
