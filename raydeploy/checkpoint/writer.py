"""Write a raydeploy checkpoint: stream (name, array) pairs into msgpack shards, then the index, last.

Each shard file is one msgpack map {name: value}. A value is exactly what `flax.serialization` writes for
an ndarray: msgpack ext type 1 holding msgpack (shape, dtype name, raw C-order bytes), so the raw bytes sit
contiguously in the file and the index records their offset. Arrays bigger than flax's chunk limit (1 GiB)
are written in flax's chunked-array form; their raw bytes then lie in several segments. The map's entry
count is patched into its header when the shard is closed, so tensors stream through without buffering.
Shard files and config/tokenizer files are written first; `index.json` is written last, atomically, so a
directory without an index is never mistaken for a checkpoint.

`add(name, array, splits=((dim, parts), ...))` stores the tensor cut into `parts` pieces along each `dim`,
one piece after the other (format version 2, several dims: version 4; see format.TensorEntry): the msgpack
value is then the stacked pieces `[pieces, ...]`, and the index records the logical shape and the splits.
`SplitPlan` (layout.py) chooses the splits that make every device slice of a mesh one contiguous byte range.

`reserve(name, shape, dtype, splits)` then `put(name, i, array)` for every i < shape[0] writes a tensor one
index of its first dimension at a time (the layers of a stacked layer tensor, as a converter meets them):
the bytes are reserved in the shard when it is reserved, each `put` writes its rows where they belong
(one contiguous run per piece), and the checksums are computed from the file once the last index is in.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import msgpack
import numpy as np

from raydeploy.checkpoint.format import (
    CHECKSUMS,
    CONFIG_FILE,
    DATA_ALIGNMENT,
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHECKSUM,
    FLAX_MAX_CHUNK_BYTES,
    INDEX_FILE,
    MULTI_SPLIT_SINCE,
    PAD_KEY,
    QUANTIZATIONS,
    QUANTIZED_SINCE,
    STORABLE_DTYPES,
    TOKENIZER_FILES,
    CheckpointError,
    CheckpointIndex,
    TensorEntry,
    bin32_header,
    check_splits,
    ext32_header,
    map32_header,
    numpy_dtype,
    pread_tensor_bytes,
    split_pieces,
    tensor_spans,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer


def parse_size(text: str | int) -> int:
    """'1GB', '512MB', '64KiB', '1000' -> bytes (decimal and binary units)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6,
             "GB": 10**9, "TB": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "B": 1}
    num, mult = s, 1
    for u, m in units.items():
        if s.endswith(u):
            num, mult = s[: -len(u)], m
            break
    try:
        value = float(num)
    except ValueError:
        raise CheckpointError(f"size {text!r} is not a number with an optional unit (e.g. 512MB, 2GB)") from None
    if value <= 0:
        raise CheckpointError(f"size {text!r} must be positive")
    return int(value * mult)


def block_crcs(raw: memoryview, block_bytes: int, algorithm: str) -> list[int]:
    """The checksum (format.CHECKSUMS[algorithm]) of each `block_bytes` block of `raw`."""
    check = CHECKSUMS[algorithm]
    return [check(raw[i:i + block_bytes]) for i in range(0, len(raw), block_bytes)]


def _ndarray_prefix(shape: tuple[int, ...], dtype: str, nbytes: int) -> bytes:
    """msgpack of (shape, dtype, raw) up to the raw bytes: fixarray(3), shape, dtype, bin32 header."""
    return b"\x93" + msgpack.packb(list(shape)) + msgpack.packb(dtype) + bin32_header(nbytes)


Splits = Sequence[tuple[int, int]]


@dataclass
class _Reserved:
    """A tensor reserved in a shard and filled one index of its first dimension at a time."""

    entry: TensorEntry                      # crc32 empty until complete
    filled: set[int] = field(default_factory=set)


