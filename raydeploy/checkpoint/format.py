"""The raydeploy checkpoint format: the index schema, its validation, and the msgpack byte layout.

A checkpoint is a directory (specified in docs/checkpoint-format.md):

    index.json            format name + version, checksum scheme, every tensor's dtype, shape, shard file,
                          byte offset/length of its raw row-major bytes and a checksum per fixed-size block
                          (crc32; version 3: crc32c, the writer's default);
                          (version 2) a tensor may be stored split along one dimension, (version 4) along
                          several (see TensorEntry)
    shard-00000.msgpack   a msgpack map {tensor name: flax ndarray ext}; readable by `msgpack.unpackb` and by
    shard-00001.msgpack   `flax.serialization.msgpack_restore`, and by `os.pread` of exactly the rows needed
    config.json           the Hugging Face config of the model (`LlamaConfig.from_json`)
    tokenizer files       tokenizer.json, tokenizer_config.json (chat template), special tokens, ...

The writer (writer.py) produces it, the reader (reader.py) validates it here before reading any tensor
byte; both read a tensor's stored bytes back with `pread_tensor_bytes`. Everything a user can get wrong raises `CheckpointError` naming the file, key or tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import numpy as np
from crc32c import crc32c

try:  # ISA-L computes the same crc32 as zlib, about 10x faster; optional
    from isal.isal_zlib import crc32 as crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32 as crc32

FORMAT_NAME = "raydeploy-checkpoint"
FORMAT_VERSION = 5
# Version 1 is version 2 without `split` entries; version 2 is version 3 with crc32 block checksums only;
# version 3 is version 4 with splits along one dimension only; version 4 is version 5 without quantized
# weights (int8 / float8_e4m3fn kernels with float32 `<kernel>_scale` tensors and the index's `quantization`).
# The reader reads all five; the writer writes the lowest version that holds what it wrote (3 unless a tensor is
# split along several dimensions: 4; 5 when the weights are quantized).
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MULTI_SPLIT_SINCE = 4
QUANTIZED_SINCE = 5
QUANTIZATIONS = ("int8", "fp8")  # the index's `quantization` (raydeploy.model.quant's modes); absent: float
# Block checksum algorithms (index `checksum.algorithm`) -> the function, and the first version that has it.
# crc32c (the SSE4.2 / ARMv8 CRC instruction, ~18 GB/s a core here) verifies at 1.5-1.8x ISA-L's crc32.
CHECKSUMS: dict[str, Callable[[Any], int]] = {"crc32": crc32, "crc32c": crc32c}
CHECKSUM_SINCE = {"crc32": 1, "crc32c": 3}
DEFAULT_CHECKSUM = "crc32c"
INDEX_FILE = "index.json"
CONFIG_FILE = "config.json"
# A host reads whole checksum blocks: 256 KiB keeps the over-read of a slice small on small tensors
# (1 MiB blocks made an fsdp=2 host of the demo model read 74% of the checkpoint instead of 59%).
DEFAULT_BLOCK_BYTES = 256 << 10
# flax.serialization.MAX_CHUNK_SIZE: arrays bigger than this are stored as flax "chunked arrays".
FLAX_MAX_CHUNK_BYTES = 1 << 30
# Raw tensor bytes start at offsets aligned to this (CPU runtimes can then alias them without a copy).
DATA_ALIGNMENT = 64
# Map key of padding entries the writer inserts before a tensor to align its raw bytes; readers skip it.
PAD_KEY = "__pad__"
# msgpack ext type code flax uses for ndarrays (flax.serialization._MsgpackExtType.ndarray).
FLAX_NDARRAY_EXT = 1

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint (or a conversion source) is missing, malformed or does not match the model."""

    def __init__(self, message: str, path: str | None = None, tensor: str | None = None):
        self.message = message
        self.path = path
        self.tensor = tensor
        where = ", ".join(x for x in (f"file {path}" if path else "", f"tensor {tensor}" if tensor else "") if x)
        super().__init__(f"{where}: {message}" if where else message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CheckpointError, (self.message, self.path, self.tensor))


