r"""Decode speed on one NVIDIA GPU: our engine against transformers `generate`, the same model, the same run.

No weights can be downloaded, so the model is a Llama of a real shape (default: Llama-3.2-1B's, 1.24B
parameters, 128k vocabulary, tied embeddings) with seeded random weights, made by transformers itself
(`AutoModelForCausalLM.from_config`, bfloat16). It is saved with `save_pretrained`, converted by our
safetensors converter and loaded by the checkpoint reader, as a user's model would be. Both sides run in
bfloat16 (weights and activations) on the GPU.

Per backend and batch size (rows of random prompts, 32 to 64 tokens each, `--new-tokens` each, eos ignored):
time to the last row's first token (TTFT); tokens/s over the whole run (`run_tok_s`, all tokens over the wall
time from submit to the last token: the figure compared, `ratio_vs_hf`); and decode tokens/s after the TTFT
(`decode_tok_s`, which flatters a backend whose rows start at different times: it counts the tokens of rows
that decode while the last row still waits, but not that time). Backends:
- `hf`: transformers `generate` (eager PyTorch, its dynamic KV cache, greedy), the peer;
- `pallas`: our engine with `engine.attention: pallas` (jax's Pallas GPU paged attention for decode steps);
- `xla`: our engine with `engine.attention: xla`.
Each of ours runs once per `--gpu-matmul` value (`engine.gpu_matmul`: auto = the Pallas kernel that reads a
layer's weight inside the stacked one for few rows, xla = XLA's gemm after its copy of the layer's weight), and
once per `--quantization` value (`model.quantization`: none = bfloat16 weights; int8 / fp8 = the engine quantizes
the same bfloat16 checkpoint while loading, per output channel, and the Pallas kernel reads the int8 / float8
bytes in place, converting them in the kernel). A quantized result carries its tokens/s over the bfloat16
engine's of the same settings (`ratio_vs_bf16`) and the greedy prefix it shares with it; transformers stays in
bfloat16 (its peer figure for every row).

Beside each result, the HBM-bandwidth bound (`hbm_limit`): a decode pass reads the weights once
(`weight_bytes_read_per_pass`: every parameter as the engine holds it, int8 / fp8 kernels with their float32
scales, less a separate embedding table, of which a pass reads one row per token; Llama-3.2-1B's tied table is
its LM head and stays bfloat16), so a token takes at least weight bytes / bandwidth, and b rows reach at most
b x bandwidth / weight bytes tokens/s. The bandwidth is the published figure for the device (H200 4.8 TB/s,
H100 SXM 3.35 TB/s; `HBM_BYTES_S`) or `--hbm-tbps`. KV reads are left out (small at these contexts).
`pass_ms`: the wall time of one decode pass inside a plan (plans of 4 and 36 passes after the same prefill, the
difference over 32), so a per-token time well above it is the scheduler's and the plans' round trips, and one
near it is the step program itself. Quality beside speed: the greedy tokens of row 0 at batch 1 from each of ours against transformers', as the
length of their common prefix (bfloat16 on both sides, so a near-tie may flip late; exact parity in float32
is tests/test_gpu.py's job).

    JAX_PLATFORMS=cuda python benchmarks/gpu_decode.py --out gpu_decode.json
    JAX_PLATFORMS=cuda python benchmarks/gpu_decode.py --backends hf,pallas --prefill-chunks 2048 \
        --quantization none,int8,fp8 --out benchmarks/results/gpu_decode_quant.json     # quantized weights
    JAX_PLATFORMS=cuda python benchmarks/gpu_decode.py --backends hf,pallas --prefill-chunks 256,2048
    JAX_PLATFORMS=cuda python benchmarks/gpu_decode.py --backends pallas --batches 1,8 --profile /tmp/prof
    JAX_PLATFORMS=cuda python benchmarks/gpu_decode.py --backends hf,pallas --batches 1,8 --gpu-matmul auto,xla
    python benchmarks/gpu_decode.py --summarize /tmp/prof/pallas-256/plugins/profile/*/perfetto_trace.json.gz
    JAX_PLATFORMS=cpu python benchmarks/gpu_decode.py --shape tiny --batches 1,4 --new-tokens 16   # a dry run
    JAX_PLATFORMS=cpu python benchmarks/gpu_decode.py --shape tiny --batches 1,4 --new-tokens 16 \
        --backends hf,xla --gpu-matmul pallas --quantization none,int8 --hbm-tbps 0.03   # dry run, kernel interpreted

The quantized-weights run (the second command) is the whole GPU measurement of quantized weights: the 1B shape
in bfloat16, int8 and fp8 at batch 1 / 8 / 64 beside transformers, one process, about 4-5 minutes on one H200
(three engines of ~40 s compile each, transformers ~40 s, the model made and converted ~25 s). Drop fp8
(`--quantization none,int8`) to save a minute. It exits 1 if any engine failed (the others still run; the
error is in the results file).

`--profile` traces one batch-1 plan (a prefill and 36 decode passes) and records, per pass, the device's busy
time, its device-to-host copies (each a point where the host waits for the device) and the ops with the most
device time (`profile_b1`); `--summarize` prints the same for a trace made earlier.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                 tie_word_embeddings=False),
}
MAX_SEQ_LEN = 512


HBM_BYTES_S = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12,
               "A100": 1.56e12}
"""Published HBM bandwidth by GPU name (a substring of jax's `device_kind`, first match): H200 4.8 TB/s, H100 SXM
3.35 TB/s (PCIe 2.0, NVL 3.9), A100 80 GB SXM 2.04 TB/s (40 GB 1.56). `--hbm-tbps` overrides it."""


def hbm_bytes_s(device_kind: str) -> float | None:
    return next((v for k, v in HBM_BYTES_S.items() if k in device_kind), None)


def read_bytes(family, cfg, quantization: str) -> int:
    """Bytes of weights one decode pass reads, as the engine holds them (`Family.weight_bytes`: int8 / fp8
    kernels with their float32 scales, the rest bfloat16): every parameter but a separate embedding table, of
    which a pass reads one row per token (a tied table is the LM head, read whole)."""
    from raydeploy.model.llama import EMBEDDING

    fam = family.with_quantization(quantization)
    total = fam.weight_bytes(cfg, "bfloat16")
    if not getattr(cfg, "tie_word_embeddings", False):
        spec = fam.param_specs(cfg).get(EMBEDDING)
        total -= 0 if spec is None else spec.numel * 2
    return total


def hbm_limit(weight_bytes: int, batches: list[int], bytes_s: float | None) -> dict | None:
    """The HBM-bandwidth bound of decode from the weights alone: a pass reads `weight_bytes` once and gives one
    token per row, so a token takes at least weight_bytes / bandwidth and `b` rows reach at most b x bandwidth /
    weight_bytes tokens/s (the KV cache's reads, small at these contexts, are left out: the bound is loose by
    them at batch 64)."""
    if bytes_s is None:
        return None
    ms = 1e3 * weight_bytes / bytes_s
    return {"hbm_bytes_s": bytes_s, "ms_per_pass": ms,
            "tok_s": {str(b): b * 1e3 / ms for b in batches}}


def _prompts(n: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, int(rng.integers(32, 65))).tolist() for _ in range(n)]


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(shape: str, dst: Path):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**SHAPES[shape])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(dst)
    return model


def summarize_trace(path: Path, passes: int, top: int = 12) -> dict:
    """Device time per op in a profiler's Perfetto trace (`jax.profiler.trace(..., create_perfetto_trace=True)`)
    of a plan of `passes` decode passes (its prefill pass counted in with them): per pass, the device's busy time, its kernels and copies, and how many copies go
    to the host (each one a point where the host waits for the device); the `top` ops by device time."""
    import gzip
    from collections import defaultdict

    events = json.load(gzip.open(path))["traceEvents"]
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "/device:" in e["args"]["name"]}
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in devices:
            continue
        a = e.get("args", {})
        name = e["name"] if not e["name"].startswith("Memcpy") else f"{e['name']} ({a.get('hlo_op', '?')})"
        ops[name][0] += 1
        ops[name][1] += e["dur"]
    if not ops:
        return {"device_events": 0}
    busy = sum(v[1] for v in ops.values())
    per_pass = {"busy_ms": busy / passes / 1e3,
                "to_host_copies": sum(v[0] for k, v in ops.items() if k.startswith("MemcpyD2H")) / passes,
                "device_copy_ms": sum(v[1] for k, v in ops.items() if k.startswith("MemcpyD2D")) / passes / 1e3}
    ranked = sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]
    return {"passes": passes, "per_pass": per_pass,
            "top_ops": [{"op": k, "calls_per_pass": v[0] / passes, "ms_per_pass": v[1] / passes / 1e3}
                        for k, v in ranked]}


def bench_hf(model, prompts: list[list[int]], batches: list[int], new_tokens: int) -> dict:
    import torch

    device = next(model.parameters()).device

    def gen(batch: int, n: int) -> tuple[float, list[int]]:
        ids = prompts[:batch]
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[0] * (width - len(i)) + i for i in ids], device=device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
        _sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        _sync()
        return time.perf_counter() - t, out[0, width:].tolist()

    out: dict = {"backend": "transformers generate (eager PyTorch, bfloat16, dynamic cache)", "batches": {}}
    for b in batches:
        gen(b, 4)  # warm up
        ttft, _ = gen(b, 1)
        total, tokens = gen(b, new_tokens)
        out["batches"][str(b)] = {"ttft_s": ttft, "decode_tok_s": b * (new_tokens - 1) / (total - ttft),
                                  "run_tok_s": b * new_tokens / total}
        if b == 1:
            out["greedy_tokens"] = tokens
    return out


def bench_ours(ckpt: Path, attention: str, chunk: int, prompts: list[list[int]], batches: list[int],
               new_tokens: int, profile: Path | None = None, gpu_matmul: str = "auto",
               quantization: str = "none", hbm_bytes_s: float | None = None) -> dict:
    """Our engine over the converted checkpoint, built as a host builds it (`raydeploy.loading.build_engine`):
    with `quantization` int8 / fp8 the engine quantizes the bfloat16 checkpoint while loading
    (`model.quantization`)."""
    import jax

    from raydeploy.config import EngineConfig, ModelConfig, load_config
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Paging, Scheduler
    from raydeploy.loading import build_engine
    from raydeploy.model.sharding import build_mesh, merge_rules

    slots = max(batches)
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    model_cfg = ModelConfig(dtype="bfloat16", param_dtype="bfloat16", max_seq_len=MAX_SEQ_LEN,
                            quantization=quantization)
    # in_out and XLA's CPU dot: what a GPU resolves anyway; on a CPU dry run they let `gpu_matmul pallas` run the
    # Pallas kernel (interpret mode) instead of the CPU's own layout and kernels
    engine_cfg = EngineConfig(max_slots=slots, max_new_tokens=new_tokens,
                              attention=attention, compilation_cache_dir=None, prefill_chunk=chunk,
                              gpu_matmul=gpu_matmul, kernel_layout="in_out", cpu_matmul="xla")
    cfg = load_config(None, ["mesh.axes.dp=1", "cluster.num_hosts=1"])
    t0 = time.perf_counter()
    built = build_engine(cfg, mesh, ckpt, engine_cfg=engine_cfg, model_cfg=model_cfg, load_threads=8,
                         rules=merge_rules({}))
    engine = built.engine
    load_s = time.perf_counter() - t0
    compile_s = engine.warmup()
    weights = read_bytes(built.family, built.model, quantization)

    def run(batch: int) -> tuple[list, float, float, float]:
        paging = Paging(engine.page_size, engine.pages_per_group, engine.groups, engine.max_step_tokens,
                        engine_cfg.prefix_caching, engine.mixed_step_tokens, engine_cfg.max_decode_slowdown,
                        engine_cfg.burst_wait)
        sched = Scheduler(slots, MAX_SEQ_LEN, (), 2 * slots, paging, slot_order=engine.slot_order,
                          decode_steps=engine.decode_steps)
        runner = LocalRunner(engine, sched)
        reqs = [GenerationRequest(f"b{batch}-{i}", tuple(prompts[i]), new_tokens, ignore_eos=True)
                for i in range(batch)]
        t = time.perf_counter()
        outs = runner.generate(reqs)
        total = time.perf_counter() - t
        ttft = max(o.first_token_s for o in outs)
        tokens = sum(len(o.token_ids) for o in outs)
        return outs, ttft, (tokens - len(outs)) / (total - ttft), tokens / total

    def pass_ms(batch: int) -> float:
        """Wall time per decode pass of `batch` rows inside one plan (the same prefill, then plans of 4 and 36
        passes; the difference over 32 passes): the passes' device time and per-pass dispatch, without the
        scheduler and the plans' readback between them."""
        from raydeploy.engine.step import SamplingParams, StepPlan
        from raydeploy.testing.plans import prefill_and_decode

        walls = []
        for n, steps in enumerate((4, 36, 4, 36)):
            items = [(i, prompts[i], SamplingParams()) for i in range(batch)]
            t = time.perf_counter()
            prefill_and_decode(engine, items, steps, 1000 + 100 * n)
            walls.append(time.perf_counter() - t)
            engine.step(StepPlan(2000 + n, release=tuple(range(batch))))
        return 1e3 * (walls[3] - walls[2]) / 32  # the second pair: the first compiles nothing new, but warms

    weights_label = "bfloat16" if quantization == "none" else f"{quantization} weights"
    out: dict = {"backend": f"raydeploy engine (JAX {jax.__version__}, attention {attention}, {weights_label}, "
                            f"max_slots {slots}, decode_steps {engine.decode_steps}, prefill_chunk {chunk}, "
                            f"gpu_matmul {gpu_matmul})",
                 "quantization": quantization, "attention": attention, "prefill_chunk": chunk,
                 "gpu_matmul": gpu_matmul,
                 "stacked_matmul": engine.programs_set.stacked_matmul or "in use",
                 "load_s": load_s, "compile_s": sum(compile_s.values()), "programs": len(compile_s),
                 "weight_bytes_read_per_pass": weights,
                 "hbm_limit": hbm_limit(weights, batches, hbm_bytes_s), "batches": {}}
    out["pass_ms"] = {str(b): pass_ms(b) for b in batches if b <= 8}
    if profile is not None:  # one batch-1 plan of 36 passes under the profiler: per-kernel device times
        from raydeploy.engine.step import SamplingParams, StepPlan
        from raydeploy.testing.plans import prefill_and_decode

        where = profile / f"{attention}-{chunk}-{gpu_matmul}"
        with jax.profiler.trace(str(where), create_perfetto_trace=True):
            prefill_and_decode(engine, [(0, prompts[0], SamplingParams())], 36, 3000)
        engine.step(StepPlan(3001, release=(0,)))
        out["profile_b1"] = summarize_trace(next(where.rglob("perfetto_trace.json.gz")), 36)
    for b in batches:
        run(b)  # untimed: first calls after warmup
        outs, ttft, tps, run_tps = run(b)
        out["batches"][str(b)] = {"ttft_s": ttft, "decode_tok_s": tps, "run_tok_s": run_tps}
        if b == 1:
            out["greedy_tokens"] = list(outs[0].token_ids)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunks", default="256", help="comma-separated engine.prefill_chunk values; each of "
                                                             "our backends runs once per value")
    ap.add_argument("--backends", default="hf,pallas,xla", help="comma-separated: hf, pallas, xla")
    ap.add_argument("--gpu-matmul", default="auto", help="comma-separated engine.gpu_matmul values (auto: the Pallas "
                    "kernel for few rows by a layer's stacked weight; xla: XLA's gemm); each of our backends runs "
                    "once per value")
    ap.add_argument("--quantization", default="none", help="comma-separated model.quantization values (none: "
                    "bfloat16 weights; int8 / fp8: the engine quantizes the bfloat16 checkpoint while loading); each "
                    "of our backends runs once per value")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="the GPU's HBM bandwidth in TB/s for the bound "
                    "printed beside each result (default: the published figure for the device's name, H200 4.8)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_decode.json")
    ap.add_argument("--profile", type=Path, default=None, help="a folder: trace one batch-1 plan (a prefill and "
                    "36 decode passes) per engine backend there (jax.profiler, with a Perfetto trace), and record "
                    "the device time per op in the results (`profile_b1`)")
    ap.add_argument("--summarize", type=Path, default=None, help="only summarise this Perfetto trace of one "
                    "batch-1 plan (as --profile writes) and print it")
    args = ap.parse_args()
    if args.summarize is not None:
        print(json.dumps(summarize_trace(args.summarize, 36), indent=1))
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    backends = args.backends.split(",")
    unknown = set(backends) - {"hf", "pallas", "xla"}
    if unknown:
        ap.error(f"--backends: unknown {sorted(unknown)}; valid: hf, pallas, xla")
    quantizations = args.quantization.split(",")
    unknown = set(quantizations) - {"none", "int8", "fp8"}
    if unknown:
        ap.error(f"--quantization: unknown {sorted(unknown)}; valid: none, int8, fp8")

    import jax
    import torch

    from raydeploy.checkpoint.convert import convert

    device = str(jax.devices()[0].device_kind)
    bandwidth = args.hbm_tbps * 1e12 if args.hbm_tbps else hbm_bytes_s(device)
    result: dict = {"shape": args.shape, "config": SHAPES[args.shape], "new_tokens": args.new_tokens,
                    "jax": jax.__version__, "torch": torch.__version__, "device": device,
                    "hbm_bytes_s": bandwidth, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "argv": sys.argv[1:], "results": []}
    print(f"jax {jax.__version__} on {jax.devices()}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        model = make_model(args.shape, Path(tmp) / "hf")
        prompts = _prompts(max(batches), SHAPES[args.shape]["vocab_size"])
        print(f"model made and saved in {time.perf_counter() - t:.1f} s", flush=True)
        if "hf" in backends:
            result["results"].append(bench_hf(model, prompts, batches, args.new_tokens))
            print(json.dumps(result["results"][-1]["batches"]), flush=True)
        del model
        torch.cuda.empty_cache()
        t = time.perf_counter()
        convert(Path(tmp) / "hf", Path(tmp) / "ckpt", progress=False)
        result["convert_s"] = time.perf_counter() - t
        failed = 0
        for attention in [b for b in backends if b != "hf"]:
            for chunk in [int(c) for c in args.prefill_chunks.split(",")]:
                for gpu_matmul in args.gpu_matmul.split(","):
                    for quantization in quantizations:
                        try:
                            r = bench_ours(Path(tmp) / "ckpt", attention, chunk, prompts, batches, args.new_tokens,
                                           args.profile, gpu_matmul, quantization, bandwidth)
                        except Exception as e:  # one setting's failure is recorded; the run goes on to the next
                            failed += 1
                            r = {"backend": f"raydeploy engine (attention {attention}, prefill_chunk {chunk}, "
                                            f"gpu_matmul {gpu_matmul}, quantization {quantization})",
                                 "quantization": quantization, "attention": attention, "prefill_chunk": chunk,
                                 "gpu_matmul": gpu_matmul, "error": f"{type(e).__name__}: {e}"}
                            traceback.print_exc()
                        result["results"].append(r)
                        print(json.dumps({k: v for k, v in r.items() if k != "greedy_tokens"}), flush=True)
    compare(result["results"])
    print_table(result, batches)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results in {args.out}")
    return 1 if failed else 0


def compare(results: list[dict]) -> None:
    """Each of our results against transformers' (tokens/s, greedy prefix) and, for a quantized engine, against
    the bfloat16 engine of the same settings in the same run (`ratio_vs_bf16`, `greedy_common_prefix_with_bf16`)."""
    from benchmarks.engine_decode import _matching_prefix

    ok = [r for r in results if "error" not in r]
    ref = next((r for r in ok if r["backend"].startswith("transformers")), None)
    for r in ok:
        if r is ref:
            continue
        if ref is not None:
            r["greedy_common_prefix_with_hf"] = _matching_prefix(r["greedy_tokens"], ref["greedy_tokens"])
            r["ratio_vs_hf"] = {b: r["batches"][b]["run_tok_s"] / ref["batches"][b]["run_tok_s"]
                                for b in r["batches"]}
        bf16 = next((o for o in ok if o.get("quantization") == "none" and r.get("quantization") not in (None, "none")
                     and all(o.get(k) == r.get(k) for k in ("attention", "prefill_chunk", "gpu_matmul"))), None)
        if bf16 is not None:
            r["greedy_common_prefix_with_bf16"] = _matching_prefix(r["greedy_tokens"], bf16["greedy_tokens"])
            r["ratio_vs_bf16"] = {b: r["batches"][b]["run_tok_s"] / bf16["batches"][b]["run_tok_s"]
                                  for b in r["batches"]}
            if "pass_ms" in r and "pass_ms" in bf16:
                r["pass_ms_vs_bf16"] = {b: r["pass_ms"][b] / bf16["pass_ms"][b] for b in r["pass_ms"]}


def _label(r: dict) -> str:
    if "quantization" not in r:
        return r["backend"][:60]
    weights = "bf16" if r["quantization"] == "none" else r["quantization"]
    return f"ours: {weights}, attention {r['attention']}, chunk {r['prefill_chunk']}, gpu_matmul {r['gpu_matmul']}"


def print_table(result: dict, batches: list[int]) -> None:
    """Tokens/s per batch size, the ratios to transformers and to the bfloat16 engine, the greedy prefix shared
    with the bfloat16 engine (of `new_tokens`), and under each result the HBM-bandwidth bound."""
    bw = result.get("hbm_bytes_s")
    print("\n" + "backend".ljust(60) + "".join(f"b{b} tok/s".rjust(14) for b in batches)
          + f"  b{batches[-1]} TTFT s  vs hf / vs bf16 (greedy prefix)")
    for r in result["results"]:
        if "error" in r:
            print(_label(r).ljust(60) + "  FAILED: " + r["error"][:300])
            continue
        cells = "".join(f"{r['batches'][str(b)]['run_tok_s']:14.1f}" for b in batches)
        ratios = " ".join(f"{x:.2f}x" for x in r.get("ratio_vs_hf", {}).values())
        if "ratio_vs_bf16" in r:
            ratios += " / " + " ".join(f"{x:.2f}x" for x in r["ratio_vs_bf16"].values())
            ratios += f" ({r['greedy_common_prefix_with_bf16']}/{len(r['greedy_tokens'])})"
        print(_label(r).ljust(60) + cells + f"{r['batches'][str(batches[-1])]['ttft_s']:11.3f}  " + ratios)
        limit = r.get("hbm_limit")
        if limit is not None:
            print(f"  HBM limit ({r['weight_bytes_read_per_pass'] / 1e9:.3f} GB of weights a pass / "
                  f"{bw / 1e12:.2f} TB/s = {limit['ms_per_pass']:.3f} ms a token)".ljust(60)
                  + "".join(f"{limit['tok_s'][str(b)]:14.1f}" for b in batches))
        elif "weight_bytes_read_per_pass" in r:
            print(f"  {r['weight_bytes_read_per_pass'] / 1e9:.4f} GB of weights a pass (no HBM bandwidth known for "
                  f"{result['device']}: --hbm-tbps)")


if __name__ == "__main__":
    raise SystemExit(main())
