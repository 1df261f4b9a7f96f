"""Load a raydeploy checkpoint into sharded jax.Arrays, reading only the bytes this process needs.

`CheckpointReader(path)` validates the index and the shard files up front. `load(specs, mesh, rules)`:
  1. checks the checkpoint against the model's `param_specs` (missing/extra tensors, shapes, dtypes) and
     every sharding before reading a byte, so a bad checkpoint never yields a half-loaded model;
  2. for each tensor, asks the NamedSharding which slices this process's devices hold, merges their dim-0
     row ranges (rows are contiguous byte ranges; other dims are sliced in memory) so each needed byte is
     read once even when several local devices replicate it;
  3. reads those ranges, widened to whole checksum blocks, with `os.preadv` from a thread pool in pieces,
     verifies each block's crc32 (an error names the file and tensor), and places each device's slice with
     `jax.make_array_from_single_device_arrays`. Only local devices are touched, so every host of a
     multi-process mesh runs the same call and reads its own part.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raydeploy.checkpoint.format import (
    CONFIG_FILE,
    FLOAT_DTYPES,
    INDEX_FILE,
    CheckpointError,
    CheckpointIndex,
    TensorEntry,
    aligned_empty,
    crc32,
    numpy_dtype,
    read_index,
)
from raydeploy.model.spec import LlamaConfig, TensorSpec

if TYPE_CHECKING:
    import jax

PIECE_BYTES = 16 << 20  # read granularity for the thread pool (rounded to checksum blocks)
PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True)
class LoadStats:
    """What one `load` did: bytes read from disk (this process), wall seconds, GB/s, tensors, files."""

    bytes_read: int
    seconds: float
    gbps: float
    tensors: int
    files: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _TensorPlan:
    entry: TensorEntry
    sharding: Any
    device_slices: dict[Any, tuple[slice, ...]]   # device -> its index into the global array
    intervals: list[tuple[int, int]]               # merged dim-0 row ranges this process needs
    buffers: list[np.ndarray]                      # one uint8 buffer per interval (block-widened)
    buf_starts: list[int]                          # tensor byte offset where each buffer starts
    pending: int = 0
    mapped: bool = False


def merge_intervals(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _norm_slice(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1:
        raise ValueError(f"unexpected strided shard index {s}")
    return start, stop


class CheckpointReader:
    """A validated checkpoint directory (see module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError("checkpoint directory does not exist", str(self.path))
        self.index: CheckpointIndex = read_index(self.path)
        cfg_path = self.path / CONFIG_FILE
        if not cfg_path.is_file():
            raise CheckpointError(f"{CONFIG_FILE} is missing (the model's Hugging Face config travels with "
                                  "the checkpoint)", str(self.path))
        try:
            self.llama_config: LlamaConfig = LlamaConfig.from_json(cfg_path)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"config is not a usable Llama-family config: {e!r}", str(cfg_path)) from e

    def fingerprint(self) -> str:
        """sha256 over the index and config.json: equal on every host that sees the same checkpoint."""
        h = hashlib.sha256()
        h.update(json.dumps(self.index.to_json(), sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\0")
        h.update((self.path / CONFIG_FILE).read_bytes())
        return h.hexdigest()

    # ---- validation ----
    def check_specs(self, specs: Mapping[str, TensorSpec]) -> None:
        """The checkpoint holds exactly these tensors with these shapes and a float dtype."""
        idx_path = str(self.path / INDEX_FILE)
        missing = [n for n in specs if n not in self.index.tensors]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(f"checkpoint lacks tensor(s) the model needs: {', '.join(missing[:3])}{more}",
                                  idx_path, tensor=missing[0])
        extra = [n for n in self.index.tensors if n not in specs]
        if extra:
            raise CheckpointError(f"checkpoint has tensor(s) the model does not use: {', '.join(extra[:3])} "
                                  "(does config.json match the weights?)", idx_path, tensor=extra[0])
        for name, spec in specs.items():
            e = self.index.tensors[name]
            if tuple(e.shape) != tuple(spec.shape):
                raise CheckpointError(f"shape {list(e.shape)} in the checkpoint, the model expects "
                                      f"{list(spec.shape)}", idx_path, tensor=name)
            if e.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"dtype {e.dtype} is not a float type; parameters must be one of "
                                      f"{', '.join(sorted(FLOAT_DTYPES))}", idx_path, tensor=name)

    # ---- planning ----
    def _plan(self, specs: Mapping[str, TensorSpec], mesh: jax.sharding.Mesh, rules: Mapping[str, Any],
              devices: Any = None) -> dict[str, _TensorPlan]:
        """Validate everything, then per tensor: its sharding, the slices `devices` (default: this process's
        devices in the mesh) hold, and the merged dim-0 row ranges to read."""
        from jax.sharding import NamedSharding

        from raydeploy.model.sharding import check_divisible, partition_spec

        self.check_specs(specs)
        mesh_shape = dict(mesh.shape)
        plans: dict[str, _TensorPlan] = {}
        for name, spec in specs.items():
            check_divisible(spec, rules, mesh_shape)
            sharding = NamedSharding(mesh, partition_spec(spec.logical_axes, rules, mesh_shape, name))
            if devices is None:
                dev_idx = dict(sharding.addressable_devices_indices_map(tuple(spec.shape)))
            else:
                wanted = set(devices)
                dev_idx = {d: i for d, i in sharding.devices_indices_map(tuple(spec.shape)).items() if d in wanted}
            e = self.index.tensors[name]
            rows = e.shape[0] if e.shape else 1
            ranges = [_norm_slice(idx[0], rows) if e.shape else (0, 1) for idx in dev_idx.values()]
            plans[name] = _TensorPlan(entry=e, sharding=sharding, device_slices=dev_idx,
                                      intervals=merge_intervals(ranges), buffers=[], buf_starts=[])
        return plans

    def byte_ranges(self, specs: Mapping[str, TensorSpec], mesh: jax.sharding.Mesh, rules: Mapping[str, Any],
                    devices: Any = None) -> dict[str, list[tuple[int, int]]]:
        """Per tensor, the [start, stop) byte ranges (of its raw bytes, widened to checksum blocks) that a
        process holding `devices` (default: this process's) reads in `load`."""
        bb = self.index.block_bytes
        out: dict[str, list[tuple[int, int]]] = {}
        for name, p in self._plan(specs, mesh, rules, devices).items():
            rb, n = p.entry.row_bytes, p.entry.length
            out[name] = [((a * rb // bb) * bb, min(-(-(b * rb) // bb) * bb, n)) for a, b in p.intervals]
        return out

    # ---- loading ----
    def load(self, specs: Mapping[str, TensorSpec], mesh: jax.sharding.Mesh, rules: Mapping[str, Any],
             dtype: str = "float32", threads: int = 8, progress: bool = True, verify: bool = True,
             use_mmap: bool = True) -> tuple[dict[str, jax.Array], LoadStats]:
        """Read this process's part of every tensor in `specs` and return sharded arrays (see module doc).

        With `use_mmap` (default) the needed byte ranges are mapped copy-on-write and touched (checksummed)
        in the thread pool: no copy through a read buffer, and on CPU the arrays alias the page cache when
        no dtype cast or column slice is needed. Without it (or for tensors stored in several segments)
        the ranges are `os.preadv`-ed into aligned buffers."""
        import jax
        from tqdm import tqdm

        t0 = time.perf_counter()
        target = numpy_dtype(dtype)
        plans = self._plan(specs, mesh, rules)
        # pieces: (plan, buffer number, byte start within tensor, byte end) aligned to checksum blocks
        bb = self.index.block_bytes
        piece = max(bb, (PIECE_BYTES // bb) * bb)
        pieces: list[tuple[_TensorPlan, int, int, int]] = []
        fds: dict[str, int] = {}
        try:
            for fname in sorted({p.entry.file for p in plans.values()}):
                fds[fname] = os.open(self.path / fname, os.O_RDONLY)
            maps: dict[str, mmap.mmap] = {}
            for p in plans.values():
                e = p.entry
                p.mapped = use_mmap and len(e.segments) == 1 and e.length > 0
                if p.mapped and e.file not in maps:
                    maps[e.file] = mmap.mmap(fds[e.file], 0, access=mmap.ACCESS_COPY)
                for a, b in p.intervals:
                    start = (a * e.row_bytes // bb) * bb
                    stop = min(-(-(b * e.row_bytes) // bb) * bb, e.length)
                    if p.mapped:
                        p.buffers.append(np.frombuffer(maps[e.file], np.uint8, stop - start, e.offset + start))
                    else:
                        p.buffers.append(aligned_empty(stop - start))
                    p.buf_starts.append(start)
                    for s in range(start, stop, piece):
                        pieces.append((p, len(p.buffers) - 1, s, min(s + piece, stop)))
                        p.pending += 1
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        total_read = sum(e - s for _, _, s, e in pieces)

        out: dict[str, jax.Array] = {}
        lock = threading.Lock()
        bar = tqdm(total=total_read, unit="B", unit_scale=True, desc="load checkpoint", disable=not progress)

        def finish(p: _TensorPlan) -> None:
            e = p.entry
            src = numpy_dtype(e.dtype)
            arrays = []
            per_range: dict[tuple[int, int], Any] = {}
            for dev, idx in p.device_slices.items():
                r0, r1 = _norm_slice(idx[0], e.shape[0]) if e.shape else (0, 1)
                key = (r0, r1, *(_norm_slice(s, n) for s, n in zip(idx[1:], e.shape[1:], strict=True)))
                host = per_range.get(key)
                if host is None:
                    k = next(i for i, (a, b) in enumerate(p.intervals) if a <= r0 and r1 <= b)
                    base = r0 * e.row_bytes - p.buf_starts[k]
                    flat = p.buffers[k][base: base + (r1 - r0) * e.row_bytes].view(src)
                    host = flat.reshape((r1 - r0, *e.shape[1:])) if e.shape else flat.reshape(())
                    if e.shape and len(idx) > 1:
                        host = host[(slice(None), *idx[1:])]
                    host = np.ascontiguousarray(host, dtype=target) if host.dtype != target else host
                    per_range[key] = host
                arrays.append(jax.device_put(host, dev))
            out[e.name] = jax.make_array_from_single_device_arrays(e.shape, p.sharding, arrays)
            p.buffers.clear()

        def read_piece(p: _TensorPlan, k: int, s: int, e_: int) -> None:
            entry = p.entry
            view = memoryview(p.buffers[k])[s - p.buf_starts[k]: e_ - p.buf_starts[k]]
            if not p.mapped:
                _pread_tensor_bytes(fds[entry.file], entry, s, view, self.path)
            elif not verify:  # fault the mapped pages in now, so the load really reads them
                int(p.buffers[k][s - p.buf_starts[k]: e_ - p.buf_starts[k]: PAGE_BYTES].max(initial=0))
            if verify:
                for blk in range(s // bb, -(-e_ // bb)):
                    b0 = blk * bb - s
                    got = crc32(view[b0: b0 + bb])
                    if got != entry.crc32[blk]:
                        raise CheckpointError(
                            f"checksum mismatch in block {blk} (tensor bytes [{blk * bb}, "
                            f"{min((blk + 1) * bb, entry.length)})): the file is corrupt",
                            str(self.path / entry.file), tensor=entry.name)
            bar.update(e_ - s)
            with lock:
                p.pending -= 1
                done = p.pending == 0
            if done:
                finish(p)

        try:
            for p in plans.values():
                if p.pending == 0:
                    finish(p)
            with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="ckpt-read") as pool:
                futures = [pool.submit(read_piece, *pc) for pc in pieces]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
        finally:
            bar.close()
            for fd in fds.values():
                os.close(fd)
        missing = [n for n in specs if n not in out]
        if missing:  # cannot happen unless a worker died silently; never hand out a partial model
            raise CheckpointError(f"internal: {len(missing)} tensors were not loaded", str(self.path), missing[0])
        seconds = time.perf_counter() - t0
        stats = LoadStats(bytes_read=total_read, seconds=seconds, gbps=total_read / seconds / 1e9 if seconds else 0.0,
                          tensors=len(out), files=len(fds))
        return {n: out[n] for n in specs}, stats

    def read_tensor(self, name: str, verify: bool = True) -> np.ndarray:
        """One whole tensor as numpy (for tools and tests; serving uses `load`)."""
        if name not in self.index.tensors:
            raise CheckpointError("no such tensor in the checkpoint", str(self.path / INDEX_FILE), tensor=name)
        e = self.index.tensors[name]
        buf = aligned_empty(e.length)
        fd = os.open(self.path / e.file, os.O_RDONLY)
        try:
            _pread_tensor_bytes(fd, e, 0, memoryview(buf), self.path)
        finally:
            os.close(fd)
        if verify:
            bb = self.index.block_bytes
            for blk, want in enumerate(e.crc32):
                if crc32(buf[blk * bb:(blk + 1) * bb]) != want:
                    raise CheckpointError(f"checksum mismatch in block {blk}: the file is corrupt",
                                          str(self.path / e.file), tensor=name)
        return buf.view(numpy_dtype(e.dtype)).reshape(e.shape)


def _pread_tensor_bytes(fd: int, e: TensorEntry, start: int, out: memoryview, ckpt: Path) -> None:
    """Fill `out` with the tensor's raw bytes [start, start+len(out)), following its file segments."""
    pos, done = 0, 0  # pos: tensor byte offset where the current segment begins
    need = len(out)
    for off, n in e.segments:
        if done >= need:
            break
        lo = max(start + done, pos)
        if lo < pos + n:
            take = min(pos + n - lo, need - done)
            _pread_exact(fd, out[done: done + take], off + (lo - pos), ckpt / e.file, e.name)
            done += take
        pos += n
    if done != need:
        raise CheckpointError(f"could read only {done} of {need} bytes", str(ckpt / e.file), tensor=e.name)


def _pread_exact(fd: int, out: memoryview, offset: int, path: Path, tensor: str) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            raise CheckpointError(f"unexpected end of file at byte {offset + got}", str(path), tensor=tensor)
        got += n
