"""The one description of every jitted program an engine runs, from shapes and shardings alone.

`ProgramSet` holds the model's graph, the shardings of every input, and the jitted bodies of the three
program families:
- `prefill_{bucket}`: one prompt padded to a prefill bucket (its true length carried explicitly; the pad id is
  also the eos id in chat prompts, so padding is never inferred from tokens); writes the prompt's K/V into
  its slot of the donated stacked cache, resets the slot's repetition-penalty token set, samples token 0.
- `decode_{window}x{rows}`: one token for the first `rows` slots of every slot group, attending over the first
  `window` cache positions.
- `gather_{rows}`: replicates a plan's decode results to every host in one collective (a plan of fewer than
  `decode_steps` steps pads its list, so one program serves every plan length).

The real `Engine` calls these bodies with real arrays; `abstract_args(name)` gives the same calls'
arguments as `jax.ShapeDtypeStruct`s with the same shardings, so `raydeploy compile` lowers exactly the
programs bring-up will run (for any mesh, including the devices of a deviceless TPU topology) without
allocating anything or reading a weight. Neither can drift from the other: there is no second description.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.config import EngineConfig, ModelConfig
from raydeploy.engine.kv_slots import kv_cache_sharding
from raydeploy.engine.sampling import sample
from raydeploy.model.llama import DTYPES, ActivationSharding, abstract_model, engine_param_specs
from raydeploy.model.sharding import partition_spec
from raydeploy.model.spec import LlamaConfig, kv_cache_spec

PREFILL_INTS = 4
"""Trailing ints after a prefill's tokens: length, slot, top_k, seed."""
DECODE_INT_ROWS = 5
"""Rows of a decode's int input: positions, active, top_k, seed, any-row-samples flag."""
SAMPLING_FLOATS = 3
"""temperature, top_p, repetition penalty."""


def resolve_kernel_layout(kernel_layout: str, param_dtype: str, platform: str) -> str:
    """`EngineConfig.kernel_layout` with auto resolved: out_in for bfloat16 weights on CPU (measured on the
    demo model, 8 decode rows: the bfloat16 projections take ~10 GB/s in_out, the [V, D]-shaped tied LM head
    ~16 GB/s), in_out elsewhere (float32 on CPU is faster in_out; TPU/GPU compilers choose their own layouts)."""
    if kernel_layout != "auto":
        return kernel_layout
    return "out_in" if param_dtype == "bfloat16" and platform == "cpu" else "in_out"


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


MIN_DECODE_WINDOW = 256
"""Smallest decode window: below it the window's cache read is a few percent of a step's weight read (demo
model, 4 rows, window 256: 18 MB of K/V against 538 MB of weights), not worth a program of its own."""


def default_decode_windows(max_seq_len: int, prefill_buckets: Sequence[int]) -> list[int]:
    """Decode attention windows: every fourth power of two from `MIN_DECODE_WINDOW` (or the smallest bucket,
    if larger), capped by max_seq_len.

    Fewer windows compile faster; a window at most 4x the live length keeps the cache read small.
    """
    w = max(MIN_DECODE_WINDOW, min(prefill_buckets)) if prefill_buckets else max_seq_len
    out = []
    while w < max_seq_len:
        out.append(w)
        w *= 4
    return out + [max_seq_len]


def pack(tokens: jax.Array, logprobs: jax.Array) -> jax.Array:
    """[2, B] float32: the tokens' int32 bits and their logprobs, so a step returns (and, across processes,
    gathers) one array, not two."""
    return jnp.stack([jax.lax.bitcast_convert_type(tokens, jnp.float32), logprobs])


@dataclass(frozen=True)
class ProgramShape:
    """One program: its family and static sizes."""

    kind: str  # prefill | decode | gather
    bucket: int = 0
    window: int = 0
    rows: int = 0
    steps: int = 0

    @property
    def name(self) -> str:
        if self.kind == "prefill":
            return f"prefill_{self.bucket}"
        if self.kind == "decode":
            return f"decode_{self.window}x{self.rows}"
        return f"gather_{self.rows}"