@cache
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a stored dtype name (bfloat16 comes from ml_dtypes, as in JAX and flax)."""
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    if name not in STORABLE_DTYPES:
        raise CheckpointError(f"dtype {name!r} is not supported; supported: {', '.join(sorted(STORABLE_DTYPES))}")
    return np.dtype(name)


STORABLE_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64",
                             "float8_e4m3fn"})
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's raw bytes live. `segments` are (file offset, length) pieces in order; one piece
    unless the tensor was bigger than flax's chunk limit. `crc32[i]` is the checksum (of the index's
    algorithm: crc32, or crc32c from version 3 on; the key keeps its version-1 name) of raw bytes
    [i*block_bytes, (i+1)*block_bytes) of the tensor.

    `splits = ((dim, parts), ...)` (version 2: one; version 4: several, dims increasing): the raw bytes are
    not `shape` in C order but the pieces of the tensor cut into `parts` along each `dim` (>= 1), one after
    the other in row-major order of the piece grid (the first split's piece index varies slowest), each in
    C order: `split_pieces(x, splits)`. A device slice that is one piece along every split dim (a tp or fsdp
    shard of a column dimension, or of two: a stacked layer kernel [L, embed, mlp] on fsdp x tp) is then a
    contiguous byte range. The reader works in "stored rows": the `parts * shape[0]` rows of those stacked
    pieces (`parts` = the grid's size), each `row_bytes` long."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    length: int
    segments: tuple[tuple[int, int], ...]
    crc32: tuple[int, ...]
    splits: tuple[tuple[int, int], ...] = ()

    @cached_property  # the reader asks per block: computed once per entry
    def itemsize(self) -> int:
        return numpy_dtype(self.dtype).itemsize

    @cached_property
    def parts(self) -> int:
        """Pieces the tensor is stored in (the product of its splits' parts; 1 unsplit)."""
        return math.prod(n for _, n in self.splits)

    @cached_property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one stored row: shape[1:], with each split dimension cut to one piece."""
        rest = list(self.shape[1:])
        for dim, n in self.splits:
            rest[dim - 1] //= n
        return tuple(rest)

    @cached_property
    def stored_rows(self) -> int:
        return self.parts * self.shape[0] if self.shape else 1

    @cached_property
    def row_bytes(self) -> int:
        """Bytes of one stored row (one index along dim 0 of one piece; the whole tensor for a scalar)."""
        return self.itemsize * math.prod(self.row_shape)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "file": self.file,
                             "offset": self.offset, "length": self.length, "crc32": list(self.crc32)}
        if len(self.segments) > 1:
            d["segments"] = [list(s) for s in self.segments]
        if len(self.splits) == 1:
            d["split"] = list(self.splits[0])
        elif self.splits:
            d["split"] = [list(s) for s in self.splits]
        return d


@dataclass(frozen=True)
class CheckpointIndex:
    """The parsed index.json."""

    tensors: dict[str, TensorEntry]
    files: dict[str, int]          # shard file name -> size in bytes
    block_bytes: int
    total_bytes: int               # sum of all tensors' raw bytes
    version: int = FORMAT_VERSION  # as read (a version-1 index stays version 1)
    checksum: str = DEFAULT_CHECKSUM  # block checksum algorithm, a key of CHECKSUMS
    quantization: str = "none"  # version 5: how the projection kernels are stored (QUANTIZATIONS), else "none"

    def to_json(self) -> dict[str, Any]:
        d = {"format": FORMAT_NAME, "version": self.version, "data_alignment": DATA_ALIGNMENT,
             "checksum": {"algorithm": self.checksum, "block_bytes": self.block_bytes},
             "total_bytes": self.total_bytes, "files": dict(self.files),
             "tensors": {n: e.to_json() for n, e in self.tensors.items()}}
        if self.quantization != "none":
            d["quantization"] = self.quantization
        return d


def _need(d: dict[str, Any], key: str, types: type | tuple[type, ...], where: str, path: str) -> Any:
    if key not in d:
        raise CheckpointError(f"{where}: missing key {key!r}", path)
    v = d[key]
    if not isinstance(v, types) or isinstance(v, bool):
        raise CheckpointError(f"{where}: key {key!r} has type {type(v).__name__}", path)
    return v


def _plain_name(name: str, where: str, path: str) -> str:
    """A shard file name must stay inside the checkpoint directory."""
    p = Path(name)
    if not name or p.is_absolute() or len(p.parts) != 1 or name in (".", "..") or "\\" in name:
        raise CheckpointError(f"{where}: file name {name!r} escapes the checkpoint directory", path)
    return name


def parse_index(data: dict[str, Any], path: str, check_files_in: Path | None = None) -> CheckpointIndex:
    """Validate an index dict completely. With `check_files_in`, shard files must exist with the declared
    sizes and every tensor's bytes must lie inside its file."""
    if not isinstance(data, dict):
        raise CheckpointError("index is not a JSON object", path)
    fmt = data.get("format")
    if fmt != FORMAT_NAME:
        raise CheckpointError(f"format is {fmt!r}, expected {FORMAT_NAME!r}", path)
    version = data.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > max(READABLE_VERSIONS):
        raise CheckpointError(f"format version {version} is not supported: the checkpoint was written by a newer "
                              f"raydeploy, this one reads versions {', '.join(map(str, READABLE_VERSIONS))}; upgrade "
                              "raydeploy to read it", path)
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(f"format version {version!r} is not supported (this reader reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))})", path)
    quantization = data.get("quantization", "none")
    if quantization != "none" and (quantization not in QUANTIZATIONS or version < QUANTIZED_SINCE):
        raise CheckpointError(f"quantization {quantization!r} needs format version {QUANTIZED_SINCE} and one of "
                              f"{', '.join(QUANTIZATIONS)} (the index says version {version})", path)
    checksum = _need(data, "checksum", dict, "index", path)
    algorithm = checksum.get("algorithm")
    if algorithm not in CHECKSUMS:
        raise CheckpointError(f"checksum algorithm {algorithm!r} is not supported ({', '.join(CHECKSUMS)})", path)
    if version < CHECKSUM_SINCE[algorithm]:
        raise CheckpointError(f"checksum algorithm {algorithm!r} needs format version {CHECKSUM_SINCE[algorithm]} "
                              f"(the index says {version})", path)
    block_bytes = _need(checksum, "block_bytes", int, "checksum", path)
    if block_bytes <= 0:
        raise CheckpointError(f"checksum.block_bytes must be > 0, got {block_bytes}", path)
    files_raw = _need(data, "files", dict, "index", path)
    files: dict[str, int] = {}
    for fname, size in files_raw.items():
        _plain_name(fname, "files", path)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CheckpointError(f"files: size of {fname!r} must be a non-negative integer", path)
        files[fname] = size
    tensors_raw = _need(data, "tensors", dict, "index", path)
    tensors: dict[str, TensorEntry] = {}
    total = 0
    for name, e in tensors_raw.items():
        tensors[name] = _parse_entry(name, e, files, block_bytes, path, version)
        total += tensors[name].length
    declared_total = _need(data, "total_bytes", int, "index", path)
    if declared_total != total:
        raise CheckpointError(f"total_bytes is {declared_total} but the tensors add up to {total}", path)
    if check_files_in is not None:
        for fname, size in files.items():
            fp = check_files_in / fname
            if not fp.is_file():
                raise CheckpointError(f"shard file {fname} listed in the index does not exist", str(fp))
            actual = fp.stat().st_size
            if actual != size:
                raise CheckpointError(f"shard file is {actual} bytes, the index declares {size} (truncated or "
                                      "replaced?)", str(fp))
    if version < QUANTIZED_SINCE:
        for e in tensors.values():
            if e.dtype == "float8_e4m3fn":
                raise CheckpointError(f"dtype float8_e4m3fn needs format version {QUANTIZED_SINCE} (the index says "
                                      f"{version})", path, tensor=e.name)
    return CheckpointIndex(tensors=tensors, files=files, block_bytes=block_bytes, total_bytes=total, version=version,
                           checksum=algorithm, quantization=quantization)


def _parse_entry(name: str, e: Any, files: dict[str, int], block_bytes: int, path: str, version: int) -> TensorEntry:
    def fail(msg: str) -> CheckpointError:
        return CheckpointError(msg, path, tensor=name)

    if not isinstance(e, dict):
        raise fail("index entry is not an object")
    for key, types in (("dtype", str), ("shape", list), ("file", str), ("offset", int), ("length", int),
                       ("crc32", list)):
        if key not in e:
            raise fail(f"index entry is missing {key!r}")
        if not isinstance(e[key], types) or isinstance(e[key], bool):
            raise fail(f"index entry {key!r} has type {type(e[key]).__name__}")
    dtype = e["dtype"]
    if dtype not in STORABLE_DTYPES:
        raise fail(f"dtype {dtype!r} is not supported; supported: {', '.join(sorted(STORABLE_DTYPES))}")
    shape = tuple(e["shape"])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise fail(f"shape {list(shape)} must be a list of non-negative integers")
    fname = _plain_name(e["file"], f"tensor {name}", path)
    if fname not in files:
        raise fail(f"shard file {fname!r} is not listed in the index's files")
    length = e["length"]
    expected = math.prod(shape) * numpy_dtype(dtype).itemsize
    if length != expected:
        raise fail(f"length is {length} bytes but shape {list(shape)} x {dtype} needs {expected}")
    segs_raw = e.get("segments", [[e["offset"], length]])
    segments: list[tuple[int, int]] = []
    for s in segs_raw:
        if (not isinstance(s, list) or len(s) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s)):
            raise fail(f"segment {s!r} must be [offset, length] with non-negative integers")
        segments.append((s[0], s[1]))
    if sum(n for _, n in segments) != length:
        raise fail(f"segments add up to {sum(n for _, n in segments)} bytes, length is {length}")
    if segments and segments[0][0] != e["offset"]:
        raise fail("offset does not match the first segment")
    fsize = files[fname]
    for off, n in segments:
        if off + n > fsize:
            raise fail(f"bytes [{off}, {off + n}) lie beyond the end of {fname} ({fsize} bytes)")
    crcs = e["crc32"]
    n_blocks = -(-length // block_bytes)
    if len(crcs) != n_blocks or not all(isinstance(c, int) and 0 <= c < 2**32 for c in crcs):
        raise fail(f"crc32 must list {n_blocks} block checksums (32-bit integers), found {len(crcs)}")
    splits = _parse_split(e.get("split"), shape, version, fail)
    return TensorEntry(name=name, dtype=dtype, shape=shape, file=fname, offset=e["offset"], length=length,
                       segments=tuple(segments), crc32=tuple(crcs), splits=splits)


def _is_pair(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                               for v in x)


def check_splits(splits: Any, shape: tuple[int, ...]) -> str | None:
    """Why `splits` is not a valid sequence of (dim, parts) for a tensor of `shape`, or None."""
    if not isinstance(splits, (list, tuple)) or not splits or not all(_is_pair(s) for s in splits):
        return f"split {splits!r} must be [dim, parts] or a list of them (integers)"
    dims = [d for d, _ in splits]
    if dims != sorted(set(dims)):
        return f"split dims {dims} must be distinct and increasing"
    for dim, parts in splits:
        if not 1 <= dim < len(shape):
            return f"split dim {dim} must be a dimension after the first of shape {list(shape)}"
        if parts < 2 or shape[dim] % parts:
            return f"split into {parts} parts must be >= 2 parts that divide dimension {dim} (size {shape[dim]})"
    return None


def _parse_split(split: Any, shape: tuple[int, ...], version: int,
                 fail: Callable[[str], CheckpointError]) -> tuple[tuple[int, int], ...]:
    """The index's `split`: [dim, parts] (version 2) or [[dim, parts], ...] (version 4)."""
    if split is None:
        return ()
    if version < 2:
        raise fail(f"'split' needs format version 2 (the index says {version})")
    several = isinstance(split, list) and bool(split) and isinstance(split[0], list)
    if several and version < MULTI_SPLIT_SINCE:
        raise fail(f"'split' along several dimensions needs format version {MULTI_SPLIT_SINCE} "
                   f"(the index says {version})")
    splits = split if several else [split]
    why = check_splits(splits, shape)
    if why:
        raise fail(why)
    return tuple((int(d), int(n)) for d, n in splits)


def split_pieces(x: np.ndarray, splits: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The stored form of a split tensor: its pieces [parts, ...] in row-major order of the piece grid."""
    pieces = [np.asarray(x)]
    for dim, n in splits:
        pieces = [q for p in pieces for q in np.split(p, n, axis=dim)]
    return np.stack(pieces)


def join_pieces(stored: np.ndarray, splits: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The inverse of `split_pieces`: [parts, ...] pieces -> the tensor."""
    pieces = list(stored)
    for dim, n in reversed(splits):
        pieces = [np.concatenate(pieces[i:i + n], axis=dim) for i in range(0, len(pieces), n)]
    return pieces[0]


def tensor_spans(e: TensorEntry, start: int, n: int) -> list[tuple[int, int, int]]:
    """(file offset, position in the n bytes, length) of the tensor's raw bytes [start, start + n), following
    its segments."""
    out, pos, done = [], 0, 0
    for off, length in e.segments:
        lo = max(start + done, pos)
        if done < n and lo < pos + length:
            take = min(pos + length - lo, n - done)
            out.append((off + lo - pos, done, take))
            done += take
        pos += length
    if done != n:
        raise CheckpointError(f"bytes [{start}, {start + n}) lie beyond the tensor's {e.length}", tensor=e.name)
    return out


def read_index(ckpt_dir: Path) -> CheckpointIndex:
    """Parse and fully validate `ckpt_dir/index.json` against the shard files on disk."""
    p = ckpt_dir / INDEX_FILE
    if not p.is_file():
        raise CheckpointError(f"not a raydeploy checkpoint: {INDEX_FILE} is missing (convert weights with "
                              "`raydeploy convert`)", str(ckpt_dir))
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"index is not valid JSON: {e}", str(p)) from e
    return parse_index(data, str(p), check_files_in=ckpt_dir)


# ---- msgpack byte layout (shared by the writer and the tests) ----

def map32_header(count: int) -> bytes:
    return b"\xdf" + struct.pack(">I", count)


def ext32_header(length: int, code: int = FLAX_NDARRAY_EXT) -> bytes:
    return b"\xc9" + struct.pack(">Ib", length, code)


def bin32_header(length: int) -> bytes:
    return b"\xc6" + struct.pack(">I", length)


def aligned_empty(nbytes: int, alignment: int = 64) -> np.ndarray:
    """An uninitialised uint8 buffer whose start is `alignment`-aligned: on CPU, jax.device_put of an
    aligned numpy array aliases it instead of copying."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    off = (-raw.ctypes.data) % alignment
    return raw[off: off + nbytes]


def pread_tensor_bytes(fd: int, e: TensorEntry, start: int, out: memoryview, ckpt: Path) -> None:
    """Fill `out` with the tensor's raw bytes [start, start+len(out)), following its file segments."""
    try:
        spans = tensor_spans(e, start, len(out))
    except CheckpointError as err:
        raise CheckpointError(err.message, str(ckpt / e.file), tensor=e.name) from None
    for off, at, take in spans:
        pread_exact(fd, out[at: at + take], off, ckpt / e.file, e.name)


def pread_exact(fd: int, out: memoryview, offset: int, path: Path, tensor: str) -> None:
    """Fill `out` from byte `offset` of an open file; a short file is a CheckpointError naming it and the tensor."""
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            raise CheckpointError(f"unexpected end of file at byte {offset + got}", str(path), tensor=tensor)
        got += n
