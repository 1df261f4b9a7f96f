"""`raydeploy convert SRC DST`: pick the converter for the source format, run it, report size and speed.

Formats: a Hugging Face safetensors directory, a GGUF file, or an EasyDeL/fjformer streaming msgpack file
(`--from auto` guesses from the path). The result is a checkpoint directory (docs/checkpoint-format.md)
that `CheckpointReader` loads. User errors print one line naming the file/tensor and return 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from raydeploy.checkpoint.format import INDEX_FILE, CheckpointError
from raydeploy.checkpoint.writer import parse_size


def detect_format(src: Path) -> str:
    if src.is_dir():
        if any(src.glob("*.safetensors")) or (src / "model.safetensors.index.json").is_file():
            return "safetensors"
        raise CheckpointError("directory has no *.safetensors files; cannot tell its format (use --from)", str(src))
    if not src.exists():
        raise CheckpointError("source does not exist", str(src))
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf"
    if src.suffix in (".msgpack", ".easy", ".bin", "") or "streaming" in src.name:
        return "easydel"
    raise CheckpointError("cannot tell the source format from the file (use --from)", str(src))


def convert(src: str | Path, dst: str | Path, src_format: str = "auto", hf_config: str | None = None,
            shard_size_bytes: int = 1 << 30, dtype: str = "keep", progress: bool = True) -> dict[str, Any]:
    """Convert SRC into a checkpoint at DST. Returns {'format', 'bytes', 'tensors', 'seconds'}."""
    src, dst = Path(src), Path(dst)
    if (dst / INDEX_FILE).exists():
        raise CheckpointError("destination already holds a checkpoint (remove it or choose another)", str(dst))
    fmt = detect_format(src) if src_format == "auto" else src_format
    t0 = time.perf_counter()
    if fmt == "safetensors":
        from raydeploy.checkpoint.convert_safetensors import convert_safetensors

        out = convert_safetensors(src, dst, dtype=dtype, shard_size_bytes=shard_size_bytes, progress=progress)
    elif fmt == "gguf":
        from raydeploy.checkpoint.convert_gguf import convert_gguf

        out = convert_gguf(src, dst, dtype=dtype, shard_size_bytes=shard_size_bytes, progress=progress)
    elif fmt == "easydel":
        from raydeploy.checkpoint.convert_easydel import convert_easydel

        out = convert_easydel(src, dst, hf_config, dtype=dtype, shard_size_bytes=shard_size_bytes,
                              progress=progress)
    else:
        raise CheckpointError(f"unknown source format {fmt!r} (safetensors, gguf, easydel)")
    return {"format": fmt, **out, "seconds": time.perf_counter() - t0}


def run_convert(args: argparse.Namespace) -> int:
    """CLI entry: args.src, args.dst, args.src_format, args.hf_config, args.shard_size, args.dtype."""
    try:
        result = convert(args.src, args.dst, src_format=args.src_format, hf_config=args.hf_config,
                         shard_size_bytes=parse_size(args.shard_size), dtype=args.dtype,
                         progress=sys.stderr.isatty())
    except CheckpointError as e:
        print(f"raydeploy convert: {e}", file=sys.stderr)
        return 1
    gb = result["bytes"] / 1e9
    print(f"converted {result['format']} {args.src} -> {args.dst}: {result['tensors']} tensors, "
          f"{result['bytes']} bytes ({gb:.3f} GB) in {result['seconds']:.1f} s "
          f"({gb / max(result['seconds'], 1e-9):.2f} GB/s)")
    return 0
