"""The `raydeploy` command line: parses arguments and calls into the package; holds no logic of its own."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_config_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("config", nargs="?", default=None,
                       help="deployment YAML (default: the embedded default, configs/local.yaml)")
    else:
        p.add_argument("--config", "-c", default=None,
                       help="deployment YAML (default: the embedded default, configs/local.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set engine.max_slots=4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raydeploy",
        description="Serve JAX/Flax LLMs across a gang of hosts with Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="start the gang and the HTTP server (OpenAI-compatible API)",
                       description="Bring up the gang described by CONFIG and serve it over HTTP until Ctrl-C/SIGTERM.")
    _add_config_args(p, positional=True)
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else start a local one)")
    p.add_argument("--engine", choices=["real", "toy"], default="real",
                   help="toy: a stand-in engine that loads no weights behind the real HTTP stack (the checkpoint "
                        "still provides the tokenizer), to smoke-test placement, jax.distributed and shutdown "
                        "(default real)")

    p = sub.add_parser("generate", help="generate text with the engine in this process",
                       description="Load the model in this process (its mesh over local devices) and generate once.")
    _add_config_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="raw prompt text")
    g.add_argument("--chat", help="one user message; the model's chat template is applied")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the config's engine.sampling.temperature)")
    p.add_argument("--top-p", type=float, default=None, help="default: the config's engine.sampling.top_p")
    p.add_argument("--top-k", type=int, default=None, help="default: the config's engine.sampling.top_k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, timings)")

    p = sub.add_parser("convert", help="convert weights into a raydeploy msgpack-sharded checkpoint",
                       description="Convert a Hugging Face safetensors directory, a GGUF file, or an EasyDeL "
                                   "msgpack stream into a raydeploy checkpoint directory.")
    p.add_argument("src", help="source: safetensors directory, .gguf file, EasyDeL msgpack file, or (with --quantize) "
                               "a raydeploy checkpoint directory")
    p.add_argument("dst", help="destination checkpoint directory")
    p.add_argument("--from", dest="src_format", choices=["auto", "safetensors", "gguf", "easydel", "raydeploy"],
                   default="auto", help="source format (raydeploy: a raydeploy checkpoint directory, with --quantize)")
    p.add_argument("--hf-config", default=None,
                   help="config.json (and tokenizer files beside it) for formats that do not carry one (easydel)")
    p.add_argument("--shard-size", default="1GB", help="target shard file size, e.g. 512MB, 2GB (default 1GB)")
    p.add_argument("--dtype", choices=["keep", "float32", "bfloat16"], default="keep",
                   help="store tensors in this dtype (default: keep the source's; GGUF quantized -> float32)")
    p.add_argument("--split-for", default=None, metavar="CONFIG",
                   help="store the tensors whose column dims this config's mesh shards split into its shard "
                        "count, so its hosts read their slices without copies (any mesh still reads it)")
    p.add_argument("--layers", choices=["auto", "stacked", "per-layer"], default="auto",
                   help="stacked: each per-layer tensor stored stacked over the layers [L, ...], as the engine holds "
                        "them, so hosts load them with no stacking copy (best read on the --split-for mesh); "
                        "per-layer: one tensor per layer (any mesh reads its row slices); auto (default): stacked "
                        "with --split-for, else per-layer")
    p.add_argument("--quantize", choices=["none", "int8", "fp8"], default="none",
                   help="store the projection kernels quantized per output channel with float32 scales (format "
                        "version 5; docs/quantization.md), from any float source; the embedding table, a separate "
                        "LM head and the norms keep --dtype")

    p = sub.add_parser("plan", help="show what a config would do, without any hardware",
                       description="Print hosts, devices, mesh, per-host parameter and KV-cache bytes and "
                                   "placement bundles; exit 1 on an impossible plan.")
    _add_config_args(p, positional=True)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--compile", action="store_true",
                   help="also compile every program for the target (as `raydeploy compile`) and check each one's "
                        "memory per device, temporaries included")

    p = sub.add_parser("compile", help="compile every program of a config for its target without its hardware "
                                       "(TPU deviceless through libtpu); memory per chip, collectives, cost",
                       description="Compile every program the engine runs (mixed steps: token buckets x page "
                                   "buckets) for the config's target: a TPU slice deviceless through libtpu, CPU "
                                   "as it is; GPU has no deviceless target. Reports per program the compile "
                                   "seconds, bytes per chip against the chip's memory, the collectives and the "
                                   "compiler's cost with a roofline time; exits 1 when a program does not fit.")
    _add_config_args(p, positional=True)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--only", default=None, metavar="KINDS",
                   help="comma-separated program kinds to compile: step, presence, verify (default all)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write the compiled programs into DIR as a persistent compilation cache; point "
                        "engine.compilation_cache_dir at it and bring-up loads them instead of compiling")

    p = sub.add_parser("predict", help="offline batch inference over the gang (JSONL in, JSONL out)")
    _add_config_args(p, positional=True)
    p.add_argument("--input", required=True, help="prompts.jsonl: one {\"prompt\": ...} or {\"messages\": [...]} per line")
    p.add_argument("--output", required=True,
                   help="out.jsonl, one row per input line; rows already there are checked against the input and "
                        "kept (resume); <output>.lock keeps a second run out")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per prompt (default: a line's own max_tokens, else engine.max_new_tokens if set, else "
                        "until the context ends)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the config's engine.sampling.temperature)")
    p.add_argument("--on-error", dest="on_error", choices=["skip", "fail"], default="skip",
                   help="a malformed line or a failed generation: write its error row and go on (skip, the "
                        "default: no work is lost), or stop after writing every earlier row, exit 1 (fail)")
    p.add_argument("--on-bad-line", dest="on_error", choices=["skip", "fail"], help="the same as --on-error")
    p.add_argument("--engine", choices=["real", "toy"], default="real",
                   help="toy: a stand-in engine that loads no weights, to smoke-test a cluster's placement, "
                        "jax.distributed and job plumbing (default real)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else local)")

    p = sub.add_parser("submit", help="submit `serve` or `predict` to a Ray cluster with the Ray Jobs API")
    p.add_argument("config", help="deployment YAML to ship with the job")
    p.add_argument("--address", default=None, help="Ray dashboard address (default: $RAY_ADDRESS or http://127.0.0.1:8265)")
    p.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the logs")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="stop following the job after this many seconds (it keeps running; default: until it ends)")
    p.add_argument("entry", nargs=argparse.REMAINDER, help="-- serve | predict ARGS...")

    p = sub.add_parser("status", help="ask a running deployment for its state")
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="base URL (default http://127.0.0.1:8000)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--api-key", default=None, help="API key, if the deployment requires one (default $RAYDEPLOY_API_KEY)")
    p.add_argument("--timeout-s", type=float, default=10.0, help="bound on each HTTP request (default 10)")

    p = sub.add_parser("config-reference", help="print the config reference (markdown) generated from the config types")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from raydeploy.platform_env import keep_jax_off_missing_tpu

    keep_jax_off_missing_tpu()  # before anything imports jax
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve` starts itself again in its own session
    if args.command is None:
        parser.print_help()
        return 2
    from raydeploy import commands

    return int(getattr(commands, args.command.replace("-", "_"))(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
