"""The one description of every jitted program an engine runs, from shapes and shardings alone.

`ProgramSet` holds the model's graph, the shardings of every input, and the jitted bodies of the paged
engine's programs:
- `step_{T}x{P}`: one mixed ragged step. For every dp group, the new tokens of that group's sequences in one flat
  batch of T places (prefill chunks of several tokens and decode rows of one token, at explicit positions).
  The pool is carried through the layer scan: per layer, each group writes this step's new K/V into its
  pages in place and calls the attention backend (`raydeploy.engine.attention`, jax's ragged paged attention
  signature) on the whole pool with the rows' page ids offset to that layer, inside `jax.shard_map`
  (sequences and pages over dp, heads over tp). Nothing of the cache is sliced or copied per layer (XLA
  updates the donated, carried pool in place). Logits only at each
  sequence's last token of the step; sampling fused. T is a token bucket (`default_token_buckets`: powers
  of four up to the slots of a group for decode steps; for steps with prompt chunks `engine.prefill_chunk`, a
  quarter of it, and on CPU every power of two between), P the page table's width:
  max_seq_len's pages, or page buckets (from 256 tokens up by 8x) for a backend whose work follows the
  table's width rather than the live tokens (`attention.work_follows_table`: the GPU one).
- `step_{T}x{P}_single`: the same step for a pass in which every live sequence carries one token (every decode
  pass), compiled only where the attention has a separate single-token path (`attention.Attention`: the GPU's
  Pallas decode kernel; the `step` programs there take the XLA path). The engine picks it on the host, so no
  program chooses on its data: on a GPU a `lax.cond` copies its predicate to the host and waits, and the
  choice made once around the layer scan instead made XLA copy the carried pool (measured on CPU).
- `presence_row`: sets one slot's repetition-penalty token set from the host (a request that starts on reused
  prefix pages).

The real `Engine` calls these bodies with real arrays; `abstract_args(shape)` gives the same calls' arguments
as `jax.ShapeDtypeStruct`s with the same shardings, so `raydeploy compile` lowers exactly the programs bring-up
will run (for any mesh, including the devices of a deviceless TPU topology) without allocating anything or
reading a weight. Neither can drift from the other: there is no second description.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.config import EngineConfig, ModelConfig
from raydeploy.engine.attention import Attention
from raydeploy.engine.kv_cache import (
    FIELD_LAYOUT,
    PoolLayout,
    StepInputs,
    abstract_inputs,
    pool_sharding,
    pool_specs,
    resolve_kv_dtype,
    step_tokens,
    to_pool_dtype,
)
from raydeploy.engine.sampling import chunks_for_shards, sample
from raydeploy.model import native, stacked_matmul
from raydeploy.model.llama import DTYPES, EMBEDDING, ActivationSharding, in_out_kernels, unroll_layers
from raydeploy.model.registry import Family
from raydeploy.model.sharding import logical_to_mesh_axes, partition_spec
from raydeploy.model.spec import pages_per_seq, resolve_num_pages


def resolve_kernel_layout(kernel_layout: str, param_dtype: str, platform: str, native_weights: tuple[str, ...] = ()
                          ) -> str:
    """`EngineConfig.kernel_layout` with auto resolved: out_in for bfloat16 weights on CPU when XLA multiplies them
    (measured on the demo model, 8 decode rows: XLA's bfloat16 projections take ~10 GB/s in_out, the [V, D]-shaped
    tied LM head ~16 GB/s), in_out elsewhere: float32 on CPU is faster in_out, the native CPU kernel reads in_out
    weights (`native_weights`: the dtypes it multiplies, empty where it does not run), TPU/GPU compilers choose
    their own layouts."""
    if kernel_layout != "auto":
        return kernel_layout
    xla_bf16 = param_dtype == "bfloat16" and platform == "cpu" and param_dtype not in native_weights
    return "out_in" if xla_bf16 else "in_out"


def default_decode_rows(slots_per_group: int, min_rows: int = 1) -> list[int]:
    """Decode row buckets per slot group: powers of four from `min_rows` below the group size, and the size.

    Powers of four, not two: each bucket is one more compiled program per window, and a decode step's cost
    grows slowly with rows (the weights are read once per step whatever the rows), so a step padded to up to
    4x its occupied rows costs little more than an exact one."""
    out, r = [], min(min_rows, slots_per_group)
    while r < slots_per_group:
        out.append(r)
        r *= 4
    return out + [slots_per_group]


FINE_PROMPT_BUCKETS = ("cpu",)
"""Platforms whose prompt steps get a bucket at every power of two between the group's slots and the chunk (and
from `MIN_THREE_HALVES_BUCKET` at 3/2 of each too).
On CPU a step's cost grows with its tokens (the demo model: a 64-token step costs ~3 decode passes, a 256-token
one ~8), so padding 140 tokens to 256 nearly doubles the step. On TPU and GPU a step of a few hundred tokens
costs about one weight read whatever its tokens, and fewer programs compile faster: there the prompt steps are
the chunk and a quarter chunk."""
MIXED_STEP_CAP_PLATFORMS = ("cpu",)
"""Platforms where a step beside running streams carries at most the quarter chunk (`Engine.mixed_step_tokens`):
on CPU a step costs what its tokens compute, so a whole chunk beside the streams slows them several times over.
On TPU and GPU a chunk step costs about one weight read, as a decode pass does; there prompts that arrive while
streams decode go in whole chunks (the quarter bucket stays, for short prompts), and `engine.max_decode_slowdown`
still holds a long prompt's chunks back by measured step times. Measured on one H100 (a Llama-3.2-1B shape,
bfloat16, 64 prompts of 32-64 tokens at once, `benchmarks/gpu_decode.py`): capped at the quarter, the last first
token came after 1.73 s, 47 steps of 64 tokens."""
MIN_FINE_PROMPT_BUCKET = 16
"""The smallest of those buckets: a step of fewer tokens costs about a decode pass on CPU too."""
MIN_THREE_HALVES_BUCKET = 64
"""From here the CPU ladder also has 3/2 of each power of two (96, 192, ...): a step's cost is nearly its tokens'
there, and 8 short prompts arriving together (~92 new tokens per group of the embedded default) would pay for 128."""


def default_token_buckets(decode_rows: Sequence[int], slots_per_group: int, max_step_tokens: int,
                          platform: str) -> list[int]:
    """Token places per dp group of the step programs: the decode row buckets, the chunk (`max_step_tokens`),
    the quarter chunk (the engine's `mixed_step_tokens`, the step beside running streams) and, on a platform
    in `FINE_PROMPT_BUCKETS`, every power of two from twice the group's slots (at least
    `MIN_FINE_PROMPT_BUCKET`) up to the chunk, with 3/2 of each from `MIN_THREE_HALVES_BUCKET`."""
    out = set(decode_rows) | {max_step_tokens}
    quarter = max_step_tokens // 4
    if quarter > slots_per_group:
        out.add(quarter)
    if platform in FINE_PROMPT_BUCKETS:
        t = max(MIN_FINE_PROMPT_BUCKET, 1 << (2 * slots_per_group - 1).bit_length())
        while t < max_step_tokens:
            out.add(t)
            if t >= MIN_THREE_HALVES_BUCKET and t + t // 2 < max_step_tokens:
                out.add(t + t // 2)
            t *= 2
    return sorted(out)


def pack(tokens: jax.Array, logprobs: jax.Array) -> jax.Array:
    """[2, B] float32: the tokens' int32 bits and their logprobs, so a step returns (and, across processes,
    gathers) one array, not two."""
    return jnp.stack([jax.lax.bitcast_convert_type(tokens, jnp.float32), logprobs])


AttentionFn = Callable[..., jax.Array]

MIN_PAGE_BUCKET_TOKENS = 256
"""Smallest page bucket, in tokens: below it the gathered pages are a few percent of a step's weight read."""
PAGE_BUCKET_FACTOR = 8
"""Each page bucket holds this many times the previous one's pages (fewer programs; at most 8x the pages read)."""


