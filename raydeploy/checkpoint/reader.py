"""Load a raydeploy checkpoint into sharded jax.Arrays, reading only the bytes this process needs.

`CheckpointReader(path)` validates the index and the shard files up front. `load(specs, mesh, rules)`:
  1. checks the checkpoint against the model's `param_specs` (missing/extra tensors, shapes, dtypes) and
     every sharding before reading a byte, so a bad checkpoint never yields a half-loaded model;
  2. for each tensor, asks the NamedSharding which slices this process's devices hold, merges their
     stored-row ranges (rows are contiguous byte ranges; other dims are sliced in memory) so each needed
     byte is read once even when several local devices replicate it. A tensor stored split along a column
     dimension (format version 2) has `parts` pieces of rows: a device slice that is one piece along that
     dimension is a run of whole rows of that piece, so it is read (and placed) like a row slice;
  3. maps those ranges copy-on-write, widened to whole checksum blocks (with `use_mmap=False`, and for
     tensors stored in several segments, `os.preadv`s them into 64-byte aligned buffers block by block), and
     walks them one block at a time on a small thread pool: verifies the block's checksum (an error names the
     file and tensor) and, while the block is still in cache, copies the rows it completes into the device
     slices that need a copy (a column slice of an unsplit tensor, a slice spanning several pieces, a dtype
     cast). A slice that needs none is a view of the mapped bytes, which jax on CPU aliases (64-byte
     aligned), so a float32 checkpoint loaded as float32 onto row-sharded or replicated devices, or onto a
     mesh whose column shards match the checkpoint's splits, is verified in one pass over memory and copied
     nowhere (a copy lands in freshly faulted memory: the kernel zeroes each page first, which costs about
     as much as the copy itself);
  4. hands finished tensors to `jax.make_array_from_callback` in batches. Only local devices are touched,
     so every host of a multi-process mesh runs the same call and reads its own part.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from raydeploy.checkpoint.format import (
    CHECKSUMS,
    CONFIG_FILE,
    FLOAT_DTYPES,
    INDEX_FILE,
    CheckpointError,
    CheckpointIndex,
    TensorEntry,
    aligned_empty,
    join_pieces,
    numpy_dtype,
    pread_tensor_bytes,
    read_index,
)
from raydeploy.compat import batched_device_put
from raydeploy.model.registry import from_hf_config
from raydeploy.model.sharding import check_divisible, partition_spec
from raydeploy.model.spec import TensorSpec, split_layer_name

if TYPE_CHECKING:
    import jax
    from typing_extensions import Buffer

PIECE_BYTES = 16 << 20  # work unit of the thread pool for zero-copy tensors (rounded to checksum blocks)
FINISH_BATCH = 32  # tensors handed to jax together: back to back the jax calls stay cache-hot (~2x faster)
ALIGN = 64  # jax on CPU aliases a numpy array (no copy) when its data is 64-byte aligned
PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True)
class LoadStats:
    """What one `load` did: bytes read from disk (this process), wall seconds, GB/s, tensors, files, and the
    CPU seconds this process spent meanwhile (all its threads: on a machine shared with other work the wall
    time swings, the CPU time much less)."""

    bytes_read: int
    seconds: float
    gbps: float
    tensors: int
    files: int
    cpu_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SliceKey = tuple[tuple[int, int], ...]  # a device's index into a tensor: (start, stop) per dim


@dataclass(frozen=True)
class _Part:
    """The piece of a device slice that lies in one stored piece of its tensor: stored rows [r0, r1), the
    ranges of the other stored dims to take (`src`), and where they go in the device's array (`dst`)."""

    r0: int
    r1: int
    src: tuple[tuple[int, int], ...]
    dst: tuple[slice, ...]

    def whole_rows(self, e: TensorEntry) -> bool:
        return self.src == tuple((0, n) for n in e.row_shape)


