"""Hugging Face safetensors directory -> raydeploy checkpoint (every family of `raydeploy.model.registry`).

The source directory holds config.json, one `model.safetensors` or several shards listed in
`model.safetensors.index.json`, and tokenizer files (copied along). Tensors are memory-mapped straight
from the safetensors files (the header is parsed here, so bfloat16 works without torch), renamed and
re-laid-out with the family's name table (`Family.hf_names`), and streamed into the writer one at a time.
A compressed-tensors int8 checkpoint (`quantization_config`, `convert_compressed_tensors`) keeps its int8 weights
and their channel scales: the result is an int8 checkpoint (format version 5, `raydeploy.model.quant`).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from raydeploy.checkpoint.convert_compressed_tensors import compressed_config, scale_to_ours
from raydeploy.checkpoint.format import CONFIG_FILE, CheckpointError, numpy_dtype
from raydeploy.checkpoint.layout import (
    COPY,
    NameMap,
    TensorSink,
    cast,
    check_against_specs,
    to_ours,
)
from raydeploy.checkpoint.writer import CheckpointWriter
from raydeploy.model.quant import quantized_kernel, scale_name
from raydeploy.model.registry import UnknownModelType, family_for, supported_model_types

SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                      "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64"}

# A name-table target "name[3]": expert 3 of the stacked tensor "name" [E, ...].
EXPERT_PIECE = re.compile(r"(.+)\[(\d+)\]\Z")
EXPERT_INDEX = re.compile(r"(?<=experts\.)\d+(?=\.)")  # the expert number in a source name


def safetensors_files(src: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory, in index order."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"safetensors index has no usable weight_map: {e!r}", str(index)) from e
        files = []
        for fname in dict.fromkeys(weight_map.values()):
            p = src / fname
            if Path(fname).name != fname or not p.is_file():
                raise CheckpointError(f"safetensors shard {fname!r} listed in the index is missing", str(index))
            files.append(p)
        return files
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError("no *.safetensors files (and no model.safetensors.index.json)", str(src))
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, read-only memory-mapped array) for each tensor of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError("not a safetensors file (too short)", str(path))
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise CheckpointError(f"not a safetensors file (header length {n})", str(path))
        try:
            header: dict[str, Any] = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"safetensors header is not JSON: {e}", str(path)) from e
    data_start = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        st_dtype = meta.get("dtype")
        if st_dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"safetensors dtype {st_dtype!r} is not supported", str(path), tensor=name)
        dt = numpy_dtype(SAFETENSORS_DTYPES[st_dtype])
        a, b = meta["data_offsets"]
        shape = tuple(meta["shape"])
        if data_start + b > size or (b - a) != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise CheckpointError(f"tensor bytes [{a}, {b}) do not match shape {list(shape)} x {st_dtype} or "
                                  "the file size", str(path), tensor=name)
        yield name, mm[data_start + a: data_start + b].view(dt).reshape(shape)


def _cast(x: np.ndarray, dtype: str, keep: bool) -> np.ndarray:
    """`cast`, except for what keeps its dtype (`keep`: a quantized checkpoint's int8 weights and float32 scales)."""
    return x if keep else cast(x, dtype)


def read_hf_config(src: Path) -> dict[str, Any]:
    p = src / CONFIG_FILE
    if not p.is_file():
        raise CheckpointError(f"{CONFIG_FILE} is missing (a Hugging Face model directory has one)", str(src))
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"not valid JSON: {e}", str(p)) from e
    mt = cfg.get("model_type", "llama")
    if mt not in supported_model_types():
        raise CheckpointError(f"model_type {mt!r} is not supported (supported: {', '.join(supported_model_types())})",
                              str(p))
    return cfg