def default_page_buckets(max_pages: int, page_size: int) -> list[int]:
    """Pages gathered per sequence: from `MIN_PAGE_BUCKET_TOKENS` up by `PAGE_BUCKET_FACTOR`, capped by the
    pages of max_seq_len."""
    p = max(1, -(-MIN_PAGE_BUCKET_TOKENS // page_size))
    out = []
    while p < max_pages:
        out.append(p)
        p *= PAGE_BUCKET_FACTOR
    return out + [max_pages]


UNROLL_PLATFORMS = ("cpu",)
"""Platforms whose one-token step programs run the layers unrolled over per-layer weight arrays: XLA CPU copies
a stacked weight's layer slice before every matmul (`raydeploy.model.llama.unroll_layers`). TPU and GPU
compilers read the slice in place, and a scanned program compiles in a fraction of the time."""
UNROLL_MAX_TOKENS = 1
"""Token places per group of the unrolled programs (measured on the demo model, 30 layers: 1 row 23 -> 17 ms,
2 rows 24 -> 21 ms, 4 rows 28 -> 31 ms, 8 rows the same): the one-row decode bucket."""


def _layer_sharding(s: jax.sharding.Sharding) -> NamedSharding:
    """A stacked [L, ...] parameter's sharding (a NamedSharding) without its never sharded layer dimension."""
    if not isinstance(s, NamedSharding):
        raise TypeError(f"stacked layer parameters are placed with a NamedSharding, got {s!r}")
    return NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]))


def layer_view(x: jax.Array, layer: int) -> jax.Array:
    """x[layer] of a stacked parameter as an array over x's own memory on every device (on CPU a host buffer
    handed to jax without a copy when it is aligned; `_aliases` checks)."""
    shards = [jax.device_put(np.asarray(s.data)[layer], s.device) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape[1:], _layer_sharding(x.sharding), shards)


def _aliases(view: jax.Array, x: jax.Array, layer: int) -> bool:
    """Every local shard of `view` is layer `layer` of x's shard, in place."""
    step = math.prod(x.addressable_shards[0].data.shape[1:]) * x.dtype.itemsize
    by_device = {s.device: s.data for s in x.addressable_shards}
    return all(v.data.unsafe_buffer_pointer() == by_device[v.device].unsafe_buffer_pointer() + layer * step
               for v in view.addressable_shards)


