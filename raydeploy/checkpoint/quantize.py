"""`raydeploy convert --quantize int8|fp8`: a float raydeploy checkpoint -> one with quantized projection kernels.

Each projection kernel (`raydeploy.model.quant.quantized_kernel`) is read whole, one tensor at a time (a
per-output-channel scale needs every input row of its channel), quantized symmetric per output channel, and
written as int8 / float8_e4m3fn under its own name with its float32 scale `<kernel>_scale` after it; every other
tensor is copied as stored. The result is format version 5 (the index says `quantization`), stored as the source
was: stacked or per layer, each kernel split along the same dims as the source's (a `--split-for` checkpoint stays
one for its mesh), each scale split along the kernel's split output dims, so a host still reads only its slices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raydeploy.checkpoint.format import DEFAULT_BLOCK_BYTES, CheckpointError, TensorEntry
from raydeploy.checkpoint.reader import CheckpointReader
from raydeploy.checkpoint.writer import CheckpointWriter
from raydeploy.model import quant
from raydeploy.model.registry import from_hf_config
from raydeploy.model.spec import TensorSpec


def quantize_checkpoint(src: str | Path, dst: str | Path, mode: str, shard_size_bytes: int = 1 << 30,
                        progress: bool = False, block_bytes: int = DEFAULT_BLOCK_BYTES) -> dict[str, Any]:
    """Write `src` (a float raydeploy checkpoint) quantized as `mode` into `dst` (checksum blocks of `block_bytes`);
    {'tensors', 'bytes'}."""
    if quant.check_mode(mode) == "none":
        raise CheckpointError("--quantize needs int8 or fp8")
    reader = CheckpointReader(src)
    if reader.quantization != "none":
        raise CheckpointError(f"the checkpoint is already quantized {reader.quantization}: quantize a float "
                              "checkpoint", str(src))
    family, cfg = from_hf_config(reader.hf_config, source=str(Path(src) / "config.json"))
    specs = family.checkpoint_specs(cfg, reader.index.tensors)
    reader.check_specs(specs)
    names = list(reader.index.tensors)
    with CheckpointWriter(dst, shard_size_bytes=shard_size_bytes, block_bytes=block_bytes,
                          checksum=reader.index.checksum, quantization=mode) as w:
        for i, name in enumerate(names):
            e = reader.index.tensors[name]
            x = reader.read_tensor(name)
            if quant.quantized_kernel(name):
                spec = specs[name]
                q, s = quant.quantize_np(x, mode, quant.kernel_axes(spec))
                w.add(name, q, e.splits or None)
                w.add(quant.scale_name(name), s, scale_splits(spec, e) or None)
            else:
                w.add(name, x, e.splits or None)
            if progress:
                print(f"\rquantize {i + 1}/{len(names)} {name}", end="", flush=True)
        if progress:
            print()
        index = w.close(config=Path(src) / "config.json", tokenizer_dir=src)
    return {"tensors": len(index.tensors), "bytes": index.total_bytes}


def scale_splits(spec: TensorSpec, e: TensorEntry) -> tuple[tuple[int, int], ...]:
    """The splits of a kernel's scale: the kernel's splits along its output dims, renumbered for the scale (the
    input dims dropped); a split along an input dim has no counterpart (the scale has no such dim). A split of the
    scale's first dim cannot be stored (splits cut dims after the first): its rows are then the pieces."""
    drop = set(quant.kernel_axes(spec))
    kept = [d for d in range(len(spec.shape)) if d not in drop]
    out = []
    for dim, parts in e.splits:
        if dim in kept and kept.index(dim) > 0:
            out.append((kept.index(dim), parts))
    return tuple(out)
