"""Foreign parameter layouts -> ours (`raydeploy.model.spec.param_specs`).

Each converter maps a source name to (our name, layout kind) with a `NameMap` of one of the family's tables
(`raydeploy.model.names`), then calls `to_ours(kind, array, cfg)`. Hugging Face PyTorch `nn.Linear` weights
are [out, in]; GGUF tensors, once dequantized (and Q/K un-permuted), have the same [out, in] layout;
EasyDeL/Flax kernels are already [in, out]. Ours are input-dims-first with attention heads split out: q_proj.kernel [hidden, heads, head_dim],
o_proj.kernel [heads, head_dim, hidden].

`SplitPlan` chooses which tensors a converter stores split along column dimensions (format version 2 / 4),
from the axes a mesh cuts (`column_splits`); `TensorSink` writes a converter's tensors split that way and,
by default, stacked over the layers as the engine holds them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from raydeploy.checkpoint.format import CheckpointError, numpy_dtype
from raydeploy.model.names import (
    COPY,
    KV_BIAS,
    KV_IO,
    KV_OI,
    LINEAR_OI,
    O_IO,
    O_OI,
    Q_BIAS,
    Q_IO,
    Q_OI,
)
from raydeploy.model.sharding import logical_to_mesh_axes
from raydeploy.model.spec import LlamaConfig, TensorSpec, param_specs, split_layer_name

if TYPE_CHECKING:
    from raydeploy.checkpoint.writer import CheckpointWriter
    from raydeploy.model.registry import Family
    from raydeploy.model.sharding import Rule


class NameMap:
    """Compiled form of one table: `lookup(source_name) -> (our_name, kind)`, or None for ignored names."""

    def __init__(self, table: Sequence[tuple[str, str, str]], ignored: Sequence[str] = (), source: str = "source"):
        self._rules = [(re.compile(p + r"\Z"), out, kind) for p, out, kind in table]
        self._ignored = [re.compile(p + r"\Z") for p in ignored]
        self.source = source

    def lookup(self, name: str) -> tuple[str, str] | None:
        for rx, out, kind in self._rules:
            m = rx.match(name)
            if m:
                return out.format(**m.groupdict()), kind
        if any(rx.match(name) for rx in self._ignored):
            return None
        raise CheckpointError(f"{self.source} tensor {name!r} is not a known parameter of this model family",
                              tensor=name)


def to_ours(kind: str, x: np.ndarray, cfg: LlamaConfig, name: str = "") -> np.ndarray:
    """Rearrange one source array into our layout (a view where possible; the writer makes it contiguous)."""
    nh, nkv, hd, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

    def need(shape: tuple[int, ...]) -> None:
        if tuple(x.shape) != shape:
            raise CheckpointError(f"source shape {list(x.shape)} does not match the config (expected "
                                  f"{list(shape)})", tensor=name)

    if kind == COPY:
        return x
    if kind == LINEAR_OI:
        if x.ndim != 2:
            raise CheckpointError(f"expected a 2-d weight, found shape {list(x.shape)}", tensor=name)
        return x.T
    if kind == Q_OI:
        need((nh * hd, d))
        return x.T.reshape(d, nh, hd)
    if kind == KV_OI:
        need((nkv * hd, d))
        return x.T.reshape(d, nkv, hd)
    if kind == O_OI:
        need((d, nh * hd))
        return x.T.reshape(nh, hd, d)
    if kind == Q_IO:
        need((d, nh * hd))
        return x.reshape(d, nh, hd)
    if kind == KV_IO:
        need((d, nkv * hd))
        return x.reshape(d, nkv, hd)
    if kind == O_IO:
        need((nh * hd, d))
        return x.reshape(nh, hd, d)
    if kind == Q_BIAS:
        need((nh * hd,))
        return x.reshape(nh, hd)
    if kind == KV_BIAS:
        need((nkv * hd,))
        return x.reshape(nkv, hd)
    raise ValueError(f"unknown layout kind {kind!r}")


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """Cast to a storage dtype name ('keep' leaves it)."""
    if dtype == "keep" or x.dtype.name == dtype:
        return x
    return x.astype(numpy_dtype(dtype))


def check_against_specs(shapes: dict[str, tuple[int, ...]], cfg: LlamaConfig, source: str,
                        specs: Mapping[str, TensorSpec] | None = None) -> None:
    """The converted tensor set must be exactly `specs` (default: the Llama `param_specs(cfg)`), same shapes."""
    specs = param_specs(cfg) if specs is None else specs
    missing = [n for n in specs if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"source lacks tensors the model needs: {', '.join(missing[:5])}{more}", source)
    extra = [n for n in shapes if n not in specs]
    if extra:
        raise CheckpointError(f"source has tensors the config does not describe: {', '.join(extra[:5])}", source)
    for n, s in specs.items():
        if tuple(shapes[n]) != s.shape:
            raise CheckpointError(f"converted shape {list(shapes[n])} != expected {list(s.shape)} from the config",
                                  source, tensor=n)


# ---- splits: store column-sharded tensors so that each device slice is one contiguous byte range ----

def column_splits(mesh_shape: Mapping[str, int], rules: Mapping[str, Rule]) -> dict[str, int]:
    """Per logical axis that some parameter has after its first dimension, into how many parts the mesh
    (its axis sizes and the logical -> mesh axis rules) cuts it; only axes cut into 2 or more parts."""
    out = {}
    for la in _column_axes():
        if la in rules:
            axes = logical_to_mesh_axes((la,), rules, mesh_shape)[0]
            parts = math.prod(mesh_shape[a] for a in axes) if axes else 1
            if parts > 1:
                out[la] = parts
    return out


def splits_tag(splits: Mapping[str, int]) -> str:
    """A short name of a set of column splits, e.g. 'embed2-mlp2' ('' for none)."""
    return "-".join(f"{la}{n}" for la, n in sorted(splits.items()))


@dataclass(frozen=True)
class SplitPlan:
    """Which tensors a converter stores split, from `column_splits`: a tensor is split along each of its
    dimensions after the first that the mesh cuts (into that many parts, where they divide it; format
    version 2, or version 4 for several dimensions: a stacked layer kernel [L, embed, mlp] on fsdp x tp).
    Any mesh still reads the result; on a mesh that cuts the same axes into the same parts, every device
    slice is one run of whole stored rows, which the reader hands to jax uncopied."""

    splits: dict[str, tuple[tuple[int, int], ...]]  # tensor name -> ((dim, parts), ...)
    shapes: dict[str, tuple[int, ...]]

    @staticmethod
    def build(cfg: LlamaConfig, splits: Mapping[str, int] | None,
              specs: Mapping[str, TensorSpec] | None = None) -> SplitPlan:
        out: dict[str, tuple[tuple[int, int], ...]] = {}
        specs, cuts = (param_specs(cfg) if specs is None else specs), dict(splits or {})
        for name, s in specs.items():
            cut = tuple((d, cuts[la]) for d, la in enumerate(s.logical_axes)
                        if d > 0 and la in cuts and s.shape[d] % cuts[la] == 0)
            if cut:
                out[name] = cut
        return SplitPlan(out, {n: s.shape for n, s in specs.items()})

    def for_tensor(self, name: str, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The splits of one converted tensor (none when it is not split, or has another shape than the
        config expects: the converter's shape check then reports it)."""
        split = self.splits.get(name)
        return split if split and tuple(shape) == self.shapes.get(name) else ()