@dataclass(frozen=True)
class ProgramShape:
    """One program: `step` with T token places per dp group and P pages per sequence, or `presence`."""

    kind: str  # step | presence
    tokens: int = 0
    pages: int = 0
    single_token: bool = False  # every live sequence carries one token: the attention's single-token path

    @property
    def name(self) -> str:
        if self.kind != "step":
            return "presence_row"
        return f"step_{self.tokens}x{self.pages}" + ("_single" if self.single_token else "")


def _interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """K and V [N, K, H] -> [N, 2K, H] interleaved on the head axis (k0, v0, k1, v1, ...)."""
    n, kh, h = k.shape
    return jnp.stack([k, v], axis=2).reshape(n, 2 * kh, h)


def _axes_entry(axes: Sequence[str]) -> Any:
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def default_attention(name: str, platform: str) -> Attention:
    from raydeploy.engine.attention import get_attention

    return get_attention(name, platform)


class ProgramSet:
    """Every program of one paged engine configuration over one mesh: shardings, jitted bodies, abstract inputs.

    The model comes from its family (`raydeploy.model.registry`): module, parameter specs, KV pool shape and
    the family's own sharding rules (the configured rules win), so every family runs the same programs."""

    def __init__(self, family: Family, cfg: Any, mesh: jax.sharding.Mesh, rules: dict[str, Any],
                 model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 attention: AttentionFn | Attention | None = None) -> None:
        self.family = family
        self.cfg = cfg
        self.mesh = mesh
        self.rules = {**family.rules, **dict(rules)}
        family.check_mesh(cfg, dict(mesh.shape))
        self.max_slots = engine_cfg.max_slots
        self.max_seq_len = model_cfg.max_seq_len
        self.dtype = DTYPES[model_cfg.dtype]
        self.param_dtype = DTYPES[model_cfg.param_dtype]
        platform = mesh.devices.flat[0].platform
        self.platform = platform
        self.shard = ActivationSharding.create(mesh, self.rules)
        self.dp_axes = self.shard.slot_axes
        self.native_matmul = self._native_matmul(engine_cfg.cpu_matmul, model_cfg)
        layout = resolve_kernel_layout(engine_cfg.kernel_layout, model_cfg.param_dtype, platform,
                                       native.weight_dtypes() if self.native_matmul is None else ())
        # auto picks what the family's module can hold (an explicit choice it cannot is the module's error)
        self.kernel_layout = family.resolve_kernel_layout(layout) if engine_cfg.kernel_layout == "auto" else layout
        if self.native_matmul is None and self.kernel_layout != "in_out":
            self.native_matmul = f"kernel layout {self.kernel_layout} (the kernel reads in_out weights)"
        self.graphdef, abstract_state = family.abstract_model(cfg, model_cfg.dtype, model_cfg.param_dtype,
                                                              self.kernel_layout)
        leaves, self.param_treedef = jax.tree.flatten(abstract_state)
        mesh_shape = dict(mesh.shape)
        specs = family.engine_param_specs(cfg, self.kernel_layout)
        names = [".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(abstract_state)]
        self.param_shardings = [NamedSharding(mesh, partition_spec(specs[n].logical_axes, self.rules, mesh_shape, n))
                                for n in names]
        self.abstract_params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                for x, s in zip(leaves, self.param_shardings, strict=True)]
        self.layer_leaves = [i for i, n in enumerate(names) if n.startswith("layers.")]
        self.param_names = names
        self.layer_specs = {names[i].removeprefix("layers."): self.param_shardings[i].spec for i in self.layer_leaves}
        """Each stacked layer parameter's partition, by its path in the layer module (`stacked_matmul.rows_over`)."""
        abstract_model = self.model(leaves)
        layers = type(abstract_model.layers)
        self.packable: dict[str, int] = {}
        """The weights the native kernel may read packed (`raydeploy.model.native.packing`): stacked layer kernels by
        path in the layer module, with how many of their dims make K (`in_out_kernels`; 4-bit tiles), and a tied
        embedding table (`EMBEDDING`, 0; 8-bit rows); empty where it may not."""
        self.pack_weights = self._pack_weights(engine_cfg.pack_weights, model_cfg, layers)
        """Why no layer kernel is held packed, or None when those in `packable` may be (`Engine` packs each whose
        weights are exactly 4-bit blocks and calls `use_packed`)."""
        if self.pack_weights is None:
            self.packable = in_out_kernels(abstract_model.layers)
            if abstract_model.lm_head is None:  # the tied embedding table is the LM head: 8-bit rows
                self.packable[EMBEDDING] = 0
        self.packed: dict[str, jax.ShapeDtypeStruct] = {}
        """The packed copies the step programs take (after `use_packed`), by path in the layer module."""
        self.unrolled_tokens: frozenset[int] = frozenset()
        if engine_cfg.unroll_layers == "auto" and platform in UNROLL_PLATFORMS and getattr(layers, "unrollable", False):
            self.unrolled_tokens = frozenset({UNROLL_MAX_TOKENS})
        self.stacked_matmul = self._stacked_matmul(engine_cfg.gpu_matmul, model_cfg, layers)
        """Why the step programs keep XLA's gemm for few rows by stacked weights, or None when they use the Pallas
        kernel that reads a layer's weight inside the stack (`raydeploy.model.stacked_matmul`)."""
        self.groups = self.shard.slot_groups
        # the logits keep the LM head's vocabulary sharding into sampling (no all-gather of [rows, vocab])
        vocab_axes = logical_to_mesh_axes(("vocab",), self.rules, mesh_shape, "LM head")[0] or ()
        self.vocab_chunks = chunks_for_shards(math.prod(mesh_shape[a] for a in vocab_axes))
        if self.max_slots % self.groups:
            raise ValueError(f"engine.max_slots {self.max_slots} is not divisible by the {self.groups} dp groups")
        self.slots_per_group = self.max_slots // self.groups
        self.page_size = engine_cfg.page_size
        self.max_pages_per_seq = pages_per_seq(self.max_seq_len, self.page_size)
        self.pages_per_group = resolve_num_pages(engine_cfg.num_pages, self.slots_per_group, self.max_seq_len,
                                                 self.page_size)
        self.total_pages = self.pages_per_group * self.groups
        self.max_step_tokens = step_tokens(engine_cfg, self.groups)
        self.layout = PoolLayout.for_engine(family, cfg, engine_cfg, self.max_seq_len, self.groups)
        self.pool_sharding = pool_sharding(family, cfg, self.layout, self.total_pages, self.page_size,
                                           self.max_slots, mesh, self.rules)
        self.pool_shapes = tuple(s.shape for s in pool_specs(family, cfg, self.layout, self.total_pages,
                                                             self.page_size, self.max_slots))
        heads = self.pool_sharding[0].spec[3]
        self.head_axes: tuple[str, ...] = () if heads is None else ((heads,) if isinstance(heads, str) else tuple(heads))
        n_head_shards = math.prod(mesh_shape[a] for a in self.head_axes)
        if cfg.num_heads % n_head_shards:
            raise ValueError(f"{cfg.num_heads} attention heads do not split over the {n_head_shards} shards "
                             f"of the kv heads (mesh.rules.cache_kv_heads)")
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.presence_sharding = NamedSharding(
            mesh, partition_spec(("cache_batch", "act_vocab"), self.rules, mesh_shape, "presence"))
        slow_single_row = self.param_dtype == jnp.bfloat16 and platform == "cpu"
        decode = default_decode_rows(self.slots_per_group, 2 if slow_single_row else 1)
        self.token_buckets = default_token_buckets(decode, self.slots_per_group, self.max_step_tokens, platform)
        from raydeploy.engine.attention import for_device, work_follows_table

        attention_name = for_device(engine_cfg.attention, mesh.devices.flat[0])
        self.kv_dtype = jnp.dtype(resolve_kv_dtype(engine_cfg.kv_dtype, model_cfg.dtype, attention_name, platform))
        """The KV pools' dtype (`engine.kv_dtype`)."""
        self.page_buckets = (default_page_buckets(self.max_pages_per_seq, self.page_size)
                             if work_follows_table(attention_name, platform) else [self.max_pages_per_seq])
        if attention is None:
            attention = default_attention(attention_name, platform)
        self.attention = attention if isinstance(attention, Attention) else Attention(attention)
        # a family with another score scale applies it to q (Gemma 3's query_pre_attn_scalar)
        self.sm_scale = 1.0 / math.sqrt(cfg.head_dim)
        dp = _axes_entry(self.dp_axes)
        self.sharded_1d = NamedSharding(mesh, PartitionSpec(dp))
        self.sharded_2d = NamedSharding(mesh, PartitionSpec(dp, None))
        # the slots' last tokens live on their group's devices, like the slots' pages and repetition-penalty sets;
        # so do a pass's packed results [2, G*R] (rows over dp): the passes of a plan need nothing from another
        # group, and `gather_results` brings the plan's results together once, not in every pass
        self.sharded_rows = NamedSharding(mesh, PartitionSpec(None, dp))
        outs = (self.pool_sharding, self.presence_sharding, self.sharded_1d, self.sharded_rows)
        self.step = jax.jit(self._step_fn, donate_argnums=(1, 2, 3), out_shardings=outs)
        self.step_unrolled = jax.jit(self._step_unrolled_fn, donate_argnums=(1, 2, 3), out_shardings=outs)
        self.step_single = jax.jit(partial(self._step_fn, single_token=True), donate_argnums=(1, 2, 3),
                                   out_shardings=outs)
        self.step_unrolled_single = jax.jit(partial(self._step_unrolled_fn, single_token=True),
                                            donate_argnums=(1, 2, 3), out_shardings=outs)
        self.gather_results = jax.jit(lambda *packed: jnp.stack(packed), out_shardings=self.replicated)
        """The packed results of a plan's passes [steps, 2, G*R], replicated: the one collective between the
        groups per plan (a dp-only mesh's passes have none)."""
        self.presence_row = jax.jit(lambda presence, slot, row: presence.at[slot].set(row), donate_argnums=(0,),
                                    out_shardings=self.presence_sharding)

    def _native_matmul(self, choice: str, model_cfg: ModelConfig) -> str | None:
        """Why the step programs keep XLA's dot for the projections, or None when they use the native CPU kernel
        (`raydeploy.model.native`): auto, on CPU, float32 activations, float32 weights (or bfloat16 where the kernel
        is built for AVX-512) replicated over a dp-only mesh; the caller then also needs the in_out layout."""
        others = {a: n for a, n in dict(self.mesh.shape).items() if a not in self.dp_axes and n > 1}
        if choice != "auto":
            return f"engine.cpu_matmul is {choice}"
        if self.platform != "cpu":
            return f"the platform is {self.platform}"
        weights = native.weight_dtypes()
        if model_cfg.dtype != "float32" or model_cfg.param_dtype not in weights:
            return (f"dtype {model_cfg.dtype}, param_dtype {model_cfg.param_dtype} (the kernel multiplies float32 "
                    f"activations by {' or '.join(weights)} weights on this CPU)")
        if others:
            return f"the mesh splits weights over {others} (the kernel needs them replicated)"
        return native.unavailable()

    def _pack_weights(self, choice: str, model_cfg: ModelConfig, layers: type) -> str | None:
        if choice != "auto":
            return f"engine.pack_weights is {choice}"
        if self.native_matmul is not None:
            return f"the native kernel does not run ({self.native_matmul})"
        if model_cfg.param_dtype != "float32":
            return f"param_dtype {model_cfg.param_dtype} (packing takes float32 weights)"
        if not getattr(layers, "unrollable", False):
            return f"{layers.__name__} layers pass no layer slices (`scan_layers`)"
        return native.packs_weights()

    def use_packed(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """The step programs take these packed copies ([L, K/32, N/32, 768] uint8, by path in the layer module,
        replicated) and read them for few rows; every program then scans the layers (a `LayerSlice` names its
        packed copy, an unrolled layer's weight would not)."""
        unknown = sorted(set(shapes) - set(self.packable))
        if unknown:
            raise ValueError(f"packed weights {unknown} are not among the packable layer kernels {sorted(self.packable)}")
        self.packed = {n: jax.ShapeDtypeStruct(tuple(s), jnp.uint8, sharding=self.replicated) for n, s in shapes.items()}
        if self.packed:
            self.scan_everywhere()

    def _stacked_matmul(self, choice: str, model_cfg: ModelConfig, layers: type) -> str | None:
        """Why the step programs keep XLA's gemm for few rows by a layer's weights, or None when they call
        `stacked_matmul` (`engine.gpu_matmul`: auto on a GPU, pallas anywhere; bfloat16 weights, in_out, layers
        scanned by `scan_layers`)."""
        if choice == "xla" or (choice == "auto" and self.platform != "gpu"):
            return f"engine.gpu_matmul is {choice} on {self.platform}"
        if model_cfg.param_dtype != "bfloat16":
            return f"param_dtype {model_cfg.param_dtype} (the kernel multiplies bfloat16 weights)"
        if self.kernel_layout != "in_out":
            return f"kernel layout {self.kernel_layout} (the kernel reads in_out weights)"
        if not getattr(layers, "unrollable", False):
            return f"{layers.__name__} layers pass no layer slices (`scan_layers`)"
        return stacked_matmul.device_problem(self.mesh.devices.flat[0]) if self.platform == "gpu" else None

    # -- the list of programs
    def shapes(self) -> list[ProgramShape]:
        """Every program bring-up compiles, in warmup order."""
        single = self.single_token_buckets
        # a pass of one token per group is always single-token: no general program for that bucket then
        general = [t for t in self.token_buckets if not (t == 1 and t in single)]
        return ([ProgramShape("step", t, p) for t in general for p in self.page_buckets]
                + [ProgramShape("step", t, p, True) for t in single for p in self.page_buckets]
                + [ProgramShape("presence")])

    @property
    def single_token_buckets(self) -> list[int]:
        """Token buckets that get a single-token variant: those a decode pass can take (at most one token per
        slot of a group), where the attention has a single-token path; else none."""
        if self.attention.single_token is None:
            return []
        return [t for t in self.token_buckets if t <= self.slots_per_group]

    def program_for(self, tokens: int, pages: int, single_token: bool) -> ProgramShape:
        """The step program for a pass of `tokens` places and `pages` table width (both already bucketed);
        `single_token`: every live sequence carries one token."""
        return ProgramShape("step", tokens, pages, single_token and tokens in self.single_token_buckets)

    def rows_for(self, tokens: int) -> int:
        """Sequence rows per group of a program with `tokens` places: no more rows than tokens or slots."""
        return min(tokens, self.slots_per_group)

    def input_shardings(self) -> dict[str, Any]:
        out = {}
        for name, layout in FIELD_LAYOUT.items():
            out[name] = (self.replicated if layout == "replicated"
                         else self.sharded_2d if name in ("page_indices", "ring_page_indices") else self.sharded_1d)
        return out

    def abstract_inputs(self, tokens: int, pages: int) -> StepInputs:
        shard = self.input_shardings()
        shapes = abstract_inputs(self.groups, tokens, self.rows_for(tokens), pages, self.max_slots)
        fields: dict[str, Any] = {n: jax.ShapeDtypeStruct(s, d, sharding=shard[n]) for n, (s, d) in shapes.items()}
        return StepInputs(**fields)

    def abstract_state(self) -> tuple[Any, ...]:
        """((params, packed weights), pools, presence, last tokens) as ShapeDtypeStructs."""
        pool = tuple(jax.ShapeDtypeStruct(shape, self.kv_dtype, sharding=sh)
                     for shape, sh in zip(self.pool_shapes, self.pool_sharding, strict=True))
        presence = jax.ShapeDtypeStruct((self.max_slots, self.cfg.vocab_size), jnp.bool_,
                                        sharding=self.presence_sharding)
        last = jax.ShapeDtypeStruct((self.max_slots,), jnp.int32, sharding=self.sharded_1d)
        return (self.abstract_params, self.packed), pool, presence, last

    def unrolled(self, shape: ProgramShape) -> bool:
        """Whether this step program runs the layers unrolled over per-layer weight arrays (`step_unrolled`)."""
        return shape.kind == "step" and shape.tokens in self.unrolled_tokens

    def abstract_args(self, shape: ProgramShape) -> tuple[Any, tuple[Any, ...]]:
        """(jitted function, its abstract arguments) for one program."""
        params, pool, presence, last = self.abstract_state()
        if shape.kind == "presence":
            return self.presence_row, (presence, jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated),
                                       jax.ShapeDtypeStruct((self.cfg.vocab_size,), jnp.bool_,
                                                            sharding=self.replicated))
        inputs = self.abstract_inputs(shape.tokens, shape.pages)
        if self.unrolled(shape):
            leaves = params[0]
            per_layer = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=_layer_sharding(x.sharding))
                         for x in (leaves[i] for i in self.layer_leaves)]
            n = leaves[self.layer_leaves[0]].shape[0]
            fn = self.step_unrolled_single if shape.single_token else self.step_unrolled
            return fn, ((params, [per_layer] * n), pool, presence, last, inputs)
        return (self.step_single if shape.single_token else self.step), (params, pool, presence, last, inputs)

    def layer_views(self, leaves: Sequence[jax.Array]) -> list[list[jax.Array]] | None:
        """Per layer, its slice of every stacked layer parameter as an array over the same memory (the
        unrolled programs' weights; no copy), or None when there is nothing to unroll or a slice would be a copy
        (then call `scan_everywhere`: a second copy of the weights costs more than unrolling saves)."""
        if not self.unrolled_tokens:
            return None
        stacked = [leaves[i] for i in self.layer_leaves]
        views = [[layer_view(x, layer) for x in stacked] for layer in range(stacked[0].shape[0])]
        if not all(_aliases(v, x, layer) for layer, row in enumerate(views) for v, x in zip(row, stacked, strict=True)):
            return None
        return views

    def scan_everywhere(self) -> None:
        """Run every step program over the stacked layers (no program is unrolled from now on)."""
        self.unrolled_tokens = frozenset()

    def lower(self, shape: ProgramShape) -> Any:
        """The program lowered for this mesh (compile it with `.compile()`). Traced under the mesh, so a Pallas
        kernel inside asks the mesh's devices for their TPU generation, not the default backend (which has no
        TPU when `raydeploy compile` targets a deviceless topology)."""
        fn, args = self.abstract_args(shape)
        with jax.set_mesh(self.mesh):
            return fn.lower(*args)

    # -- jitted bodies
    def model(self, leaves: list[jax.Array]) -> Any:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, leaves))

    def _manual(self, fn: Callable[..., Any], in_specs: tuple[Any, ...], out_specs: Any) -> Callable[..., Any]:
        """fn per device under shard_map over every mesh axis (sequences and pages split over dp, heads over the
        kv-head axes, replicated over the rest: a Pallas kernel cannot be partitioned automatically); called
        directly on a one-device mesh."""
        if self.mesh.size == 1:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=frozenset(self.mesh.axis_names), check_vma=False)

    def _per_group(self, fn: Callable[..., Any], sharded: int, replicated: int = 0) -> Callable[..., Any]:
        """fn once per dp group, on the group's own rows, slots and token places: shard_map over the slot (dp)
        axes only, every other mesh axis left to the partitioner. The first `sharded` arguments and every
        output are split along their first dim over those axes, the `replicated` ones after them are scalars.

        Written over the whole batch instead, the partitioner cannot know that a group's rows only index its
        own slots: it all-gathered the rows' logits ([rows, vocab]: 3 MB a pass at 16 rows of a 49k
        vocabulary), the repetition-penalty sets and every scatter's indices across the dp groups, seven
        collectives a pass, which between hosts cross the network."""
        if self.groups == 1:
            return fn
        dp = PartitionSpec(_axes_entry(self.dp_axes))
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(dp,) * sharded + (PartitionSpec(),) * replicated,
                             out_specs=dp, axis_names=frozenset(self.dp_axes), check_vma=False)

    def _attend(self, inp: StepInputs, attention: AttentionFn) -> Callable[..., Any]:
        """The per-layer attention of the ragged forward. The pool is carried through the layer scan: each layer
        writes this step's new K/V into its own pages of the pool (in place: the pool is donated and XLA updates
        a carried buffer without copying it), then the backend reads the pool whole, [layers * pages, ...],
        with the rows' page ids offset to this layer. No per-layer slice or view of the cache is made (slicing
        a layer's pool out of the stacked one, or gathering a compact view, copies it on every backend).

        A family whose layers differ in kind inside one scan (Gemma 3's local and global layers) passes `local=`,
        a traced flag: the window applies only where it is true. The K/V write then goes to the layer's pool
        unconditionally (in ring mode: into both pools, the write to the one the layer does not use dropped) and
        a `lax.cond` picks only the read, whose operands it does not change. A cond around the write, which
        carried the pools through its branches, made XLA copy the main pool twice a step."""
        dp, hd = _axes_entry(self.dp_axes), _axes_entry(self.head_axes)
        pool_spec = PartitionSpec(None, dp, None, hd, None)

        def write(kv, pool, layer, write_page, offset):
            layers, pages = pool.shape[:2]
            flat = pool.reshape(layers * pages, *pool.shape[2:])
            base = layer * pages
            # padding places carry write_page == pages (out of this group's range): keep them out of range
            dest = jnp.where((write_page >= 0) & (write_page < pages), base + write_page, layers * pages)
            if kv.shape[0] == 1:
                # XLA rewrites a one-index scatter as a dynamic-update-slice of a select against the old value,
                # and then copied the whole carried pool every layer (CPU, 3 copies); a second, dropped index
                # keeps it a scatter, which updates the pool in place
                dest = jnp.concatenate([dest, jnp.full((1,), layers * pages, dest.dtype)])
                offset = jnp.concatenate([offset, offset])
                kv = jnp.concatenate([kv, kv])
            return flat.at[dest, offset].set(kv, mode="drop").reshape(pool.shape)

        def read(q, pool, layer, kv_lens, page_indices, cu_q_lens, num_seqs, *, sliding_window, soft_cap):
            layers, pages = pool.shape[:2]
            flat = pool.reshape(layers * pages, *pool.shape[2:])
            return attention(q, flat, kv_lens, page_indices + layer * pages, cu_q_lens, num_seqs,
                             sm_scale=self.sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)

        def local(q, kv, pool, layer, write_page, offset, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                  sliding_window, soft_cap):
            pool = write(kv, pool, layer, write_page, offset)
            out = read(q, pool, layer, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window=sliding_window,
                       soft_cap=soft_cap)
            return out, pool

        seq, heads, table = PartitionSpec(dp), PartitionSpec(dp, hd, None), PartitionSpec(dp, None)  # over dp
        in_specs = (heads, heads, pool_spec, PartitionSpec(), seq, seq, seq, table, seq, seq)
        out_specs = (heads, pool_spec)
        write_body = self._manual(write, (heads, pool_spec, PartitionSpec(), seq, seq), pool_spec)
        read_specs = (heads, pool_spec, PartitionSpec(), seq, table, seq, seq)
        # one sharded body per (window, soft cap): both are static for the backend; a family passes them per
        # layer (Gemma 3's local layers, a Mistral window on every layer), the engine knows no family
        bodies: dict[tuple[str, int | None, float | None], Callable[..., Any]] = {}
        index = jnp.asarray(self.layout.index, jnp.int32)
        ring = self.layout.ring_pages > 0

        def body(kind: str, window: int | None, cap: float | None) -> Callable[..., Any]:
            key = (kind, window, cap)
            if key not in bodies:
                fn, specs, outs = (local, in_specs, out_specs) if kind == "both" else (read, read_specs, heads)
                bodies[key] = self._manual(partial(fn, sliding_window=window, soft_cap=cap), specs, outs)
            return bodies[key]

        def attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, pools: tuple[jax.Array, jax.Array],
                   *, sliding_window: int | None = None, soft_cap: float | None = None, local: Any = None
                   ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            window = int(sliding_window) if sliding_window else None
            cap = float(soft_cap) if soft_cap else None
            main, ring_pool = pools
            kv = to_pool_dtype(_interleave(k, v), main.dtype)
            if local is not None and window is not None:
                return attend_either(layer, q, kv, main, ring_pool, local, window, cap)
            if ring and window:  # a sliding-window layer: its ring in the window pool (PoolLayout)
                out, ring_pool = body("both", window, cap)(q, kv, ring_pool, index[layer], inp.ring_write_page,
                                                           inp.write_offset, inp.kv_lens, inp.ring_page_indices,
                                                           inp.cu_q_lens, inp.num_seqs)
            else:
                out, main = body("both", window, cap)(q, kv, main, index[layer], inp.write_page, inp.write_offset,
                                                      inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
            return out.astype(q.dtype), (main, ring_pool)

        def attend_either(layer, q, kv, main, ring_pool, local, window, cap):
            """A layer whose kind is traced: write unconditionally, choose only the read."""
            none = jnp.full_like(inp.write_page, -1)  # a write page out of range: dropped
            if ring:
                ring_pool = write_body(kv, ring_pool, index[layer], jnp.where(local, inp.ring_write_page, none),
                                       inp.write_offset)
                main = write_body(kv, main, index[layer], jnp.where(local, none, inp.write_page), inp.write_offset)
            else:
                main = write_body(kv, main, index[layer], inp.write_page, inp.write_offset)

            def read_local(main, ring_pool):
                pool, table = (ring_pool, inp.ring_page_indices) if ring else (main, inp.page_indices)
                return body("read", window, cap)(q, pool, index[layer], inp.kv_lens, table, inp.cu_q_lens,
                                                 inp.num_seqs)

            def read_global(main, ring_pool):
                return body("read", None, cap)(q, main, index[layer], inp.kv_lens, inp.page_indices, inp.cu_q_lens,
                                               inp.num_seqs)

            out = jax.lax.cond(local, read_local, read_global, main, ring_pool)
            return out.astype(q.dtype), (main, ring_pool)

        return attend

    def _step_unrolled_fn(self, params, pool, presence, last_tokens, inp: StepInputs, single_token: bool = False):
        """`_step_fn` with the layers unrolled: params are ((leaves, packed), per layer its slices of the stacked
        layer leaves, in `layer_leaves` order); the stacked ones go unread."""
        weights, per_layer = params
        return self._step_fn(weights, pool, presence, last_tokens, inp, per_layer, single_token)

    def _step_fn(self, weights, pool, presence, last_tokens, inp: StepInputs, per_layer=None,
                 single_token: bool = False):
        """One ragged step. `weights`: (the model's leaves, the packed copies by path, `use_packed`). Returns the
        pool, the repetition-penalty sets, the slots' last tokens and the packed results [2, G*R] (token bits,
        logprob) of every row. `per_layer`: each layer's own arrays, run unrolled (`unroll_layers`) instead of
        scanning the stacked ones. `single_token`: every live sequence carries one token (the caller's promise),
        so the attention's single-token path serves the step."""
        leaves, packed = weights
        attention = self.attention.single_token if single_token else self.attention.ragged
        if attention is None:
            raise ValueError("a single-token step program needs an attention with a single-token path")
        with (native.rows_over(self.mesh, self.dp_axes, packed) if self.native_matmul is None
              else contextlib.nullcontext()), \
                (stacked_matmul.rows_over(self.mesh, self.dp_axes, self.platform != "gpu", self.layer_specs)
                 if self.stacked_matmul is None else contextlib.nullcontext()):
            return self._step_body(leaves, pool, presence, last_tokens, inp, per_layer, attention)

    def _step_body(self, leaves, pool, presence, last_tokens, inp: StepInputs, per_layer, attention: AttentionFn):
        model = self.model(leaves)
        if per_layer is not None:
            unroll_layers(model.layers, per_layer)
        g = self.groups
        t = inp.tokens.shape[0] // g
        r = inp.kv_lens.shape[0] // g
        tokens = self._per_group(_last_token_inputs, 3)(last_tokens, inp.from_last, inp.tokens)
        h, _, _, pool = model.ragged(tokens, inp.positions, self._attend(inp, attention), self.shard, cache=pool,
                                     static_kinds=self.attention.static_layer_kinds)
        hg = h.reshape(g, t, h.shape[-1])
        last = jnp.take_along_axis(hg, inp.logit_index.reshape(g, r, 1), axis=1).reshape(g * r, h.shape[-1])
        last = self.shard.constrain(last, ("act_batch", "act_embed"))  # rows stay on their group's devices
        logits = model.logits(last, self.shard)
        tail = partial(_sample_rows, max_slots=self.max_slots, vocab_chunks=self.vocab_chunks)
        presence, last_tokens, tok, lp = self._per_group(tail, 13, replicated=2)(
            logits, presence, last_tokens, inp.reset, tokens, inp.token_slot, inp.row_slot, inp.temperature,
            inp.top_p, inp.top_k, inp.repetition_penalty, inp.seed, inp.sample_position, inp.any_sampled,
            inp.any_filtered)
        return pool, presence, last_tokens, pack(tok, lp)


def _group_slot(slot: jax.Array, max_slots: int, slots_per_group: int) -> jax.Array:
    """A slot id as an index into its group's own slots; padding (`max_slots`) stays out of range."""
    return jnp.where(slot < max_slots, slot % slots_per_group, slots_per_group)


def _last_token_inputs(last_tokens: jax.Array, from_last: jax.Array, tokens: jax.Array) -> jax.Array:
    """A group's token places: a decode row's input is its slot's last sampled token (`from_last` >= 0, the
    slot), a prompt place its own token."""
    src = jnp.where(from_last >= 0, from_last % last_tokens.shape[0], 0)
    return jnp.where(from_last >= 0, last_tokens[src], tokens)


def _sample_rows(logits, presence, last_tokens, reset, tokens, token_slot, row_slot, temperature, top_p, top_k,
                 repetition_penalty, seed, sample_position, any_sampled, any_filtered, *, max_slots: int,
                 vocab_chunks: int):
    """A group's sampling: its slots' repetition-penalty sets take this step's tokens, its rows sample, and each
    sampled token joins its slot's set and becomes the slot's last token."""
    spg = presence.shape[0]
    tslot = _group_slot(token_slot, max_slots, spg)
    rslot = _group_slot(row_slot, max_slots, spg)
    presence = presence & ~reset[:, None]
    presence = presence.at[tslot, tokens].set(True, mode="drop")
    seen = presence[jnp.minimum(rslot, spg - 1)]
    tok, lp = sample(logits, seen, temperature, top_p, top_k, repetition_penalty, seed, sample_position,
                     any_sampled, vocab_chunks, any_filtered)
    presence = presence.at[rslot, tok].set(True, mode="drop")
    last_tokens = last_tokens.at[rslot].set(tok, mode="drop")
    return presence, last_tokens, tok, lp