class ProgramSet:
    """Every program of one engine configuration over one mesh: shardings, jitted bodies, abstract inputs."""

    def __init__(self, llama_cfg: LlamaConfig, mesh: jax.sharding.Mesh, rules: dict[str, Any],
                 model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 decode_windows: Sequence[int] | None = None) -> None:
        self.cfg = llama_cfg
        self.mesh = mesh
        self.rules = dict(rules)
        self.max_slots = engine_cfg.max_slots
        self.max_seq_len = model_cfg.max_seq_len
        self.buckets = sorted({min(b, self.max_seq_len) for b in engine_cfg.prefill_buckets})
        windows = decode_windows or default_decode_windows(self.max_seq_len, self.buckets)
        self.windows = sorted({min(w, self.max_seq_len) for w in windows} | {self.max_seq_len})
        self.dtype = DTYPES[model_cfg.dtype]
        self.param_dtype = DTYPES[model_cfg.param_dtype]
        platform = mesh.devices.flat[0].platform
        self.kernel_layout = resolve_kernel_layout(engine_cfg.kernel_layout, model_cfg.param_dtype, platform)
        self.graphdef, abstract_state = abstract_model(llama_cfg, model_cfg.dtype, model_cfg.param_dtype,
                                                       self.kernel_layout)
        leaves, self.param_treedef = jax.tree.flatten(abstract_state)
        mesh_shape = dict(mesh.shape)
        specs = engine_param_specs(llama_cfg, self.kernel_layout)
        names = [".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(abstract_state)]
        self.param_shardings = [NamedSharding(mesh, partition_spec(specs[n].logical_axes, self.rules, mesh_shape, n))
                                for n in names]
        self.abstract_params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                for x, s in zip(leaves, self.param_shardings, strict=True)]
        self.shard = ActivationSharding.create(mesh, self.rules)
        self.cache_sharding = kv_cache_sharding(llama_cfg, self.max_slots, self.max_seq_len, mesh, self.rules)
        self.cache_shape = kv_cache_spec(llama_cfg, self.max_slots, self.max_seq_len).shape
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.presence_sharding = NamedSharding(
            mesh, partition_spec(("cache_batch", "act_vocab"), self.rules, mesh_shape, "presence"))
        self.groups = self.shard.slot_groups
        self.group_size = self.max_slots // self.groups
        # XLA CPU multiplies a single bfloat16 row through a slow path (~5x slower than two rows): decode at
        # least two rows per group there.
        slow_single_row = self.param_dtype == jnp.bfloat16 and platform == "cpu"
        self.decode_rows = default_decode_rows(self.group_size, 2 if slow_single_row else 1)
        self.decode_steps = engine_cfg.decode_steps
        slot_axes = self.shard.slot_axes or None
        self.rows_sharding = NamedSharding(mesh, PartitionSpec(slot_axes))  # [B] over the slot groups
        self.result_sharding = NamedSharding(mesh, PartitionSpec(None, slot_axes))  # [2, B]
        cache_sh = self.cache_sharding
        self.prefill = jax.jit(self._prefill_fn, donate_argnums=(1, 2, 3),
                               out_shardings=(cache_sh, cache_sh, self.presence_sharding, self.replicated))
        # A decode step's tokens and results stay on the devices of their rows (the next step of the same plan
        # reads the tokens there); `gather` replicates a whole plan's results at once: one collective.
        self.decode = jax.jit(
            self._decode_fn, static_argnums=(7, 8), donate_argnums=(1, 2, 3),
            out_shardings=(cache_sh, cache_sh, self.presence_sharding, self.rows_sharding, self.result_sharding))
        self.gather = jax.jit(jnp.stack, out_shardings=self.replicated)

    # -- the list of programs
    def shapes(self) -> list[ProgramShape]:
        """Every program bring-up compiles, in warmup order."""
        out = [ProgramShape("prefill", bucket=b) for b in self.buckets]
        out += [ProgramShape("decode", window=w, rows=r) for w in self.windows for r in self.decode_rows]
        out += [ProgramShape("gather", steps=self.decode_steps, rows=r) for r in self.decode_rows]
        return out

    def prefill_shape(self, bucket: int) -> ProgramShape:
        return ProgramShape("prefill", bucket=bucket)

    def decode_shape(self, window: int, rows: int) -> ProgramShape:
        return ProgramShape("decode", window=window, rows=rows)

    def gather_shape(self, rows: int) -> ProgramShape:
        return ProgramShape("gather", steps=self.decode_steps, rows=rows)

    # -- jitted bodies
    def model(self, leaves: list[jax.Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, leaves))

    def _prefill_fn(self, leaves, k_cache, v_cache, presence, ints, floats):
        """ints: [tokens (bucket)..., length, slot, top_k, seed]; floats: [temperature, top_p, penalty]."""
        model = self.model(leaves)
        t = ints.shape[0] - PREFILL_INTS
        tokens = ints[:t][None]
        length, slot, top_k = ints[t], ints[t + 1], ints[t + 2]
        seed = jax.lax.bitcast_convert_type(ints[t + 3], jnp.uint32)
        h, ks, vs = model.prefill(tokens, jnp.arange(t)[None], self.shard)
        last = jax.lax.dynamic_index_in_dim(h[0], length - 1, axis=0, keepdims=True)  # [1, D]
        logits = model.logits(last)
        valid = jnp.arange(t) < length
        row = jnp.zeros((self.cfg.vocab_size,), bool).at[tokens[0]].max(valid)
        tok, lp = sample(logits, row[None], floats[0:1], floats[1:2], top_k[None], floats[2:3], seed[None],
                         length[None], floats[0] > 0)
        row = row.at[tok[0]].set(True)
        presence = jax.lax.dynamic_update_slice(presence, row[None], (slot, 0))
        zero = jnp.zeros((), jnp.int32)
        k_cache = jax.lax.dynamic_update_slice(k_cache, ks.astype(k_cache.dtype), (zero, slot, zero, zero, zero))
        v_cache = jax.lax.dynamic_update_slice(v_cache, vs.astype(v_cache.dtype), (zero, slot, zero, zero, zero))
        return k_cache, v_cache, presence, pack(tok, lp)

    def _decode_fn(self, leaves, k_cache, v_cache, presence, tokens, ints, floats, window, rows):
        """The first `rows` slots of each group decode one token (B = groups * rows decoded rows).

        tokens: [B] inputs (the previous step's outputs, on their rows' devices); ints: [5, B] = positions,
        active, top_k, seed, any-row-samples flag (the same in every column); floats: [3, B] = temperature,
        top_p, penalty. Returns the caches, presence, the next tokens [B] and packed results [2, B].
        """
        model = self.model(leaves)
        positions, active, top_k = ints[0], ints[1].astype(bool), ints[2]
        seed = jax.lax.bitcast_convert_type(ints[3], jnp.uint32)
        g, v = self.groups, presence.shape[1]
        h, k_cache, v_cache = model.decode(tokens, positions, k_cache, v_cache, window, self.shard)
        logits = model.logits(h, self.shard)
        grouped = presence.reshape(g, -1, v)
        seen = grouped[:, :rows].reshape(g * rows, v)
        tok, lp = sample(logits, seen, floats[0], floats[1], top_k, floats[2], seed, positions + 1, ints[4, 0] > 0)
        # Elementwise (not a scatter), so each device updates only the rows and vocab columns it holds.
        chosen = jnp.arange(v)[None, :] == tok[:, None]
        seen = seen | (chosen & active[:, None])
        presence = grouped.at[:, :rows].set(seen.reshape(g, rows, v)).reshape(presence.shape)
        return k_cache, v_cache, presence, tok, pack(tok, lp)

    # -- abstract inputs (the same shapes, dtypes and shardings as the engine's real calls)
    def abstract_state(self) -> tuple[Any, ...]:
        """(params, k_cache, v_cache, presence) as ShapeDtypeStructs."""
        cache = jax.ShapeDtypeStruct(self.cache_shape, self.dtype, sharding=self.cache_sharding)
        presence = jax.ShapeDtypeStruct((self.max_slots, self.cfg.vocab_size), jnp.bool_,
                                        sharding=self.presence_sharding)
        return self.abstract_params, cache, cache, presence

    def abstract_args(self, shape: ProgramShape) -> tuple[Any, tuple[Any, ...]]:
        """(jitted function, its abstract arguments) for one program."""
        rep = self.replicated
        if shape.kind == "prefill":
            return self.prefill, (*self.abstract_state(),
                                  jax.ShapeDtypeStruct((shape.bucket + PREFILL_INTS,), jnp.int32, sharding=rep),
                                  jax.ShapeDtypeStruct((SAMPLING_FLOATS,), jnp.float32, sharding=rep))
        b = self.groups * shape.rows
        if shape.kind == "decode":
            return self.decode, (*self.abstract_state(),
                                 jax.ShapeDtypeStruct((b,), jnp.int32, sharding=self.rows_sharding),
                                 jax.ShapeDtypeStruct((DECODE_INT_ROWS, b), jnp.int32, sharding=rep),
                                 jax.ShapeDtypeStruct((SAMPLING_FLOATS, b), jnp.float32, sharding=rep),
                                 shape.window, shape.rows)
        out = jax.ShapeDtypeStruct((2, b), jnp.float32, sharding=self.result_sharding)
        return self.gather, ([out] * shape.steps,)

    def lower(self, shape: ProgramShape) -> Any:
        """The program lowered for this mesh (compile it with `.compile()`)."""
        fn, args = self.abstract_args(shape)
        return fn.lower(*args)