class CheckpointWriter:
    """Stream tensors into `dst` (created; must not already hold a checkpoint). Use as a context manager or
    call `close(config, tokenizer_dir)`; nothing counts as a checkpoint until the index is written."""

    def __init__(self, dst: str | Path, shard_size_bytes: int = 1 << 30, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 max_chunk_bytes: int = FLAX_MAX_CHUNK_BYTES, checksum: str = DEFAULT_CHECKSUM,
                 quantization: str = "none"):
        """`quantization`: how the projection kernels written are quantized (int8 / fp8: the index says so, format
        version 5; raydeploy.model.quant), none for float weights."""
        self.dst = Path(dst)
        if quantization != "none" and quantization not in QUANTIZATIONS:
            raise CheckpointError(f"quantization {quantization!r} is not one of none, {', '.join(QUANTIZATIONS)}")
        self.quantization = quantization
        if (self.dst / INDEX_FILE).exists():
            raise CheckpointError("destination already holds a checkpoint (remove it first)", str(self.dst))
        if checksum not in CHECKSUMS:
            raise CheckpointError(f"checksum {checksum!r} is not one of {', '.join(CHECKSUMS)}")
        self.checksum = checksum
        if shard_size_bytes <= 0 or block_bytes <= 0 or max_chunk_bytes <= 0:
            raise CheckpointError("shard_size_bytes, block_bytes and max_chunk_bytes must be positive")
        self.dst.mkdir(parents=True, exist_ok=True)
        self.shard_size_bytes = shard_size_bytes
        self.block_bytes = block_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self._entries: dict[str, TensorEntry] = {}
        self._files: dict[str, int] = {}
        self._f: BinaryIO | None = None
        self._fname = ""
        self._count = 0
        self._reserved: dict[str, _Reserved] = {}
        self._put_fds: dict[str, int] = {}
        self.bytes_written = 0

    # -- shards --
    def _open_shard(self) -> None:
        self._fname = f"shard-{len(self._files):05d}.msgpack"
        self._f = open(self.dst / self._fname, "wb")  # noqa: SIM115 - closed in _close_shard
        self._f.write(map32_header(0))
        self._count = 0
        self._files[self._fname] = 0

    def _close_shard(self) -> None:
        if self._f is None:
            return
        f = self._f
        size = f.tell()
        f.truncate(size)  # a reserved tensor at the end is a hole until its puts fill it
        f.seek(1)
        f.write(struct.pack(">I", self._count))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._files[self._fname] = size
        self._f = None

    def _pad_for(self, head_bytes: int) -> None:
        """Insert a {PAD_KEY: bin} map entry so that the raw bytes after `head_bytes` more bytes start at a
        multiple of DATA_ALIGNMENT. The entry is 10 + k bytes (k = 0..63), which reaches every residue."""
        assert self._f is not None
        pad_key = msgpack.packb(PAD_KEY)
        misalign = (self._f.tell() + head_bytes) % DATA_ALIGNMENT
        if misalign == 0:
            return
        k = (DATA_ALIGNMENT - misalign - len(pad_key) - 2) % DATA_ALIGNMENT
        self._f.write(pad_key + b"\xc4" + bytes([k]) + bytes(k))
        self._count += 1

    def _normalize(self, name: str, shape: tuple[int, ...], splits: Splits | None) -> tuple[tuple[int, int], ...]:
        if name in self._entries or name in self._reserved:
            raise CheckpointError(f"tensor written twice: {name}", tensor=name)
        if name == PAD_KEY:
            raise CheckpointError(f"{PAD_KEY!r} is reserved for padding entries", tensor=name)
        if not splits:
            return ()
        why = check_splits(splits, shape)
        if why:
            raise CheckpointError(why, tensor=name)
        return tuple((int(d), int(n)) for d, n in splits)

    def _write_value(self, name: str, stored_shape: tuple[int, ...], dtype: str, nbytes: int,
                     raw: memoryview | None) -> tuple[tuple[int, int], ...]:
        """Append `name: ndarray(stored_shape, dtype)` to the shard (a new shard first if this one would grow
        past shard_size_bytes), its raw bytes from `raw`, or left as a hole to fill (raw None). Returns the
        raw bytes' segments."""
        if dtype not in STORABLE_DTYPES:
            raise CheckpointError(f"cannot store dtype {dtype}", tensor=name)
        if self._f is not None and self._count and self._f.tell() + nbytes > self.shard_size_bytes:
            self._close_shard()
        if self._f is None:
            self._open_shard()
        assert self._f is not None
        f = self._f
        itemsize = numpy_dtype(dtype).itemsize

        def data(start: int, n: int) -> None:
            if raw is None:
                f.seek(n, os.SEEK_CUR)
            else:
                f.write(raw[start: start + n])

        segments: list[tuple[int, int]] = []
        if nbytes <= self.max_chunk_bytes:
            prefix = _ndarray_prefix(stored_shape, dtype, nbytes)
            head = msgpack.packb(name) + ext32_header(len(prefix) + nbytes) + prefix
            self._pad_for(len(head))
            f.write(head)
            segments.append((f.tell(), nbytes))
            data(0, nbytes)
        else:
            # flax.serialization._chunk: a map with the flat array cut into chunks of max_chunk_bytes/itemsize
            size = nbytes // itemsize
            chunk_items = max(1, self.max_chunk_bytes // itemsize)
            starts = list(range(0, size, chunk_items))
            f.write(msgpack.packb(name))
            f.write(b"\x83" + msgpack.packb("__msgpack_chunked_array__") + msgpack.packb(True))
            f.write(msgpack.packb("shape") + msgpack.packb({str(i): s for i, s in enumerate(stored_shape)}))
            f.write(msgpack.packb("chunks") + map32_header(len(starts)))
            for i, start in enumerate(starts):
                n = min(chunk_items, size - start) * itemsize
                prefix = _ndarray_prefix((n // itemsize,), dtype, n)
                f.write(msgpack.packb(str(i)) + ext32_header(len(prefix) + n) + prefix)
                segments.append((f.tell(), n))
                data(start * itemsize, n)
        self._count += 1
        self.bytes_written += nbytes
        return tuple(segments)

    def add(self, name: str, array: np.ndarray, splits: Splits | None = None) -> None:
        """Append one tensor (cut into pieces along each of `splits` = ((dim, parts), ...), stored one after
        the other, if given); starts a new shard first if this one would grow past shard_size_bytes."""
        shape = tuple(int(s) for s in array.shape)
        cuts = self._normalize(name, shape, splits)
        arr = split_pieces(array, cuts) if cuts else np.ascontiguousarray(array)  # a C-order array
        # numpy's stubs declare the buffer protocol for Python >= 3.12 only
        raw = memoryview(cast("Buffer", arr.reshape(-1).view(np.uint8))) if arr.size else memoryview(b"")
        segments = self._write_value(name, arr.shape, arr.dtype.name, arr.nbytes, raw)
        self._entries[name] = TensorEntry(
            name=name, dtype=arr.dtype.name, shape=shape, file=self._fname, offset=segments[0][0],
            length=arr.nbytes, segments=segments, crc32=tuple(block_crcs(raw, self.block_bytes, self.checksum)),
            splits=cuts)

    def reserved_or_written(self, name: str) -> bool:
        return name in self._entries or name in self._reserved

    def reserve(self, name: str, shape: Sequence[int], dtype: str, splits: Splits | None = None) -> None:
        """Reserve a tensor of `shape` and `dtype` (stored split along `splits`) whose rows along the first
        dimension each `put` call fills; it enters the index once every row is in."""
        shape = tuple(int(s) for s in shape)
        if not shape or shape[0] < 1:
            raise CheckpointError(f"a reserved tensor needs a first dimension >= 1, got shape {list(shape)}",
                                  tensor=name)
        cuts = self._normalize(name, shape, splits)
        entry = TensorEntry(name=name, dtype=dtype, shape=shape, file="", offset=0, length=0, segments=(),
                            crc32=(), splits=cuts)
        nbytes = entry.stored_rows * entry.row_bytes
        stored = (entry.parts, *shape[:1], *entry.row_shape) if cuts else shape
        segments = self._write_value(name, stored, dtype, nbytes, None)
        self._reserved[name] = _Reserved(TensorEntry(
            name=name, dtype=dtype, shape=shape, file=self._fname, offset=segments[0][0], length=nbytes,
            segments=segments, crc32=(), splits=cuts))

    def put(self, name: str, index: int, array: np.ndarray) -> None:
        """Write row `index` (of the first dimension) of reserved tensor `name`."""
        r = self._reserved.get(name)
        if r is None:
            raise CheckpointError("put into a tensor that was not reserved (or is complete)", tensor=name)
        e = r.entry
        if array.dtype != numpy_dtype(e.dtype) or tuple(array.shape) != e.shape[1:]:
            raise CheckpointError(f"row {index}: {array.dtype.name} {list(array.shape)} does not match the reserved "
                                  f"{e.dtype} {list(e.shape[1:])}", tensor=name)
        if not 0 <= index < e.shape[0] or index in r.filled:
            raise CheckpointError(f"row {index} is out of range [0, {e.shape[0]}) or written twice", tensor=name)
        pieces = split_pieces(array[None], e.splits) if e.splits else array[None]  # [parts, 1, *row_shape]
        fd = self._put_fd(e.file)
        if self._f is not None and self._fname == e.file:
            self._f.flush()
        for t in range(e.parts):
            raw = memoryview(cast("Buffer", np.ascontiguousarray(pieces[t]).reshape(-1).view(np.uint8)))
            _pwrite_tensor_bytes(fd, e, (t * e.shape[0] + index) * e.row_bytes, raw)
        r.filled.add(index)
        if len(r.filled) == e.shape[0]:
            self._complete(name)

    def _put_fd(self, fname: str) -> int:
        if fname not in self._put_fds:
            self._put_fds[fname] = os.open(self.dst / fname, os.O_RDWR)
        return self._put_fds[fname]

    def _complete(self, name: str) -> None:
        """Every row of a reserved tensor is in: checksum its bytes (read back) and enter it in the index."""
        e = self._reserved.pop(name).entry
        fd = self._put_fd(e.file)
        crcs, check, bb = [], CHECKSUMS[self.checksum], self.block_bytes
        buf = bytearray(min(bb, max(e.length, 1)))
        for start in range(0, e.length, bb):
            view = memoryview(buf)[: min(bb, e.length - start)]
            pread_tensor_bytes(fd, e, start, view, self.dst)
            crcs.append(check(view))
        self._entries[name] = TensorEntry(name=e.name, dtype=e.dtype, shape=e.shape, file=e.file, offset=e.offset,
                                          length=e.length, segments=e.segments, crc32=tuple(crcs), splits=e.splits)
        if not any(r.entry.file == e.file for r in self._reserved.values()):
            os.fsync(fd)
            os.close(self._put_fds.pop(e.file))

    # -- finishing --
    def close(self, config: dict[str, Any] | str | Path | None = None,
              tokenizer_dir: str | Path | None = None, extra_files: dict[str, bytes] | None = None
              ) -> CheckpointIndex:
        """Close the last shard, write config.json (a dict, or a path to copy), copy tokenizer files found in
        `tokenizer_dir`, then write index.json atomically. Returns the index."""
        self._close_shard()
        if self._reserved:
            name, r = next(iter(self._reserved.items()))
            missing = [i for i in range(r.entry.shape[0]) if i not in r.filled]
            self.abort()
            raise CheckpointError(f"reserved tensor is incomplete: rows {missing[:8]} of {r.entry.shape[0]} were "
                                  f"never put{' (and other tensors)' if len(self._reserved) > 1 else ''}",
                                  str(self.dst), tensor=name)
        if isinstance(config, dict):
            (self.dst / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        elif config is not None:
            shutil.copyfile(config, self.dst / CONFIG_FILE)
        if tokenizer_dir is not None:
            copy_tokenizer_files(Path(tokenizer_dir), self.dst)
        for fname, data in (extra_files or {}).items():
            (self.dst / fname).write_bytes(data)
        version = MULTI_SPLIT_SINCE if any(len(e.splits) > 1 for e in self._entries.values()) else 3
        if self.quantization != "none":
            version = QUANTIZED_SINCE
        index = CheckpointIndex(tensors=dict(self._entries), files=dict(self._files), block_bytes=self.block_bytes,
                                total_bytes=sum(e.length for e in self._entries.values()), version=version,
                                checksum=self.checksum, quantization=self.quantization)
        tmp = self.dst / f".{INDEX_FILE}.tmp"
        with open(tmp, "w") as f:
            json.dump(index.to_json(), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dst / INDEX_FILE)
        return index

    def abort(self) -> None:
        """Close an open shard without writing an index (the directory stays an incomplete non-checkpoint)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        for fd in self._put_fds.values():
            os.close(fd)
        self._put_fds.clear()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif self._f is not None or not (self.dst / INDEX_FILE).exists():
            self.close()


def _pwrite_tensor_bytes(fd: int, e: TensorEntry, start: int, raw: memoryview) -> None:
    for off, at, take in tensor_spans(e, start, len(raw)):
        done = 0
        while done < take:
            done += os.pwrite(fd, raw[at + done: at + take], off + done)


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer (and generation config) files present in src_dir; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied
