"""Decode speed of our engine vs transformers PyTorch (and llama.cpp if installed), same model, same machine.

Each backend runs in its own subprocess (so peak RSS is per backend and thread pools do not fight), one
after another in the same run. Per backend: time to first token (TTFT) at batch 1, decode tokens/s at
batch 1 and with 8 concurrent sequences (128 new tokens each, eos ignored), peak RSS. Quality, so that a
faster dtype cannot hide a worse model: (1) the greedy tokens of our engine and of transformers on the batch-1
prompt, compared position by position, against the steps where the reference's top-1/top-2 logit gap is at
least 0.05 (below that a tie may flip either way); (2) perplexity of each backend on the same fixed English
text (teacher-forced, every position).

    .venv/bin/python benchmarks/engine_decode.py            # writes benchmarks/results/engine_decode.json
    .venv/bin/python benchmarks/engine_decode.py --new-tokens 64 --backends ours,hf

    .venv/bin/python benchmarks/engine_decode.py --dtype float32,bfloat16   # our engine in both weight dtypes
    .venv/bin/python benchmarks/engine_decode.py --rounds 3   # interleaved repeats, medians reported
    .venv/bin/python benchmarks/engine_decode.py --sampling temperature=0.7,top_p=0.95   # sampled decode

With `--sampling`, the timed decodes sample on both sides with those settings (the embedded default's are
temperature 0.7, top_p 0.95; transformers gets the same temperature / top_p / top_k, its default top_k of 50
off unless given), every row decodes its full token count (eos ignored on both sides), and one seed per
row; the quality checks stay greedy.

Our engine runs the serving configuration: max_slots 8 (a decode covers the occupied slots' bucket, so at
batch 1 one row), 4 decode steps per plan, float32 activations, float32 weights unless --dtype says
otherwise. Torch uses 2 threads (the machine's cores), float32; the `hf-bf16` backend runs transformers in
bfloat16 (weights and activations), the peer of `--dtype bfloat16`.

`--threads 1` runs every backend on one thread (ours: `PJRT_NPROC=1`, as a simulated gang host gets on this
machine; torch: one thread; llama.cpp: one thread). Each backend's `scaling_b8_over_b1` (tok/s at batch 8
over batch 1) is reported beside it: on one thread it is what 8 rows a host cost against one, which bounds
the serving figure "16 streams against 1" of the 2-host default (16 streams put 8 rows on each host's core;
one stream puts one row on one) at twice that (`stream_ceiling_16_vs_1`).

    .venv/bin/python benchmarks/engine_decode.py --threads 1 --backends ours,hf --rounds 3 \
        --out benchmarks/results/engine_decode_one_thread.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "engine_decode.json"
PROMPTS = [
    "Explain how a bicycle works.", "Write a short poem about autumn leaves.", "What is machine learning?",
    "Describe the water cycle.", "List three uses of copper.", "Why is the sky blue?",
    "How do vaccines work?", "Summarize the plot of Hamlet.",
]


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO))


def _tokenized(tok, n: int) -> list[list[int]]:
    out = []
    for p in PROMPTS[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        out.append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


# The perplexity text: plain prose, the same tokens for every backend.
EVAL_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. Farmers "
    "who had lived in the valley for generations knew the signs: a warm wind from the south, snow melting "
    "on the hills, and rain that did not stop for three days. They moved their animals to higher ground and "
    "carried sacks of grain into the lofts of their barns. In the town, the baker kept his ovens burning "
    "so that people would have bread, and the schoolteacher opened the school as a shelter for families "
    "whose houses stood too close to the banks. When the water finally began to fall, it left behind a "
    "layer of fine brown mud that covered roads, gardens and floors. Cleaning it away took weeks. Yet the "
    "older people said that the mud would make the soil rich, and that next summer the harvest would be "
    "better than it had been for years. Scientists who study rivers explain that floods have always shaped "
    "valleys like this one. Each flood carries sand and silt from the mountains and spreads it across the "
    "plain, building the land up little by little. Dams and walls can protect towns, but they also stop "
    "this natural process, and engineers today try to find a balance between safety and the health of the "
    "river itself."
)


def _eval_ids(tok) -> list[int]:
    return [int(i) for i in tok(EVAL_TEXT)["input_ids"]]


def _perplexity(logprobs_of_next: list[float]) -> float:
    import math

    return math.exp(-sum(logprobs_of_next) / len(logprobs_of_next))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- backends (each runs in its own process) ----------------------------------------------------------------


def _our_perplexity(llama_cfg, params, dtype: str, ids: list[int]) -> float:
    """Teacher-forced perplexity of our model (float32 activations, `dtype` weights) on `ids`."""
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp

    from raydeploy.model.llama import build_model

    graphdef, state = build_model(llama_cfg, params, "float32", dtype)
    logits = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, jnp.asarray([ids], jnp.int32))[0]
    lp = jax.nn.log_softmax(logits[:-1], axis=-1)
    return _perplexity(jnp.take_along_axis(lp, jnp.asarray(ids[1:])[:, None], axis=-1)[:, 0].tolist())


def _parse_sampling(text: str | None) -> dict:
    """`temperature=0.7,top_p=0.95[,top_k=K]` -> the settings (empty: greedy)."""
    if not text:
        return {}
    out: dict = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in ("temperature", "top_p", "top_k") or not value:
            raise ValueError(f"--sampling takes temperature=, top_p= and top_k= (comma-separated), got {part!r}")
        out[key] = int(value) if key == "top_k" else float(value)
    return out


def bench_ours(new_tokens: int, dtype: str, sampling: dict) -> dict:
    import jax
    from transformers import AutoTokenizer

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Paging, Scheduler
    from raydeploy.engine.step import SamplingParams
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    path = resolve_checkpoint("demo:smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    rules = merge_rules({})
    reader = CheckpointReader(path)
    t0 = time.perf_counter()
    params, _ = reader.load(reader.param_specs(), mesh, rules, dtype, 4, progress=False)
    model_cfg = ModelConfig(dtype="float32", param_dtype=dtype, max_seq_len=512)  # float32 activations
    engine_cfg = EngineConfig(max_slots=8, max_new_tokens=256)
    engine = Engine(*from_hf_config(reader.hf_config), params, mesh, rules, model_cfg, engine_cfg)
    load_s = time.perf_counter() - t0
    compile_s = engine.warmup()
    prompts = _tokenized(tok, 8)

    def run(batch: int) -> tuple[list, float, float]:
        paging = Paging(engine.page_size, engine.pages_per_group, engine.groups, engine.max_step_tokens,
                        engine_cfg.prefix_caching, engine.mixed_step_tokens)
        sched = Scheduler(8, 512, (), 16, paging, slot_order=engine.slot_order, decode_steps=engine.decode_steps)
        runner = LocalRunner(engine, sched)
        reqs = [GenerationRequest(f"b{batch}-{i}", tuple(prompts[i]), new_tokens,
                                  SamplingParams(**sampling, seed=i) if sampling else SamplingParams(),
                                  ignore_eos=bool(sampling)) for i in range(batch)]
        t = time.perf_counter()
        outs = runner.generate(reqs)
        total = time.perf_counter() - t
        ttft = max(o.first_token_s for o in outs)
        decoded = sum(len(o.token_ids) - 1 for o in outs)
        return outs, ttft, decoded / (total - ttft)

    ppl = _our_perplexity(from_hf_config(reader.hf_config)[1], params, dtype, _eval_ids(tok))
    run(1)  # one untimed pass: first calls after warmup still page in buffers
    outs1, ttft1, tps1 = run(1)
    _, ttft8, tps8 = run(8)
    how = f", sampling {sampling}" if sampling else ""
    return {"backend": f"raydeploy engine (JAX, {dtype} weights, max_slots 8, decode_steps {engine.decode_steps}{how})",
            "ttft_s": ttft1, "decode_tok_s_b1": tps1,
            "decode_tok_s_b8": tps8, "ttft_b8_s": ttft8, "load_s": load_s,
            "compile_s": sum(compile_s.values()), "peak_rss_mb": _peak_rss_mb(), "perplexity": ppl,
            "greedy_tokens": None if sampling else outs1[0].token_ids}


def _threads() -> int:
    """The thread count the parent gave every backend (`--threads`)."""
    return int(os.environ.get("RAYDEPLOY_BENCH_THREADS", "2"))


def bench_hf(new_tokens: int, sampling: dict, dtype: str = "float32") -> dict:
    import torch
    from hf_reference import load_hf

    torch.set_num_threads(_threads())
    t0 = time.perf_counter()
    model, tok = load_hf(dtype)
    load_s = time.perf_counter() - t0
    prompts = _tokenized(tok, 8)

    sample_kw = {"do_sample": True, "top_k": 0, **sampling} if sampling else {"do_sample": False}

    def gen(batch: int, n: int) -> tuple[float, list[int]]:
        ids = prompts[:batch]
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[2] * (width - len(i)) + i for i in ids])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        torch.manual_seed(0)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=2, **sample_kw)
        return time.perf_counter() - t, out[0, width:].tolist()

    from hf_reference import hf_greedy, trusted_steps

    gen(1, 4)  # warm up
    ttft1, _ = gen(1, 1)
    t1, _ = gen(1, new_tokens)
    tokens, gaps = hf_greedy(model, prompts[0], min(new_tokens, 48))  # quality reference: the model's own forward
    ids = _eval_ids(tok)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    ppl = _perplexity(lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    ttft8, _ = gen(8, 1)
    t8, _ = gen(8, new_tokens)
    how = f", sampling {sampling}" if sampling else ""
    return {"backend": f"transformers PyTorch ({dtype}, {_threads()} threads{how})", "ttft_s": ttft1,
            "decode_tok_s_b1": (new_tokens - 1) / (t1 - ttft1), "decode_tok_s_b8": 8 * (new_tokens - 1) / (t8 - ttft8),
            "ttft_b8_s": ttft8, "load_s": load_s, "peak_rss_mb": _peak_rss_mb(), "perplexity": ppl,
            "greedy_tokens": tokens, "greedy_trusted_steps": trusted_steps(gaps)}


def bench_llamacpp(new_tokens: int) -> dict:
    from hf_reference import gguf_path
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    p = gguf_path()
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    prompt = _tokenized(tok, 1)[0]
    t0 = time.perf_counter()
    llm = Llama(model_path=str(p), n_threads=_threads(), n_ctx=512, verbose=False)
    load_s = time.perf_counter() - t0

    def gen(n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        count = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            if count >= n:
                break
        return time.perf_counter() - t

    gen(4)
    ttft = gen(1)
    t = gen(new_tokens)
    return {"backend": f"llama.cpp (llama-cpp-python, Q4_1 GGUF, {_threads()} threads)", "ttft_s": ttft,
            "decode_tok_s_b1": (new_tokens - 1) / (t - ttft), "decode_tok_s_b8": None, "load_s": load_s,
            "peak_rss_mb": _peak_rss_mb()}


# -- orchestration --------------------------------------------------------------------------------------------


def _child(backend: str, new_tokens: int, dtype: str, sampling: str | None) -> None:
    _env()
    if backend == "ours":
        res = bench_ours(new_tokens, dtype, _parse_sampling(sampling))
    elif backend in ("hf", "hf-bf16"):
        res = bench_hf(new_tokens, _parse_sampling(sampling), "bfloat16" if backend == "hf-bf16" else "float32")
    else:
        res = bench_llamacpp(new_tokens)
    print("RESULT " + json.dumps(res))


def _run_child(backend: str, new_tokens: int, dtype: str, timeout_s: float, sampling: str | None,
               threads: int) -> dict | None:
    cmd = [sys.executable, __file__, "--child", backend, "--new-tokens", str(new_tokens), "--dtype", dtype]
    if sampling:
        cmd += ["--sampling", sampling]
    # PJRT_NPROC: the XLA CPU client's threads (our engine), as raydeploy.gang.host sets it for a simulated host
    env = {**os.environ, "RAYDEPLOY_BENCH_THREADS": str(threads), "PJRT_NPROC": str(threads)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        print(f"[{backend}] did not finish within {timeout_s} s; skipped", file=sys.stderr)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    print(f"[{backend}] failed (exit {proc.returncode}): {' | '.join(tail)}", file=sys.stderr)
    return None


TIMED = ("ttft_s", "decode_tok_s_b1", "decode_tok_s_b8", "ttft_b8_s", "peak_rss_mb")


def _median_result(rounds: list[dict]) -> dict:
    """One backend's result with each timed figure replaced by its median over the rounds (all kept)."""
    import statistics

    out = dict(rounds[0])
    for k in TIMED:
        vals = [r[k] for r in rounds if r.get(k) is not None]
        if vals:
            out[k] = statistics.median(vals)
    if len(rounds) > 1:
        out["rounds"] = [{k: r.get(k) for k in TIMED} for r in rounds]
    return out


