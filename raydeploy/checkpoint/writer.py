"""Write a raydeploy checkpoint: stream (name, array) pairs into msgpack shards, then the index, last.

Each shard file is one msgpack map {name: value}. A value is exactly what `flax.serialization` writes for
an ndarray: msgpack ext type 1 holding msgpack (shape, dtype name, raw C-order bytes), so the raw bytes sit
contiguously in the file and the index records their offset. Arrays bigger than flax's chunk limit (1 GiB)
are written in flax's chunked-array form; their raw bytes then lie in several segments. The map's entry
count is patched into its header when the shard is closed, so tensors stream through without buffering.
Shard files and config/tokenizer files are written first; `index.json` is written last, atomically, so a
directory without an index is never mistaken for a checkpoint.

`add(name, array, split=(dim, parts))` stores the tensor cut into `parts` pieces along `dim`, one piece
after the other (format version 2; see format.TensorEntry): the msgpack value is then the stacked pieces
`[parts, ...]`, and the index records the logical shape and the split. `split_plan` (layout.py) chooses
the splits that make every device slice of a mesh one contiguous byte range.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
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
    PAD_KEY,
    STORABLE_DTYPES,
    TOKENIZER_FILES,
    CheckpointError,
    CheckpointIndex,
    TensorEntry,
    bin32_header,
    check_split,
    ext32_header,
    map32_header,
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


class CheckpointWriter:
    """Stream tensors into `dst` (created; must not already hold a checkpoint). Use as a context manager or
    call `close(config, tokenizer_dir)`; nothing counts as a checkpoint until the index is written."""

    def __init__(self, dst: str | Path, shard_size_bytes: int = 1 << 30, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 max_chunk_bytes: int = FLAX_MAX_CHUNK_BYTES, checksum: str = DEFAULT_CHECKSUM):
        self.dst = Path(dst)
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

    def add(self, name: str, array: np.ndarray, split: tuple[int, int] | None = None) -> None:
        """Append one tensor (cut into `split = (dim, parts)` pieces stored one after the other, if given);
        starts a new shard first if this one would grow past shard_size_bytes."""
        if name in self._entries:
            raise CheckpointError(f"tensor written twice: {name}", tensor=name)
        shape = tuple(int(s) for s in array.shape)
        if split is not None:
            why = check_split(split, shape)
            if why:
                raise CheckpointError(why, tensor=name)
            split = (int(split[0]), int(split[1]))
            arr = np.stack(np.split(np.asarray(array), split[1], axis=split[0]))  # a new C-order array
        else:
            arr = np.ascontiguousarray(array)
        dtype = arr.dtype.name
        if dtype not in STORABLE_DTYPES:
            raise CheckpointError(f"cannot store dtype {dtype}", tensor=name)
        if self._f is not None and self._count and self._f.tell() + arr.nbytes > self.shard_size_bytes:
            self._close_shard()
        if self._f is None:
            self._open_shard()
        assert self._f is not None
        f = self._f
        if name == PAD_KEY:
            raise CheckpointError(f"{PAD_KEY!r} is reserved for padding entries", tensor=name)
        # numpy's stubs declare the buffer protocol for Python >= 3.12 only
        raw = memoryview(cast("Buffer", arr.reshape(-1).view(np.uint8))) if arr.size else memoryview(b"")
        segments: list[tuple[int, int]] = []
        if arr.nbytes <= self.max_chunk_bytes:
            prefix = _ndarray_prefix(arr.shape, dtype, arr.nbytes)
            head = msgpack.packb(name) + ext32_header(len(prefix) + arr.nbytes) + prefix
            self._pad_for(len(head))
            f.write(head)
            segments.append((f.tell(), arr.nbytes))
            f.write(raw)
        else:
            # flax.serialization._chunk: a map with the flat array cut into chunks of max_chunk_bytes/itemsize
            chunk_items = max(1, self.max_chunk_bytes // arr.itemsize)
            starts = list(range(0, arr.size, chunk_items))
            f.write(msgpack.packb(name))
            f.write(b"\x83" + msgpack.packb("__msgpack_chunked_array__") + msgpack.packb(True))
            f.write(msgpack.packb("shape") + msgpack.packb({str(i): s for i, s in enumerate(arr.shape)}))
            f.write(msgpack.packb("chunks") + map32_header(len(starts)))
            for i, start in enumerate(starts):
                n = min(chunk_items, arr.size - start) * arr.itemsize
                prefix = _ndarray_prefix((n // arr.itemsize,), dtype, n)
                f.write(msgpack.packb(str(i)) + ext32_header(len(prefix) + n) + prefix)
                segments.append((f.tell(), n))
                f.write(raw[start * arr.itemsize: start * arr.itemsize + n])
        self._count += 1
        self.bytes_written += arr.nbytes
        self._entries[name] = TensorEntry(
            name=name, dtype=dtype, shape=shape, file=self._fname, offset=segments[0][0], length=arr.nbytes,
            segments=tuple(segments), crc32=tuple(block_crcs(raw, self.block_bytes, self.checksum)), split=split)

    # -- finishing --
    def close(self, config: dict[str, Any] | str | Path | None = None,
              tokenizer_dir: str | Path | None = None, extra_files: dict[str, bytes] | None = None
              ) -> CheckpointIndex:
        """Close the last shard, write config.json (a dict, or a path to copy), copy tokenizer files found in
        `tokenizer_dir`, then write index.json atomically. Returns the index."""
        self._close_shard()
        if isinstance(config, dict):
            (self.dst / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        elif config is not None:
            shutil.copyfile(config, self.dst / CONFIG_FILE)
        if tokenizer_dir is not None:
            copy_tokenizer_files(Path(tokenizer_dir), self.dst)
        for fname, data in (extra_files or {}).items():
            (self.dst / fname).write_bytes(data)
        index = CheckpointIndex(tensors=dict(self._entries), files=dict(self._files), block_bytes=self.block_bytes,
                                total_bytes=sum(e.length for e in self._entries.values()), checksum=self.checksum)
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

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif self._f is not None or not (self.dst / INDEX_FILE).exists():
            self.close()


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer (and generation config) files present in src_dir; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied
