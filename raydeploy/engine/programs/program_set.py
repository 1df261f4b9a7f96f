"""`ProgramSet`: every program of one paged engine configuration over one mesh, with the shardings and abstract
arguments of each. It composes the engine's shapes, the kernel choice (`raydeploy.engine.programs.kernels`) and
the jitted bodies (`raydeploy.engine.programs.bodies`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.config import EngineConfig, ModelConfig
from raydeploy.config.schema import LoraConfig
from raydeploy.engine.attention import Attention, for_device, work_follows_table
from raydeploy.engine.geometry import EngineGeometry
from raydeploy.engine.kv_cache import (
    FIELD_LAYOUT,
    PoolLayout,
    StepInputs,
    abstract_inputs,
    abstract_pools,
    pool_sharding,
    pool_specs,
    resolve_kv_dtype,
)
from raydeploy.engine.programs.bodies import AttentionFn, StepBodies, _axes_entry, default_attention
from raydeploy.engine.programs.kernels import KernelChoice, choose_kernels, choose_layout
from raydeploy.engine.sampling import STATE_DTYPE, chunks_for_shards
from raydeploy.engine.speculative import verify
from raydeploy.lora.layout import LoraLayout
from raydeploy.model.llama import DTYPES, ActivationSharding
from raydeploy.model.registry import Family
from raydeploy.model.sharding import logical_to_mesh_axes, partition_spec


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

    kind: str  # step | verify | presence
    tokens: int = 0
    pages: int = 0
    single_token: bool = False  # every live sequence carries one token: the attention's single-token path

    @property
    def name(self) -> str:
        if self.kind == "verify":
            return f"verify_{self.tokens}x{self.pages}"
        if self.kind != "step":
            return "presence_row"
        return f"step_{self.tokens}x{self.pages}" + ("_single" if self.single_token else "")


class ProgramSet:
    """Every program of one paged engine configuration over one mesh: shardings, jitted bodies, abstract inputs.

    The model comes from its family (`raydeploy.model.registry`): module, parameter specs, KV pool shape and
    the family's own sharding rules (the configured rules win), so every family runs the same programs."""

    def __init__(self, family: Family, cfg: Any, mesh: jax.sharding.Mesh, rules: dict[str, Any],
                 model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 attention: AttentionFn | Attention | None = None, lora_cfg: LoraConfig | None = None) -> None:
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
        native_matmul, kernel_layout = choose_layout(family, mesh, self.dp_axes, model_cfg, engine_cfg)
        self._abstract_model(kernel_layout, model_cfg)
        abstract_model = nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, self._abstract_leaves))
        self.kernels: KernelChoice = choose_kernels(native_matmul, kernel_layout, abstract_model, mesh, model_cfg,
                                                    engine_cfg)
        self.packed: dict[str, jax.ShapeDtypeStruct] = {}
        """The packed copies the step programs take (after `use_packed`), by path in the layer module."""
        self.unrolled_tokens: frozenset[int] = self.kernels.unrolled_tokens
        self._geometry(family, cfg, model_cfg, engine_cfg)
        spec = engine_cfg.speculative
        self.spec_tokens = spec.num_tokens if spec.method != "none" else 0
        """Proposals per speculating row (k); 0 without speculation (no verify program exists then)."""
        self.spec_rows = min(spec.max_rows, self.slots_per_group) if self.spec_tokens else 0
        """Speculating rows per dp group a verify program holds (S)."""
        self._shardings(family, cfg, mesh)
        self._lora(lora_cfg, model_cfg, engine_cfg)
        if attention is None:
            attention = default_attention(self.attention_name, platform)
        self.attention = attention if isinstance(attention, Attention) else Attention(attention)
        # a family with another score scale applies it to q (Gemma 3's query_pre_attn_scalar)
        self.sm_scale = 1.0 / math.sqrt(cfg.head_dim)
        # the results: packed tokens [2, G*R], the rows' alternatives [2K, G*R], the places' prompt logprobs
        # [2 + 2K, G*T] (raydeploy.engine.logprobs), each split over the groups on its last axis
        outs = (self.pool_sharding, self.presence_sharding, self.sharded_1d, self.sharded_rows, self.sharded_rows,
                self.sharded_rows)
        self.bodies = StepBodies(mesh=mesh, shard=self.shard, graphdef=self.graphdef, param_treedef=self.param_treedef,
                                 kernels=self.kernels, layer_specs=self.layer_specs, attention=self.attention,
                                 layout=self.layout, groups=self.groups, max_slots=self.max_slots,
                                 head_axes=self.head_axes, vocab_chunks=self.vocab_chunks, sm_scale=self.sm_scale,
                                 out_shardings=outs, replicated=self.replicated,
                                 presence_sharding=self.presence_sharding)
        self.verify_rows = bool(self.spec_tokens) and self.bodies.attention.decode_rows
        """Whether a speculating row's k + 1 places are verified as k + 1 one-token rows (`verify.as_single_rows`):
        where the attention has a kernel of its own for decode rows (the native CPU kernels), so that each place
        is computed by exactly the arithmetic of a plain decode row there (greedy tokens equal plain decoding's
        bit for bit) and the smallest verify program holds exactly k + 1 places. Elsewhere the row is one chunk
        of k + 1 queries (the attention reads its keys once)."""

    def _abstract_model(self, kernel_layout: str, model_cfg: ModelConfig) -> None:
        """The model's graph, abstract parameters and their shardings, in `kernel_layout`."""
        family, cfg, mesh = self.family, self.cfg, self.mesh
        self.graphdef, abstract_state = family.abstract_model(cfg, model_cfg.dtype, model_cfg.param_dtype,
                                                              kernel_layout)
        leaves, self.param_treedef = jax.tree.flatten(abstract_state)
        self._abstract_leaves = leaves
        mesh_shape = dict(mesh.shape)
        specs = family.engine_param_specs(cfg, kernel_layout)
        names = [".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(abstract_state)]
        self.param_shardings = [NamedSharding(mesh, partition_spec(specs[n].logical_axes, self.rules, mesh_shape, n))
                                for n in names]
        self.abstract_params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                for x, s in zip(leaves, self.param_shardings, strict=True)]
        self.layer_leaves = [i for i, n in enumerate(names) if n.startswith("layers.")]
        self.param_names = names
        self.layer_specs = {names[i].removeprefix("layers."): self.param_shardings[i].spec for i in self.layer_leaves}
        """Each stacked layer parameter's partition, by its path in the layer module (`raydeploy.engine.matmul.PallasGpu`'s `specs`)."""

    def _geometry(self, family: Family, cfg: Any, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
        """The engine's shapes (`EngineGeometry`), held as attributes too; the first of its problems raises."""
        mesh_shape = dict(self.mesh.shape)
        platform = self.platform
        # the logits keep the LM head's vocabulary sharding into sampling (no all-gather of [rows, vocab])
        vocab_axes = logical_to_mesh_axes(("vocab",), self.rules, mesh_shape, "LM head")[0] or ()
        self.vocab_chunks = chunks_for_shards(math.prod(mesh_shape[a] for a in vocab_axes))
        self.attention_name = for_device(engine_cfg.attention, self.mesh.devices.flat[0])
        device = self.mesh.devices.flat[0]
        kv_dtype = resolve_kv_dtype(engine_cfg.kv_dtype, model_cfg.dtype, self.attention_name, platform,
                                    getattr(device, "device_kind", ""), getattr(device, "compute_capability", None))
        self.geometry = g = EngineGeometry.create(engine_cfg, model_cfg, mesh_shape, self.rules, platform, kv_dtype,
                                                  work_follows_table(self.attention_name, platform, kv_dtype))
        problems = g.problems()
        if problems:
            raise ValueError(problems[0])
        self.groups = g.groups
        self.slots_per_group = g.slots_per_group
        self.page_size = g.page_size
        self.max_pages_per_seq = g.max_pages_per_seq
        self.pages_per_group = g.pages_per_group
        self.total_pages = g.total_pages
        self.max_step_tokens = g.max_step_tokens
        self.token_buckets = list(g.token_buckets)
        self.page_buckets = list(g.page_buckets)
        self.kv_dtype = jnp.dtype(g.kv_dtype)
        """The KV pools' dtype (`engine.kv_dtype`)."""
        self.layout = PoolLayout.for_engine(family, cfg, engine_cfg, self.max_seq_len, self.groups)

    def _lora(self, lora_cfg: LoraConfig | None, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
        """The adapter slots (`lora`; `raydeploy.lora.layout`): with `max_adapters` 0 there are none and the step
        programs take exactly the arguments they take without LoRA."""
        self.lora = LoraLayout.for_model(self.family, self.cfg, lora_cfg, model_cfg.param_dtype)
        """The adapter slots' layout, or None (LoRA off)."""
        self.lora_abstract: tuple[Any, Any] | None = None
        """The step programs' adapter argument (`LoraWeights`, slot_adapter [max_slots] int32) as
        ShapeDtypeStructs, or None."""
        if self.lora is None:
            return
        if engine_cfg.speculative.method == "draft":
            raise ValueError(f"lora.max_adapters {self.lora.slots} with engine.speculative.method draft: the draft "
                             f"method does not run adapters yet; use ngram, or set one of them off")
        self.lora_abstract = (self.lora.abstract(self.mesh, self.rules),
                              jax.ShapeDtypeStruct((self.max_slots,), jnp.int32, sharding=self.replicated))

    def _shardings(self, family: Family, cfg: Any, mesh: jax.sharding.Mesh) -> None:
        """The KV pools', the repetition-penalty sets' and the step inputs' shardings."""
        mesh_shape = dict(mesh.shape)
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
        dp = _axes_entry(self.dp_axes)
        self.sharded_1d = NamedSharding(mesh, PartitionSpec(dp))
        self.sharded_2d = NamedSharding(mesh, PartitionSpec(dp, None))
        # the slots' last tokens live on their group's devices, like the slots' pages and repetition-penalty sets;
        # so do a pass's packed results [2, G*R] (rows over dp): the passes of a plan need nothing from another
        # group, and `gather_results` brings the plan's results together once, not in every pass
        self.sharded_rows = NamedSharding(mesh, PartitionSpec(None, dp))

    # -- what the kernel choice and the jitted bodies hold
    @property
    def kernel_layout(self) -> str:
        return self.kernels.kernel_layout

    @property
    def native_matmul(self) -> str | None:
        return self.kernels.native_matmul

    @property
    def pack_weights(self) -> str | None:
        return self.kernels.pack_weights

    @property
    def packable(self) -> Mapping[str, int]:
        return self.kernels.packable

    @property
    def stacked_matmul(self) -> str | None:
        return self.kernels.stacked_matmul

    @property
    def gather_results(self) -> Any:
        """The packed results of a plan's passes [steps, 2, G*R], replicated: the one collective between the
        groups per plan (a dp-only mesh's passes have none)."""
        return self.bodies.gather_results

    @property
    def presence_row(self) -> Any:
        return self.bodies.presence_row

    def model(self, leaves: list[jax.Array]) -> Any:
        return self.bodies.model(leaves)

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

    # -- the list of programs
    def shapes(self) -> list[ProgramShape]:
        """Every program bring-up compiles, in warmup order."""
        single = self.single_token_buckets
        # a pass of one token per group is always single-token: no general program for that bucket then
        general = [t for t in self.token_buckets if not (t == 1 and t in single)]
        return ([ProgramShape("step", t, p) for t in general for p in self.page_buckets]
                + [ProgramShape("step", t, p, True) for t in single for p in self.page_buckets]
                + [ProgramShape("verify", t, p) for t in self.verify_buckets for p in self.page_buckets]
                + [ProgramShape("presence")])

    @property
    def verify_buckets(self) -> list[int]:
        """Token buckets of the verify programs: the step buckets from one speculating row's places to a group's
        speculating rows beside a decode row for each of its other slots (a plan with speculating rows holds decode
        rows only); with `verify_rows`, the first is exactly one row's k + 1 places (a lone stream's verification
        computes no padding place). None without speculation."""
        if not self.spec_tokens:
            return []
        k, s, b = self.spec_tokens, self.spec_rows, self.token_buckets
        most = min(s * (k + 1) + self.slots_per_group - s, self.max_step_tokens)
        if not self.verify_rows:
            return b[bisect.bisect_left(b, 2):bisect.bisect_left(b, most) + 1]
        first = min(k + 1, most)
        return [first, *b[bisect.bisect_right(b, first):bisect.bisect_left(b, most) + 1]]

    def spec_rows_for(self, tokens: int) -> int:
        """Speculating rows per group the verify program of `tokens` places holds (its `SpecInputs` rows, each of
        k + 1 verification places whose logits it computes): as many as its places fit at k + 1 each (at least
        one), every row (`spec_rows`) in the largest."""
        buckets = self.verify_buckets
        if buckets and tokens >= buckets[-1]:
            return self.spec_rows
        return min(self.spec_rows, max(1, tokens // (self.spec_tokens + 1)))

    def verify_bucket(self, tokens: int, rows: int) -> int:
        """The verify program for a pass of `tokens` places per group (the most of any group) of which `rows`
        rows per group (the most) speculate: the smallest that holds both."""
        for t in self.verify_buckets:
            if t >= tokens and self.spec_rows_for(t) >= rows:
                return t
        raise ValueError(f"a verify pass of {tokens} token places and {rows} speculating rows per dp group exceeds "
                         f"the largest verify program ({self.verify_buckets[-1] if self.verify_buckets else 0} "
                         f"places, {self.spec_rows} rows)")

    def spec_shardings(self) -> dict[str, Any]:
        """The verify programs' `SpecInputs` shardings by flat name."""
        return {n: self.replicated if lay == "replicated" else self.sharded_1d for n, lay in verify.SPEC_LAYOUT.items()}

    def abstract_spec(self, tokens: int) -> verify.SpecInputs:
        """The `SpecInputs` of the verify program of `tokens` places."""
        shard = self.spec_shardings()
        shapes = verify.abstract_spec_inputs(self.groups, self.spec_rows_for(tokens), self.spec_tokens)
        return verify.spec_from_flat({n: jax.ShapeDtypeStruct(s, d, sharding=shard[n]) for n, (s, d) in shapes.items()})

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
        """Sequence rows per group of a step program with `tokens` places: no more rows than tokens or slots."""
        return min(tokens, self.slots_per_group)

    def rows_of(self, shape: ProgramShape) -> int:
        """Sequence rows per group of a program: `rows_for`, but a row per place in a verify program whose
        speculating rows are verified as one-token rows (`verify_rows`)."""
        if shape.kind == "verify" and self.verify_rows:
            return shape.tokens
        return self.rows_for(shape.tokens)

    def input_shardings(self) -> dict[str, Any]:
        out = {}
        for name, layout in FIELD_LAYOUT.items():
            out[name] = (self.replicated if layout == "replicated"
                         else self.sharded_2d if name in ("page_indices", "ring_page_indices", "allowed") else self.sharded_1d)
        return out

    def abstract_inputs(self, tokens: int, pages: int, rows: int | None = None) -> StepInputs:
        shard = self.input_shardings()
        rows = self.rows_for(tokens) if rows is None else rows
        shapes = abstract_inputs(self.groups, tokens, rows, pages, self.max_slots,
                                 self.cfg.vocab_size)
        fields: dict[str, Any] = {n: jax.ShapeDtypeStruct(s, d, sharding=shard[n]) for n, (s, d) in shapes.items()}
        return StepInputs.from_flat(fields)

    def abstract_state(self) -> tuple[Any, ...]:
        """((params, packed weights), pools, presence, last tokens) as ShapeDtypeStructs."""
        pool = abstract_pools(self.pool_shapes, self.kv_dtype, self.pool_sharding)
        presence = jax.ShapeDtypeStruct((self.max_slots, self.cfg.vocab_size), STATE_DTYPE,
                                        sharding=self.presence_sharding)
        last = jax.ShapeDtypeStruct((self.max_slots,), jnp.int32, sharding=self.sharded_1d)
        weights: tuple[Any, ...] = (self.abstract_params, self.packed)
        if self.lora_abstract is not None:  # the adapters ride with the weights (`StepBodies`: `_lora_arg`)
            weights = (*weights, self.lora_abstract)
        return weights, pool, presence, last

    def unrolled(self, shape: ProgramShape) -> bool:
        """Whether this step program runs the layers unrolled over per-layer weight arrays (`step_unrolled`)."""
        return shape.kind == "step" and shape.tokens in self.unrolled_tokens

    def abstract_args(self, shape: ProgramShape) -> tuple[Any, tuple[Any, ...]]:
        """(jitted function, its abstract arguments) for one program."""
        params, pool, presence, last = self.abstract_state()
        if shape.kind == "presence":
            return self.bodies.presence_row, (presence, jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated),
                                       jax.ShapeDtypeStruct((self.cfg.vocab_size,), jnp.bool_,
                                                            sharding=self.replicated))
        inputs = self.abstract_inputs(shape.tokens, shape.pages, self.rows_of(shape))
        if shape.kind == "verify":
            return self.bodies.verify, (params, pool, presence, last, inputs, self.abstract_spec(shape.tokens))
        if self.unrolled(shape):
            leaves = params[0]
            per_layer = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=_layer_sharding(x.sharding))
                         for x in (leaves[i] for i in self.layer_leaves)]
            n = leaves[self.layer_leaves[0]].shape[0]
            fn = self.bodies.step_unrolled_single if shape.single_token else self.bodies.step_unrolled
            return fn, ((params, [per_layer] * n), pool, presence, last, inputs)
        return (self.bodies.step_single if shape.single_token else self.bodies.step), (params, pool, presence, last, inputs)

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