def _parts(e: TensorEntry, key: SliceKey) -> list[_Part]:
    """Where a device slice (logical (start, stop) per dim) lies in the stored rows of its tensor: one part
    per stored piece it overlaps (the pieces of the split dims' grid, in stored order)."""
    (r0, r1), cols = key[0], key[1:]
    # per split dim: the pieces the slice overlaps, as (piece index, (src lo, hi) in the piece, dst slice)
    per_dim: list[list[tuple[int, tuple[int, int], slice]]] = []
    for dim, n in e.splits:
        width, (a, b) = e.shape[dim] // n, cols[dim - 1]
        per_dim.append([(t, (max(a, t * width) - t * width, min(b, (t + 1) * width) - t * width),
                         slice(max(a, t * width) - a, min(b, (t + 1) * width) - a))
                        for t in range(a // width, -(-b // width))])
    out = []
    for combo in itertools.product(*per_dim):
        src, dst, piece = list(cols), [slice(None)] * len(cols), 0
        for (dim, n), (t, rng, sl) in zip(e.splits, combo, strict=True):
            src[dim - 1], dst[dim - 1], piece = rng, sl, piece * n + t
        out.append(_Part(piece * e.shape[0] + r0, piece * e.shape[0] + r1, tuple(src), tuple(dst)))
    return out


@dataclass
class _TensorPlan:
    entry: TensorEntry
    sharding: Any
    keys: dict[Any, SliceKey]                      # device -> its slice of the global array
    parts: dict[SliceKey, list[_Part]]             # per distinct slice: where it lies in the stored rows
    intervals: list[tuple[int, int]]               # merged stored-row ranges this process needs
    group: Any = None                              # (shape, axes, split): tensors that share all of the above
    dtype: str | None = None                       # the spec's own dtype (quantized tensors), else the load's
    template: _Template | None = None              # set by _Load: the layout shared by the group
    buffers: list[np.ndarray] = field(default_factory=list)  # per interval: its bytes (block-widened)
    buf_starts: list[int] = field(default_factory=list)      # tensor byte offset where each buffer starts
    hosts: dict[SliceKey, np.ndarray] = field(default_factory=dict)  # per distinct slice: what jax gets
    fills: list[tuple[int, _Part, np.ndarray]] = field(default_factory=list)  # (interval, part, copy into)
    pending: int = 0
    mapped: bool = False


@dataclass(frozen=True)
class _Template:
    """How every tensor of one plan group is read and placed, worked out once per group: the layers repeat a
    handful of groups, and per tensor only the file offsets differ. Byte positions are relative to the tensor's
    raw bytes (`spans`, `pieces`) or to the interval's buffer (`views`)."""

    spans: tuple[tuple[int, int], ...]                    # per interval: the tensor bytes read (block-widened)
    views: tuple[tuple[SliceKey, int, int, int, tuple[int, ...]], ...]  # (slice, interval, offset, bytes, shape): aliased
    fills: tuple[tuple[SliceKey, tuple[tuple[int, _Part], ...], tuple[int, ...]], ...]  # (slice, its parts, shape): copied
    pieces: tuple[tuple[int, int, int], ...]              # (interval, start, stop): the work units
    devices: list[Any]                                    # local devices, in the order jax gets their arrays
    device_keys: tuple[SliceKey, ...]                     # each device's slice
    aval: Any                                             # jax's abstract value of the global array (or None)


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


def _block_span(e: TensorEntry, a: int, b: int, bb: int) -> tuple[int, int]:
    """Tensor byte range [start, stop) of stored rows [a, b), widened to whole checksum blocks of `bb` bytes."""
    return (a * e.row_bytes // bb) * bb, min(-(-(b * e.row_bytes) // bb) * bb, e.length)


def _slice_key(idx: tuple[slice, ...] | None, shape: tuple[int, ...]) -> SliceKey:
    """A device's index into a tensor as (start, stop) per dim; a scalar is treated as one row."""
    if not shape:
        return ((0, 1),)
    if idx is None:  # jax types a device's index as optional; a NamedSharding always gives one
        raise TypeError(f"no shard index for a tensor of shape {shape}")
    return tuple(_norm_slice(s, n) for s, n in zip(idx, shape, strict=True))


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
            # The raw Hugging Face config: the model registry (raydeploy.model.registry) picks the family
            # from its model_type; the reader itself knows no model.
            self.hf_config: dict[str, Any] = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"config is not valid JSON: {e}", str(cfg_path)) from e

    def fingerprint(self) -> str:
        """sha256 over the index and config.json: equal on every host that sees the same checkpoint."""
        h = hashlib.sha256()
        h.update(json.dumps(self.index.to_json(), sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\0")
        h.update((self.path / CONFIG_FILE).read_bytes())
        return h.hexdigest()

    def param_specs(self) -> dict[str, TensorSpec]:
        """The specs of the model this checkpoint holds (its config.json's family), in the checkpoint's layout:
        stacked over the layers, or per layer (`Family.checkpoint_specs`)."""
        family, cfg = from_hf_config(self.hf_config, source=str(self.path / CONFIG_FILE))
        return family.checkpoint_specs(cfg, self.index.tensors)

    # ---- validation ----
    @property
    def quantization(self) -> str:
        """How the checkpoint's projection kernels are stored: int8 / fp8 (format version 5), or none."""
        return self.index.quantization

    def check_specs(self, specs: Mapping[str, TensorSpec], subset: bool = False) -> None:
        """The checkpoint holds exactly these tensors (with `subset`: at least these) with these shapes, each in
        the spec's own dtype where it has one (a quantized kernel, its scale), else a float dtype. A quantized
        kernel's scale must have the shape its kernel implies (`raydeploy.model.quant.scale_spec`)."""
        idx_path = str(self.path / INDEX_FILE)
        missing = [n for n in specs if n not in self.index.tensors]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(f"checkpoint lacks tensor(s) the model needs: {', '.join(missing[:3])}{more}",
                                  idx_path, tensor=missing[0])
        extra = [] if subset else [n for n in self.index.tensors if n not in specs]
        if extra:
            raise CheckpointError(f"checkpoint has tensor(s) the model does not use: {', '.join(extra[:3])} "
                                  "(does config.json match the weights?)", idx_path, tensor=extra[0])
        for name, spec in specs.items():
            e = self.index.tensors[name]
            if tuple(e.shape) != tuple(spec.shape):
                what = "a quantized kernel's scale: " if name.endswith(".kernel_scale") else ""
                raise CheckpointError(f"{what}shape {list(e.shape)} in the checkpoint, the model expects "
                                      f"{list(spec.shape)}", idx_path, tensor=name)
            if spec.dtype is not None and spec.dtype not in FLOAT_DTYPES:
                if e.dtype != spec.dtype:
                    raise CheckpointError(f"dtype {e.dtype} in the checkpoint, the model holds this tensor as "
                                          f"{spec.dtype}", idx_path, tensor=name)
            elif e.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"dtype {e.dtype} is not a float type; parameters must be one of "
                                      f"{', '.join(sorted(FLOAT_DTYPES))}", idx_path, tensor=name)

    # ---- planning ----
    def _plan(self, specs: Mapping[str, TensorSpec], mesh: jax.sharding.Mesh, rules: Mapping[str, Any],
              devices: Any = None, subset: bool = False) -> dict[str, _TensorPlan]:
        """Validate everything, then per tensor: its sharding, the slices `devices` (default: this process's
        devices in the mesh) hold, and the merged stored-row ranges to read."""
        from jax.sharding import NamedSharding

        self.check_specs(specs, subset)
        mesh_shape = dict(mesh.shape)
        wanted = None if devices is None else set(devices)
        plans: dict[str, _TensorPlan] = {}
        # Layers repeat a handful of (shape, axes, split) combinations: plan each once (the jax sharding
        # calls cost ~0.1 ms a tensor, as much as reading a small tensor)
        cache: dict[Any, tuple[Any, dict[Any, SliceKey], dict[SliceKey, list[_Part]], list[tuple[int, int]]]] = {}
        for name, spec in specs.items():
            e = self.index.tensors[name]
            ck = (tuple(spec.shape), tuple(spec.logical_axes), e.splits)
            if ck not in cache:
                check_divisible(spec, rules, mesh_shape)
                sharding = NamedSharding(mesh, partition_spec(spec.logical_axes, rules, mesh_shape, name))
                if wanted is None:
                    dev_idx = dict(sharding.addressable_devices_indices_map(tuple(spec.shape)))
                else:
                    dev_idx = {d: i for d, i in sharding.devices_indices_map(tuple(spec.shape)).items()
                               if d in wanted}
                keys = {d: _slice_key(idx, e.shape) for d, idx in dev_idx.items()}
                parts = {k: _parts(e, k) for k in dict.fromkeys(keys.values())}
                cache[ck] = (sharding, keys, parts, merge_intervals([(q.r0, q.r1) for ps in parts.values() for q in ps]))
            sharding, keys, parts, intervals = cache[ck]
            plans[name] = _TensorPlan(entry=e, sharding=sharding, keys=keys, parts=parts, intervals=list(intervals),
                                      group=ck, dtype=spec.dtype)
        return plans

    def byte_ranges(self, specs: Mapping[str, TensorSpec], mesh: jax.sharding.Mesh, rules: Mapping[str, Any],
                    devices: Any = None) -> dict[str, list[tuple[int, int]]]:
        """Per tensor, the [start, stop) byte ranges (of its raw bytes, widened to checksum blocks) that a
        process holding `devices` (default: this process's) reads in `load`."""
        bb = self.index.block_bytes
        return {name: [_block_span(p.entry, a, b, bb) for a, b in p.intervals]
                for name, p in self._plan(specs, mesh, rules, devices).items()}

    # ---- loading ----
    def load(self, specs: Mapping[str, TensorSpec], mesh: jax.sharding.Mesh, rules: Mapping[str, Any],
             dtype: str = "float32", threads: int = 8, progress: bool = True, verify: bool = True,
             use_mmap: bool = True, subset: bool = False) -> tuple[dict[str, jax.Array], LoadStats]:
        """Read this process's part of every tensor in `specs` and return sharded arrays (see module doc).

        With `use_mmap` (default) the needed byte ranges are mapped copy-on-write and touched (checksummed)
        in place: no copy through a read buffer, and on CPU the arrays alias the page cache when no dtype
        cast or column slice is needed. Without it (or for tensors stored in several segments) the ranges
        are `os.preadv`-ed into aligned buffers one checksum block at a time, each block verified while it
        is still in cache. `threads` is capped at the CPU count (crc32 and crc32c release the GIL, so threads verify
        blocks in parallel where cores are free); with 1 the calling thread reads, with no pool.

        Each tensor is cast to `dtype` unless its spec has its own (`TensorSpec.dtype`: a quantized kernel and its
        scale keep theirs). `subset`: `specs` name only some of the checkpoint's tensors (a load in parts)."""
        from tqdm import tqdm

        t0, c0 = time.perf_counter(), time.process_time()
        with _gc_paused(), _Load(self, self._plan(specs, mesh, rules, subset=subset), numpy_dtype(dtype), verify, use_mmap) as run:
            bar = tqdm(total=run.total_bytes, unit="B", unit_scale=True, desc="load checkpoint",
                       disable=not progress)
            try:
                run.read_all(max(1, min(threads, _cpu_count())), bar.update)
            finally:
                bar.close()
        missing = [n for n in specs if n not in run.out]
        if missing:  # cannot happen unless a worker died silently; never hand out a partial model
            raise CheckpointError(f"internal: {len(missing)} tensors were not loaded", str(self.path), missing[0])
        seconds = time.perf_counter() - t0
        stats = LoadStats(bytes_read=run.total_bytes, seconds=seconds,
                          gbps=run.total_bytes / seconds / 1e9 if seconds else 0.0, tensors=len(run.out),
                          files=len(run.fds), cpu_seconds=time.process_time() - c0)
        return {n: run.out[n] for n in specs}, stats

    def read_tensor(self, name: str, verify: bool = True) -> np.ndarray:
        """One whole tensor as numpy (for tools and tests; serving uses `load`). A per-layer name
        (`layers.3.x`) of a checkpoint stored stacked over the layers is row 3 of its `layers.x`."""
        layer = split_layer_name(name) if name not in self.index.tensors else None
        if layer is not None and f"layers.{layer[1]}" in self.index.tensors:
            stacked = self.read_tensor(f"layers.{layer[1]}", verify)
            if layer[0] < stacked.shape[0]:
                return stacked[layer[0]].copy()
        if name not in self.index.tensors:
            raise CheckpointError("no such tensor in the checkpoint", str(self.path / INDEX_FILE), tensor=name)
        e = self.index.tensors[name]
        buf = aligned_empty(e.length)
        fd = os.open(self.path / e.file, os.O_RDONLY)
        try:
            # numpy's stubs declare the buffer protocol for Python >= 3.12 only
            pread_tensor_bytes(fd, e, 0, memoryview(cast("Buffer", buf)), self.path)
        finally:
            os.close(fd)
        if verify:
            bb, check = self.index.block_bytes, CHECKSUMS[self.index.checksum]
            for blk, want in enumerate(e.crc32):
                if check(buf[blk * bb:(blk + 1) * bb]) != want:
                    raise CheckpointError(f"checksum mismatch in block {blk}: the file is corrupt",
                                          str(self.path / e.file), tensor=name)
        x = buf.view(numpy_dtype(e.dtype))
        if e.splits:
            return join_pieces(x.reshape((e.parts, e.shape[0], *e.row_shape)), e.splits)
        return x.reshape(e.shape)


class _Load:
    """One `CheckpointReader.load` call: the open shard files, the work pieces, and the arrays made so far.

    A piece is a run of whole checksum blocks of one tensor interval. Tensors that need a copy (a column
    slice, a dtype cast, an unaligned slice) get one piece per interval, so each block's completed rows are
    copied right after its checksum, while the block is still in cache; the others are split in PIECE_BYTES
    pieces and placed zero-copy."""

    def __init__(self, reader: CheckpointReader, plans: dict[str, _TensorPlan], target: np.dtype,
                 verify: bool, use_mmap: bool):
        self.path, self.bb = reader.path, reader.index.block_bytes
        self.check = CHECKSUMS[reader.index.checksum]  # the index's block checksum (crc32 or crc32c)
        self.plans, self.target, self.verify, self.use_mmap = plans, target, verify, use_mmap
        self.fds: dict[str, int] = {}
        self.maps: dict[str, mmap.mmap] = {}
        self.pieces: list[tuple[_TensorPlan, int, int, int]] = []  # (plan, interval, byte start, byte stop)
        self.out: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.ready: list[_TensorPlan] = []  # tensors read in full, not yet handed to jax
        self.failed = False
        self.templates: dict[Any, _Template] = {}
        self.put = batched_device_put() if target.itemsize < 8 else None

    def __enter__(self) -> _Load:
        try:
            for fname in sorted({p.entry.file for p in self.plans.values()}):
                self.fds[fname] = os.open(self.path / fname, os.O_RDONLY)
            for p in self.plans.values():
                self._prepare(p)
        except BaseException:
            self.__exit__()
            raise
        self.total_bytes = sum(stop - start for _, _, start, stop in self.pieces)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def _prepare(self, p: _TensorPlan) -> None:
        """Map or allocate the plan's byte ranges, make its host arrays (views of those bytes, or arrays to
        copy into) after its group's template, and queue its pieces."""
        e = p.entry
        p.mapped = self.use_mmap and len(e.segments) == 1 and e.length > 0
        if p.mapped and e.file not in self.maps:
            self.maps[e.file] = mmap.mmap(self.fds[e.file], 0, access=mmap.ACCESS_COPY)
        # alignment of a view depends on where the tensor starts in its file (mapped) or not at all (a buffer
        # starts aligned): tensors of a group whose offsets agree modulo ALIGN share a template
        tk = (p.group, e.dtype, p.dtype, p.mapped, e.offset % ALIGN if p.mapped else 0)
        t = self.templates.get(tk)
        if t is None:
            t = self.templates[tk] = self._template(p)
        p.template = t
        if p.mapped:
            m = self.maps[e.file]
            p.buffers = [np.frombuffer(m, np.uint8, stop - start, e.offset + start) for start, stop in t.spans]
        else:
            p.buffers = [aligned_empty(stop - start) for start, stop in t.spans]
        p.buf_starts = [start for start, _ in t.spans]
        stored = numpy_dtype(e.dtype)
        for key, k, off, nbytes, shape in t.views:
            p.hosts[key] = p.buffers[k][off: off + nbytes].view(stored).reshape(shape)
        target = self._target(p)
        for key, members, shape in t.fills:
            host = aligned_empty(math.prod(shape) * target.itemsize).view(target).reshape(shape)
            p.fills.extend((k, q, host) for k, q in members)
            p.hosts[key] = host if e.shape else host.reshape(())
        self.pieces.extend((p, k, s, stop) for k, s, stop in t.pieces)
        p.pending = len(t.pieces)

    def _template(self, p: _TensorPlan) -> _Template:
        """The template of p's group (see _Template): per distinct device slice, a view of the interval's bytes
        when jax can alias it (one stored piece, whole rows, same dtype, 64-byte aligned), else an aligned
        array that `_fill_rows` fills part by part; and the pieces, rounded to checksum blocks. Tensors that
        need a copy get one piece per interval, so that each block's completed rows are copied right after
        its checksum, while the block is still in cache."""
        e, bb = p.entry, self.bb
        spans = tuple(_block_span(e, a, b, bb) for a, b in p.intervals)
        views, fills = [], []
        for key, parts in p.parts.items():
            shape = tuple(b - a for a, b in key)
            if len(parts) == 1 and parts[0].whole_rows(e) and numpy_dtype(e.dtype) == self._target(p):
                q = parts[0]
                k = _interval(p, q)
                off = q.r0 * e.row_bytes - spans[k][0]
                # the view's address modulo ALIGN: a map starts on a page, a read buffer is aligned
                if ((e.offset + spans[k][0] + off) if p.mapped else off) % ALIGN == 0:
                    views.append((key, k, off, (q.r1 - q.r0) * e.row_bytes, shape if e.shape else ()))
                    continue
            fills.append((key, tuple((_interval(p, q), q) for q in parts), shape))
        piece = max(bb, (PIECE_BYTES // bb) * bb)
        pieces = []
        for k, (start, stop) in enumerate(spans):
            step = max(stop - start, 1) if fills else piece
            pieces += [(k, s, min(s + step, stop)) for s in range(start, stop, step)]
        devices = list(p.keys)
        aval = None
        if self.put is not None:
            aval = self.put.aval(e.shape, self._target(p), p.sharding)
        return _Template(spans, tuple(views), tuple(fills), tuple(pieces), devices,
                         tuple(p.keys[d] for d in devices), aval)

    def _target(self, p: _TensorPlan) -> np.dtype:
        """The dtype tensor p is placed in: its spec's own (a quantized tensor), else the load's."""
        return self.target if p.dtype is None else numpy_dtype(p.dtype)

    def _rows(self, p: _TensorPlan, k: int, r0: int, r1: int) -> np.ndarray:
        """Stored rows [r0, r1) of the tensor, viewed in interval k's bytes."""
        e = p.entry
        base = r0 * e.row_bytes - p.buf_starts[k]
        flat = p.buffers[k][base: base + (r1 - r0) * e.row_bytes].view(numpy_dtype(e.dtype))
        return flat.reshape((r1 - r0, *e.row_shape))

    def _fill_rows(self, p: _TensorPlan, k: int, lo: int, hi: int) -> None:
        """Copy stored rows [lo, hi) of interval k (verified) into the slices that need a copy."""
        for fk, q, host in p.fills:
            a, b = max(lo, q.r0), min(hi, q.r1)
            if fk == k and a < b:
                host[(slice(a - q.r0, b - q.r0), *q.dst)] = \
                    self._rows(p, k, a, b)[(slice(None), *(slice(c0, c1) for c0, c1 in q.src))]

    def read_all(self, threads: int, progress: Callable[[int], object]) -> None:
        """Read, verify and place every piece with `threads` workers (1: in this thread, with no pool); the
        first error stops the others."""
        self.ready = [p for p in self.plans.values() if p.pending == 0]
        queue = iter(self.pieces)
        if threads <= 1:
            self._work(queue, progress)
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-read") as pool:
                futures = [pool.submit(self._work, queue, progress) for _ in range(threads)]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    self.failed = True
                    raise
        for p in self.ready:
            self._finish(p)

    def _work(self, queue: Iterator[tuple[_TensorPlan, int, int, int]], progress: Callable[[int], object]) -> None:
        while not self.failed:
            with self.lock:
                piece = next(queue, None)
            if piece is None:
                return
            try:
                self._read_piece(*piece, progress)
            except BaseException:
                self.failed = True
                raise

    def _read_piece(self, p: _TensorPlan, k: int, s: int, stop: int, progress: Callable[[int], object]) -> None:
        """Block by block: read (preadv) or map, verify the checksum, then copy the rows it completed."""
        e, bb, base = p.entry, self.bb, p.buf_starts[k]
        buf = memoryview(cast("Buffer", p.buffers[k]))  # numpy's stubs declare the buffer protocol for 3.12+ only
        crcs, check, verify, fills, mapped = e.crc32, self.check, self.verify, p.fills, p.mapped
        row = p.intervals[k][0]  # first row not yet copied (pieces of tensors with copies span the interval)
        for b0 in range(s, stop, bb):
            b1 = b0 + bb if b0 + bb < stop else stop
            block = buf[b0 - base: b1 - base]
            if not mapped:
                pread_tensor_bytes(self.fds[e.file], e, b0, block, self.path)
            if verify:
                if check(block) != crcs[b0 // bb]:
                    self._corrupt(e, b0 // bb)
            elif mapped:  # fault the mapped pages in now, so the load really reads them
                int(p.buffers[k][b0 - base: b1 - base: PAGE_BYTES].max(initial=0))
            if fills:
                done = min(p.intervals[k][1], b1 // e.row_bytes)
                if done > row:
                    self._fill_rows(p, k, row, done)
                    row = done
        progress(stop - s)
        with self.lock:
            p.pending -= 1
            if p.pending == 0:
                self.ready.append(p)
            if len(self.ready) < FINISH_BATCH:
                return
            batch, self.ready = self.ready, []
        for q in batch:
            self._finish(q)

    def _corrupt(self, e: TensorEntry, blk: int) -> None:
        raise CheckpointError(
            f"checksum mismatch in block {blk} (tensor bytes [{blk * self.bb}, "
            f"{min((blk + 1) * self.bb, e.length)})): the file is corrupt", str(self.path / e.file), tensor=e.name)

    def _finish(self, p: _TensorPlan) -> None:
        """All of the tensor's pieces are in: hand each local device its host array (aliased on CPU)."""
        e, hosts, t = p.entry, p.hosts, p.template
        assert t is not None
        if self.put is not None:
            self.out[e.name] = self.put.put(t.aval, p.sharding, [hosts[k] for k in t.device_keys], t.devices)
        else:
            import jax

            self.out[e.name] = jax.make_array_from_callback(e.shape, p.sharding,
                                                            lambda idx: hosts[_slice_key(idx, e.shape)])
        p.buffers, p.hosts, p.fills = [], {}, []


def _interval(p: _TensorPlan, q: _Part) -> int:
    """Which of the plan's merged intervals holds part q."""
    return next(i for i, (a, b) in enumerate(p.intervals) if a <= q.r0 and q.r1 <= b)


@lru_cache(maxsize=1)
def _cpu_count() -> int:
    return os.cpu_count() or 1  # reads /sys on every call (~2 ms here)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic GC: jax hooks XLA's garbage collection (~1 ms) into every GC pass, and the
    small objects a load allocates would trigger several passes (~10% of a warm-cache load)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