def _matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32",
                    help="weight dtype(s) of our engine, comma-separated: float32, bfloat16 (activations float32)")
    ap.add_argument("--backends", default="ours,hf,llamacpp",
                    help="of ours, hf, hf-bf16 (transformers with bfloat16 weights and activations), llamacpp")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every backend this many times, interleaved, and report the medians (noisy machines)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--sampling", default=None,
                    help="sample the timed decodes, e.g. temperature=0.7,top_p=0.95 (default: greedy)")
    ap.add_argument("--threads", type=int, default=2,
                    help="threads of every backend (default 2, the machine's cores; 1: one simulated host's share)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.new_tokens, args.dtype, args.sampling)
        return 0
    try:
        _parse_sampling(args.sampling)
    except ValueError as e:
        ap.error(str(e))
    if args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")
    dtypes = args.dtype.split(",")
    if any(d not in ("float32", "bfloat16") for d in dtypes):
        ap.error(f"--dtype takes float32 and/or bfloat16, got {args.dtype!r}")
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):  # interleaved, so every backend sees the same spells of machine load
        for b in args.backends.split(","):
            if b == "llamacpp":
                if args.sampling:
                    if rnd == 0:
                        print("[llamacpp] runs greedy only; skipped with --sampling", file=sys.stderr)
                    continue
                try:
                    import llama_cpp  # noqa: F401
                except ImportError:
                    if rnd == 0:
                        print("[llamacpp] llama-cpp-python is not installed (make bench-deps); skipped",
                              file=sys.stderr)
                    continue
            for dtype in dtypes if b == "ours" else dtypes[:1]:
                key = b if b != "ours" or dtype == dtypes[0] else f"ours-{dtype}"
                r = _run_child(b, args.new_tokens, dtype, args.timeout_s, args.sampling, args.threads)
                if r is not None:
                    runs.setdefault(key, []).append(r)
                    print(f"[{key} round {rnd + 1}] " + json.dumps({k: v for k, v in r.items() if k != "greedy_tokens"}),
                          flush=True)
    from machine import cpu_flags  # benchmarks/, this script's directory

    results = {key: _median_result(rs) for key, rs in runs.items()}
    for r in results.values():
        if r.get("decode_tok_s_b8"):
            r["scaling_b8_over_b1"] = r["decode_tok_s_b8"] / r["decode_tok_s_b1"]
    report = {"new_tokens": args.new_tokens, "prompts": "chat template, 30-40 tokens", "rounds": args.rounds,
              "threads": args.threads, "cpu_flags": cpu_flags(),
              "sampling": _parse_sampling(args.sampling) or "greedy",
              "load_avg_1m": os.getloadavg()[0], "results": results}
    for key in [k for k in results if k.startswith("ours")]:
        if "hf" not in results:
            break
        ours, hf, sfx = results[key], results["hf"], key[len("ours"):]
        report[f"speedup_vs_hf_b1{sfx}"] = ours["decode_tok_s_b1"] / hf["decode_tok_s_b1"]
        report[f"speedup_vs_hf_b8{sfx}"] = ours["decode_tok_s_b8"] / hf["decode_tok_s_b8"]
        if ours["greedy_tokens"] is not None:  # sampled runs check quality by perplexity only
            report[f"greedy_match_prefix{sfx}"] = _matching_prefix(ours["greedy_tokens"], hf["greedy_tokens"])
            report[f"greedy_matches_trusted_steps{sfx}"] = (
                report[f"greedy_match_prefix{sfx}"] >= hf["greedy_trusted_steps"])
        report[f"perplexity_ratio_vs_hf{sfx}"] = ours["perplexity"] / hf["perplexity"]
    if args.threads == 1 and results.get("ours", {}).get("scaling_b8_over_b1"):
        report["stream_ceiling_16_vs_1"] = 2 * results["ours"]["scaling_b8_over_b1"]
    if "ours-bfloat16" in results and "hf-bf16" in results:  # both sides' weights in bfloat16
        ours, hf = results["ours-bfloat16"], results["hf-bf16"]
        report["speedup_vs_hf_bf16_b1-bfloat16"] = ours["decode_tok_s_b1"] / hf["decode_tok_s_b1"]
        report["speedup_vs_hf_bf16_b8-bfloat16"] = ours["decode_tok_s_b8"] / hf["decode_tok_s_b8"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'backend':58s} {'TTFT s':>7s} {'b1 tok/s':>9s} {'b8 tok/s':>9s} {'RSS MB':>7s}")
    for r in results.values():
        b8 = f"{r['decode_tok_s_b8']:9.1f}" if r.get("decode_tok_s_b8") else f"{'-':>9s}"
        print(f"{r['backend']:58s} {r['ttft_s']:7.3f} {r['decode_tok_s_b1']:9.1f} {b8} {r['peak_rss_mb']:7.0f}")
    if "hf" in results:
        print(f"reference greedy steps with top-1/top-2 gap >= 0.05 before the first smaller one: "
              f"{results['hf']['greedy_trusted_steps']} of {len(results['hf']['greedy_tokens'])}")
    for key, r in results.items():
        if r.get("scaling_b8_over_b1"):
            print(f"scaling b8/b1 [{key}]: {r['scaling_b8_over_b1']:.2f}")
    for key, r in results.items():
        if "perplexity" in r:
            print(f"perplexity [{key}]: {r['perplexity']:.4f}")
    for k, v in report.items():
        if k.startswith(("speedup_vs_hf", "greedy_match", "perplexity_ratio", "stream_ceiling")):
            print(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"load average during run: {report['load_avg_1m']:.1f}; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
