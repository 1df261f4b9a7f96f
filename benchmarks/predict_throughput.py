"""Batch prediction throughput: raydeploy predict over the gang vs transformers `generate`, same run.

Both sides get the same chat prompts, the same batch size (raydeploy: `engine.max_slots` slots decoded
together with continuous batching; transformers: static batches of that size, left-padded) and greedy
decoding of up to the same number of new tokens. Tokens are counted up to and including each prompt's
end-of-sequence token (transformers keeps decoding a batch until its longest row is done; padding tokens
after a row's end are not counted). raydeploy's gang is brought up and compiled before timing (like a
served model); its bring-up time is reported separately. transformers runs float32 on the same CPU
threads the gang uses.

    .venv/bin/python benchmarks/predict_throughput.py [--prompts 32] [--batch 8] [--max-tokens 64] [--set KEY=VALUE]

Prints one JSON object with both sides' prompts/s and tokens/s, the ratio, whether the greedy outputs
are identical, and the machine's load average during the run (writes it to benchmarks/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
TOPICS = ["rivers", "the moon", "bread", "jazz", "glaciers", "chess", "owls", "tea", "maps", "volcanoes",
          "bees", "trains", "lighthouses", "snow", "clocks", "gardens"]


def make_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} "
                                         f"(note {i})."}] for i in range(n)]


def run_raydeploy(prompts: list[list[dict[str, str]]], batch: int, max_tokens: int, config: str,
                  overrides: list[str]) -> dict:
    import ray

    from raydeploy.config import load_config
    from raydeploy.gang.gang import resolve_checkpoint_path, start_gang
    from raydeploy.predict import Example, generate_all
    from raydeploy.serve.text import TextCodec

    cfg = load_config(config, [f"engine.max_slots={batch}", "engine.warmup=true",
                               f"engine.max_new_tokens={max(max_tokens, 16)}", *overrides])
    path = resolve_checkpoint_path(cfg)
    codec = TextCodec.from_dir(path)
    examples = [Example(i + 1, i + 1, tuple(codec.encode_chat(codec.chat_prompt(m))), max_tokens)
                for i, m in enumerate(prompts)]
    ray.init(num_cpus=2, _temp_dir=tempfile.mkdtemp(prefix="rdbench-", dir="/tmp"), include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    gang = None
    try:
        t0 = time.perf_counter()
        gang = start_gang(cfg, checkpoint_path=path)
        c = cfg.cluster
        gang.wait_ready(c.placement_timeout_s + c.init_timeout_s + 2 * c.rpc_timeout_s)
        bringup_s = time.perf_counter() - t0
        results: list = []
        # one untimed round so every prefill bucket the prompts use is compiled
        asyncio.run(generate_all(gang, examples[:batch], 0.0, cfg, lambda ex, out: None, batch))
        t1 = time.perf_counter()
        asyncio.run(generate_all(gang, examples, 0.0, cfg, lambda ex, out: results.append(out), 2 * batch))
        elapsed_s = time.perf_counter() - t1
    finally:
        if gang is not None:
            gang.shutdown(cfg.cluster.rpc_timeout_s)
        ray.shutdown()
    tokens = sum(len(r.token_ids) for r in results)
    return {"engine": "raydeploy", "config": config, "overrides": overrides, "hosts": cfg.cluster.num_hosts,
            "mesh": cfg.mesh_shape, "batch": batch,
            "prompts": len(results), "tokens": tokens, "seconds": round(elapsed_s, 2),
            "prompts_per_s": round(len(results) / elapsed_s, 3), "tokens_per_s": round(tokens / elapsed_s, 1),
            "bringup_s": round(bringup_s, 1), "token_ids": [r.token_ids for r in results]}


def run_transformers(prompts: list[list[dict[str, str]]], batch: int, max_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raydeploy.checkpoint.demo import demo_gguf_path

    torch.set_num_threads(threads)
    gguf = Path(demo_gguf_path())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    outs: list[list[int]] = []

    def gen(chunk: list[str]) -> None:
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            res = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos,
                                 eos_token_id=eos)
        for row in res[:, enc["input_ids"].shape[1]:].tolist():
            outs.append(row[: row.index(eos) + 1] if eos in row else row)

    gen(texts[:batch])  # warm-up
    outs.clear()
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        gen(texts[i:i + batch])
    elapsed_s = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    return {"engine": "transformers", "dtype": "float32", "threads": threads, "batch": batch,
            "prompts": len(outs), "tokens": tokens, "seconds": round(elapsed_s, 2),
            "prompts_per_s": round(len(outs) / elapsed_s, 3), "tokens_per_s": round(tokens / elapsed_s, 1),
            "token_ids": outs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--config", default=str(REPO / "configs" / "predict-small.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="config override KEY=VALUE, e.g. --set cluster.num_hosts=1 --set 'mesh.axes={dp: 1}'")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads (default: all cores)")
    ap.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "predict_throughput.json"),
                    help="also write the JSON here (default benchmarks/results/predict_throughput.json)")
    a = ap.parse_args()
    prompts = make_prompts(a.prompts)
    load_1m = [round(os.getloadavg()[0], 1)]  # other work on the machine skews both sides; record it
    ours = run_raydeploy(prompts, a.batch, a.max_tokens, a.config, a.overrides)
    load_1m.append(round(os.getloadavg()[0], 1))
    peer = run_transformers(prompts, a.batch, a.max_tokens, a.threads)
    load_1m.append(round(os.getloadavg()[0], 1))
    same = sum(x == y for x, y in zip(ours.pop("token_ids"), peer.pop("token_ids"), strict=True))
    report = {"raydeploy": ours, "transformers": peer,
              "speedup_tokens_per_s": round(ours["tokens_per_s"] / peer["tokens_per_s"], 2),
              "speedup_prompts_per_s": round(ours["prompts_per_s"] / peer["prompts_per_s"], 2),
              "identical_outputs": f"{same}/{len(prompts)}", "cpu_count": os.cpu_count(),
              "load_average_1m_start_mid_end": load_1m}
    text = json.dumps(report, indent=2)
    print(text)
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
