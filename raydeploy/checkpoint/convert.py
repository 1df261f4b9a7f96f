"""`raydeploy convert SRC DST`: pick the converter for the source format, run it, report size and speed.

Formats: a Hugging Face safetensors directory, a GGUF file, or an EasyDeL/fjformer streaming msgpack file
(`--from auto` guesses from the path). The result is a checkpoint directory (docs/checkpoint-format.md)
that `CheckpointReader` loads. User errors print one line naming the file/tensor and return 1.
`--split-for CONFIG` stores the tensors whose column dimensions that config's mesh cuts split into those
parts (format version 2, or 4 when a tensor is cut along two), so its hosts read their slices without
copying them; any mesh still reads it. A conversion for a mesh stores the per-layer tensors stacked over the
layers, as the engine holds them (`--layers auto`, the default; `stacked` / `per-layer` choose). Without
`--split-for` they stay one tensor per layer: a mesh cuts a per-layer tensor's first dim (fsdp over hidden)
into row ranges each host reads alone, where in a stacked tensor that dim is the second and, unless split
for the mesh, every host would read all of it.
`--quantize int8|fp8` stores the projection kernels quantized per output channel with their scales (format
version 5, `raydeploy.checkpoint.quantize`), from any float source: a foreign one is converted first (beside DST,
removed after), a raydeploy checkpoint directory (`--from raydeploy`) is quantized directly.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raydeploy.checkpoint.format import INDEX_FILE, CheckpointError, read_index
from raydeploy.checkpoint.layout import column_splits
from raydeploy.checkpoint.quantize import quantize_checkpoint
from raydeploy.checkpoint.writer import parse_size
from raydeploy.config import ConfigError, load_config
from raydeploy.model.sharding import merge_rules


def detect_format(src: Path) -> str:
    if src.is_dir() and (src / INDEX_FILE).is_file():
        return "raydeploy"
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
            shard_size_bytes: int = 1 << 30, dtype: str = "keep", progress: bool = True,
            splits: Mapping[str, int] | None = None, stacked: bool | None = None, quantize: str = "none"
            ) -> dict[str, Any]:
    """Convert SRC into a checkpoint at DST (tensors stored split for `splits`: layout.column_splits; with
    `stacked`, each per-layer tensor stacked over the layers: layout.TensorSink; None: stacked when converting
    for a mesh, `splits` given, see the module docstring).
    `quantize` (int8 / fp8): the projection kernels stored quantized (module docstring).
    Returns {'format', 'bytes', 'tensors' (converted), 'stored' (in the index), 'seconds'}."""
    src, dst = Path(src), Path(dst)
    if (dst / INDEX_FILE).exists():
        raise CheckpointError("destination already holds a checkpoint (remove it or choose another)", str(dst))
    fmt = detect_format(src) if src_format == "auto" else src_format
    if quantize != "none":
        return _convert_quantized(src, dst, fmt, quantize, hf_config, shard_size_bytes, dtype, progress, splits,
                                  stacked)
    if fmt == "raydeploy":
        raise CheckpointError("already a raydeploy checkpoint (convert it with --quantize int8|fp8, or use it as "
                              "it is)", str(src))
    stacked = splits is not None if stacked is None else stacked
    t0 = time.perf_counter()
    if fmt == "safetensors":
        from raydeploy.checkpoint.convert_safetensors import convert_safetensors

        out = convert_safetensors(src, dst, dtype=dtype, shard_size_bytes=shard_size_bytes, progress=progress,
                                  splits=splits, stacked=stacked)
    elif fmt == "gguf":
        from raydeploy.checkpoint.convert_gguf import convert_gguf

        out = convert_gguf(src, dst, dtype=dtype, shard_size_bytes=shard_size_bytes, progress=progress, splits=splits,
                           stacked=stacked)
    elif fmt == "easydel":
        from raydeploy.checkpoint.convert_easydel import convert_easydel

        out = convert_easydel(src, dst, hf_config, dtype=dtype, shard_size_bytes=shard_size_bytes,
                              progress=progress, splits=splits,
                           stacked=stacked)
    else:
        raise CheckpointError(f"unknown source format {fmt!r} (safetensors, gguf, easydel, raydeploy)")
    return {"format": fmt, **out, "stored": len(read_index(dst).tensors), "seconds": time.perf_counter() - t0}


def _convert_quantized(src: Path, dst: Path, fmt: str, mode: str, hf_config: str | None, shard_size_bytes: int,
                       dtype: str, progress: bool, splits: Mapping[str, int] | None, stacked: bool | None
                       ) -> dict[str, Any]:
    """`convert` with `--quantize`: a foreign source converted to a float checkpoint beside `dst` first."""
    t0 = time.perf_counter()
    staging = None
    if fmt != "raydeploy":
        staging = dst.parent / f".{dst.name}.float"
        if staging.exists():
            shutil.rmtree(staging)
        convert(src, staging, fmt, hf_config, shard_size_bytes, dtype, progress, splits, stacked)
    try:
        out = quantize_checkpoint(staging or src, dst, mode, shard_size_bytes, progress)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return {"format": fmt, **out, "stored": len(read_index(dst).tensors), "seconds": time.perf_counter() - t0}


def splits_for_config(path: str | Path) -> dict[str, int]:
    """The column splits of a raydeploy config file's mesh (its axes and sharding rules)."""
    cfg = load_config(path, [])
    return column_splits(cfg.mesh_shape, merge_rules(cfg.mesh.rules))


def run_convert(args: argparse.Namespace) -> int:
    """CLI entry: args.src, args.dst, args.src_format, args.hf_config, args.shard_size, args.dtype,
    args.split_for (a config file, or None), args.layers ('auto', 'stacked' or 'per-layer'), args.quantize
    ('none', 'int8' or 'fp8')."""
    split_for = getattr(args, "split_for", None)
    try:
        splits = splits_for_config(split_for) if split_for else None
        result = convert(args.src, args.dst, src_format=args.src_format, hf_config=args.hf_config,
                         shard_size_bytes=parse_size(args.shard_size), dtype=args.dtype,
                         progress=sys.stderr.isatty(), splits=splits,
                         stacked={"stacked": True, "per-layer": False}.get(getattr(args, "layers", "auto")),
                         quantize=getattr(args, "quantize", "none"))
    except (CheckpointError, ConfigError) as e:
        print(f"raydeploy convert: {e}", file=sys.stderr)
        return 1
    gb = result["bytes"] / 1e9
    stored = (f" (stored as {result['stored']}, stacked over the layers)" if result["stored"] != result["tensors"]
              else "")
    print(f"converted {result['format']} {args.src} -> {args.dst}: {result['tensors']} tensors{stored}, "
          f"{result['bytes']} bytes ({gb:.3f} GB) in {result['seconds']:.1f} s "
          f"({gb / max(result['seconds'], 1e-9):.2f} GB/s)"
          + (f", split for {split_for}: {', '.join(f'{k} in {v}' for k, v in sorted(splits.items()))}"
             if splits else ""))
    return 0