def convert_safetensors(src: str | Path, dst: str | Path, dtype: str = "keep", shard_size_bytes: int = 1 << 30,
                        progress: bool = True, splits: Mapping[str, int] | None = None,
                        stacked: bool = True) -> dict[str, Any]:
    """Convert a Hugging Face safetensors model directory (storing tensors split for `splits` and, with
    `stacked`, stacked over the layers: see layout.TensorSink). Returns {'bytes': ..., 'tensors': ...}."""
    from tqdm import tqdm

    src = Path(src)
    if not src.is_dir():
        raise CheckpointError("source is not a directory (a Hugging Face model directory is expected)", str(src))
    hf_cfg = read_hf_config(src)
    try:
        family = family_for(hf_cfg.get("model_type", "llama"))
        cfg = family.config_from_hf(hf_cfg)
    except (UnknownModelType, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"config is not usable: {e}", str(src / CONFIG_FILE)) from e
    compressed = compressed_config(hf_cfg, str(src / CONFIG_FILE))
    if compressed is not None:  # int8 weights with their scales, kept as they are
        family = family.with_quantization("int8")
    specs = family.param_specs(cfg)
    name_map = NameMap(family.hf_names, family.hf_ignored, source="safetensors")
    files = safetensors_files(src)
    shapes: dict[str, tuple[int, ...]] = {}
    num_experts = family.num_experts(cfg) if family.num_experts is not None else 0
    experts: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
    writer = CheckpointWriter(dst, shard_size_bytes=shard_size_bytes,
                              quantization="none" if compressed is None else "int8")
    sink = TensorSink(writer, family, cfg, splits, stacked)
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="convert safetensors",
               disable=not progress)
    try:
        for fp in files:
            for name, arr in iter_safetensors(fp):
                bar.update(arr.nbytes)
                is_scale = False
                if compressed is not None:
                    decoded = compressed.decode(name, arr)
                    if decoded is None:
                        continue
                    name, arr, is_scale = decoded
                mapped = name_map.lookup(name)
                if mapped is None:
                    continue
                ours, kind = mapped
                if compressed is not None:
                    base = EXPERT_PIECE.sub(r"\1", ours)
                    if quantized_kernel(base) != (arr.dtype == np.int8 or is_scale):
                        raise CheckpointError(f"tensor {name}: raydeploy holds {base} "
                                              f"{'int8' if quantized_kernel(base) else 'in model.param_dtype'}, "
                                              f"the checkpoint stores it {arr.dtype}", str(fp), tensor=name)
                if is_scale:
                    ours = EXPERT_PIECE.sub(lambda m: f"{scale_name(m.group(1))}[{m.group(2)}]", ours)
                    if EXPERT_PIECE.match(ours) is None:
                        ours = scale_name(ours)
                    arr = scale_to_ours(kind, arr, cfg, name)
                    kind = COPY
                keep = is_scale or arr.dtype == np.int8  # an int8 weight is laid out like a float one
                if ours == "lm_head.kernel" and cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                piece = EXPERT_PIECE.match(ours)
                if piece is not None:  # one expert of a stacked [E, ...] tensor: written once all E arrived
                    ours, expert = piece.group(1), int(piece.group(2))
                    got = experts.setdefault(ours, {})
                    if ours in shapes or expert in got:
                        raise CheckpointError(f"tensor {name} appears twice (as {ours} expert {expert})", str(fp),
                                              tensor=name)
                    if expert >= num_experts:
                        raise CheckpointError(f"tensor {name}: expert {expert} is out of range (the config has "
                                              f"{num_experts} experts)", str(fp), tensor=name)
                    got[expert] = (name, to_ours(kind, arr, cfg, name=name))
                    if len(got) < num_experts:
                        continue
                    out = _cast(np.stack([got[i][1] for i in range(num_experts)]), dtype, keep)
                    del experts[ours]
                elif ours in shapes:
                    raise CheckpointError(f"tensor {name} appears twice (as {ours})", str(fp), tensor=name)
                else:
                    out = _cast(to_ours(kind, arr, cfg, name=name), dtype, keep)
                shapes[ours] = tuple(out.shape)
                sink.add(ours, out)
        for ours, got in experts.items():
            missing = [i for i in range(num_experts) if i not in got]
            seen, _ = next(iter(got.values()))
            first = EXPERT_INDEX.sub(str(missing[0]), seen, count=1)
            raise CheckpointError(f"source lacks expert tensor(s) of {ours}: experts {missing[:8]} of "
                                  f"{num_experts} are missing, e.g. {first}", str(src), tensor=first)
        check_against_specs(shapes, cfg, str(src), specs)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    writer.close(config=src / CONFIG_FILE, tokenizer_dir=src)
    return {"bytes": writer.bytes_written, "tensors": len(shapes)}