class TensorSink:
    """Where a converter puts each converted tensor, named as the family's `param_specs`: the writer, each
    tensor split as the plan says. With `stacked` (the default layout), layer i's tensor `layers.{i}.x` goes
    into row i of the stacked tensor `layers.x` [L, ...] (reserved at the first layer that arrives), so the
    checkpoint holds the parameters as the engine does (`Family.stacked_param_specs`) and a host loads them
    with no stacking copy, as a few large tensors. A tensor the specs do not expect (another shape, a layer
    beyond the config's) is written as it came, for the converter's shape check to report."""

    def __init__(self, writer: CheckpointWriter, family: Family, cfg: Any, splits: Mapping[str, int] | None,
                 stacked: bool = True):
        self.writer, self.cfg = writer, cfg
        self.per_layer = family.param_specs(cfg)
        self.stacked = family.stacked_param_specs(cfg) if stacked else None
        self.plan = SplitPlan.build(cfg, splits, self.stacked or self.per_layer)

    def add(self, name: str, array: np.ndarray) -> None:
        layer = split_layer_name(name)
        spec = self.per_layer.get(name)
        if self.stacked is None or layer is None or spec is None or tuple(array.shape) != spec.shape:
            self.writer.add(name, array, self.plan.for_tensor(name, array.shape))
            return
        i, suffix = layer
        stacked = f"layers.{suffix}"
        if not self.writer.reserved_or_written(stacked):
            shape = self.stacked[stacked].shape
            self.writer.reserve(stacked, shape, array.dtype.name, self.plan.for_tensor(stacked, shape))
        self.writer.put(stacked, i, array)


@lru_cache(maxsize=1)
def _column_axes() -> tuple[str, ...]:
    """Logical axes that parameters have after their first dimension (read off the specs of a tiny model
    with every optional tensor: biases, an untied head)."""
    cfg = LlamaConfig.from_hf_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "head_dim": 2, "tie_word_embeddings": False, "attention_bias": True})
    return tuple(dict.fromkeys(la for s in param_specs(cfg).values() for la in s.logical_axes[1:]))
