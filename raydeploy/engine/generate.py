"""`raydeploy generate`: load the model in this process, generate once, print text (or one JSON object).

The mesh is the config's mesh over this process's own devices. On CPU, when JAX has not started yet, the
process gives itself as many virtual devices as the mesh needs; otherwise, if the mesh needs more devices
than are present, it falls back to one device and says so. Weights come from the configured checkpoint
(the demo model is converted once and cached); the tokenizer (and chat template) from the checkpoint dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from raydeploy.config import Config
from raydeploy.constraints.matcher import GrammarEngine


def _prepare_cpu_devices(cfg: Config, needed: int) -> None:
    """Ask for `needed` virtual CPU devices if JAX is not initialised yet and the platform is CPU."""
    if "jax" in sys.modules or cfg.cluster.platform != "cpu":
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={needed}".strip()
    if needed > (os.cpu_count() or 1):
        # more virtual devices than cores: a larger CPU thread pool avoids a collective deadlock
        os.environ.setdefault("PJRT_NPROC", str(max(8, 2 * needed)))


def _local_mesh(cfg: Config) -> tuple[Any, str | None]:
    import jax

    from raydeploy.model.sharding import build_mesh

    shape = cfg.mesh_shape
    needed = math.prod(shape.values())
    devices = jax.local_devices()
    if needed <= len(devices):
        return build_mesh(shape, devices[:needed]), None
    note = (f"mesh {shape} needs {needed} devices but this process has {len(devices)}; "
            "using a 1-device mesh")
    return build_mesh({name: 1 for name in shape}, devices[:1]), note


def _prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    if args.chat is not None:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.chat}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(args.prompt)["input_ids"]]


def run_generate(cfg: Config, args: argparse.Namespace) -> int:
    """Generate for one prompt; returns the exit code (1 with one clear line for bad input)."""
    from raydeploy.checkpoint.format import CheckpointError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.max_tokens < 1:
        print(f"raydeploy generate: --max-tokens must be >= 1, found {args.max_tokens}", file=sys.stderr)
        return 1
    if args.temperature is not None and args.temperature < 0:
        print(f"raydeploy generate: --temperature must be >= 0, found {args.temperature}", file=sys.stderr)
        return 1
    _prepare_cpu_devices(cfg, math.prod(cfg.mesh_shape.values()))
    try:
        return _generate(cfg, args)
    except (CheckpointError, ValueError) as e:
        print(f"raydeploy generate: {e}", file=sys.stderr)
        return 1


def _generate(cfg: Config, args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.engine.local import LocalRunner
    from raydeploy.engine.request import GenerationRequest
    from raydeploy.engine.scheduler import Scheduler
    from raydeploy.engine.step import SamplingParams
    from raydeploy.loading import build_engine

    t0 = time.perf_counter()
    mesh, note = _local_mesh(cfg)
    if note:
        print(f"raydeploy generate: note: {note}", file=sys.stderr)
    path = resolve_checkpoint(cfg.model.checkpoint)
    engine = build_engine(cfg, mesh, path).engine
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    load_s = time.perf_counter() - t0

    prompt_ids = _prompt_ids(tokenizer, args)
    # the config's engine.sampling for what the command line leaves out
    sampling = SamplingParams.resolve(cfg.engine.sampling, temperature=args.temperature, top_p=args.top_p,
                                      top_k=args.top_k, seed=args.seed)
    req = GenerationRequest("generate-0", tuple(prompt_ids), args.max_tokens, sampling)
    grammar = GrammarEngine.from_hf(tokenizer, engine.vocab_size, engine.eos_ids)
    runner = LocalRunner(engine, Scheduler.for_engine(engine, cfg, grammar=grammar))
    t1 = time.perf_counter()
    (out,) = runner.generate([req], timeout_s=cfg.serving.request_timeout_s)
    total_s = time.perf_counter() - t1
    if out.finish_reason == "error":
        print(f"raydeploy generate: generation failed: {out.error}", file=sys.stderr)
        return 1
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    ttft = out.first_token_s or 0.0
    decode_tokens = max(len(out.token_ids) - 1, 0)
    decode_s = max(total_s - ttft, 1e-9)
    if args.json:
        print(json.dumps({
            "text": text, "token_ids": out.token_ids, "prompt_tokens": len(prompt_ids),
            "finish_reason": out.finish_reason, "mesh": dict(mesh.shape), "note": note,
            "timings": {"load_s": round(load_s, 3), "first_token_s": round(ttft, 3), "total_s": round(total_s, 3),
                        "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_tokens else None},
        }))
    else:
        print(text)
        print(f"[{len(out.token_ids)} tokens, finish {out.finish_reason}; load {load_s:.1f} s, first token "
              f"{ttft:.2f} s (includes compiling), total {total_s:.2f} s]", file=sys.stderr)
    return 0
