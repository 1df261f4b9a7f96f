"""The paged engine: one mixed ragged step program over a paged KV cache, one `StepPlan` at a time.

A step computes, for every dp group, the new tokens of that group's sequences in one flat ragged batch:
prefill chunks of several tokens and decode rows of one token each, at explicit positions. Per layer, inside
the layer scan, each group gathers the pages its sequences use from the loop-invariant pool into a compact
view, places this step's new K/V in it, and calls the attention backend (`raydeploy.engine.attention`, jax's
ragged paged attention signature) inside `jax.shard_map` (sequences and pages over dp, heads over tp). After
the scan, every layer's new K/V are scattered into the pool in one write (the pool is never carried through
the scan: XLA copied a carried cache whole). Logits are computed only at each sequence's last token of the
step, and sampling is fused. A prompt is prefilled only on the dp group that owns its slot.

Programs (`PagedProgramSet.shapes()`): `step_{T}x{P}` for each token bucket T (tokens per dp group: powers of
four up to the group's slots for decode, and `engine.prefill_chunk` for mixed steps) and page bucket P (pages
gathered per sequence), plus `presence_row` (a request that starts from reused prefix pages gets its
repetition-penalty set from the host).
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.config import EngineConfig, ModelConfig
from raydeploy.engine import compile_cache
from raydeploy.engine.kv_cache import (
    FIELD_LAYOUT,
    PageTables,
    StepInputs,
    abstract_inputs,
    allocate_pool,
    build_inputs,
    pool_sharding,
)
from raydeploy.engine.programs import default_decode_rows, pack, resolve_kernel_layout
from raydeploy.engine.sampling import sample
from raydeploy.engine.step import SeqStep, StepPlan, StepResult
from raydeploy.model.llama import (
    DTYPES,
    ActivationSharding,
    abstract_model,
    build_model,
    engine_param_specs,
    stack_layers,
)
from raydeploy.model.sharding import partition_spec
from raydeploy.model.spec import LlamaConfig, kv_pool_spec, pages_per_seq, resolve_num_pages

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


@dataclass(frozen=True)
class StepShape:
    """One program: `step` with T token places per dp group and P pages per sequence, or `presence_row`."""

    kind: str
    tokens: int = 0
    pages: int = 0

    @property
    def name(self) -> str:
        return f"step_{self.tokens}x{self.pages}" if self.kind == "step" else self.kind


def _interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """K and V [N, K, H] -> [N, 2K, H] interleaved on the head axis (k0, v0, k1, v1, ...)."""
    n, kh, h = k.shape
    return jnp.stack([k, v], axis=2).reshape(n, 2 * kh, h)


def _axes_entry(axes: Sequence[str]) -> Any:
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def default_attention(name: str, platform: str) -> AttentionFn:
    from raydeploy.engine.attention import get_backend

    return get_backend(name, platform)


class PagedProgramSet:
    """Every program of one paged engine configuration over one mesh: shardings, jitted bodies, abstract inputs."""

    def __init__(self, llama_cfg: LlamaConfig, mesh: jax.sharding.Mesh, rules: dict[str, Any],
                 model_cfg: ModelConfig, engine_cfg: EngineConfig, attention: AttentionFn | None = None) -> None:
        self.cfg = llama_cfg
        self.mesh = mesh
        self.rules = dict(rules)
        self.max_slots = engine_cfg.max_slots
        self.max_seq_len = model_cfg.max_seq_len
        self.dtype = DTYPES[model_cfg.dtype]
        self.param_dtype = DTYPES[model_cfg.param_dtype]
        platform = mesh.devices.flat[0].platform
        self.platform = platform
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
        self.dp_axes = self.shard.slot_axes
        self.groups = self.shard.slot_groups
        if self.max_slots % self.groups:
            raise ValueError(f"engine.max_slots {self.max_slots} is not divisible by the {self.groups} dp groups")
        self.slots_per_group = self.max_slots // self.groups
        self.page_size = engine_cfg.page_size
        self.max_pages_per_seq = pages_per_seq(self.max_seq_len, self.page_size)
        self.pages_per_group = resolve_num_pages(engine_cfg.num_pages, self.slots_per_group, self.max_seq_len,
                                                 self.page_size)
        self.total_pages = self.pages_per_group * self.groups
        self.pool_sharding = pool_sharding(llama_cfg, self.total_pages, self.page_size, mesh, self.rules)
        self.pool_shape = kv_pool_spec(llama_cfg, self.total_pages, self.page_size).shape
        heads = self.pool_sharding.spec[3]
        self.head_axes: tuple[str, ...] = () if heads is None else ((heads,) if isinstance(heads, str) else tuple(heads))
        n_head_shards = math.prod(mesh_shape[a] for a in self.head_axes)
        if llama_cfg.num_heads % n_head_shards:
            raise ValueError(f"{llama_cfg.num_heads} attention heads do not split over the {n_head_shards} shards "
                             f"of the kv heads (mesh.rules.cache_kv_heads)")
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.presence_sharding = NamedSharding(
            mesh, partition_spec(("cache_batch", "act_vocab"), self.rules, mesh_shape, "presence"))
        slow_single_row = self.param_dtype == jnp.bfloat16 and platform == "cpu"
        decode = default_decode_rows(self.slots_per_group, 2 if slow_single_row else 1)
        self.max_step_tokens = max(engine_cfg.prefill_chunk, self.slots_per_group)
        self.token_buckets = sorted(set(decode) | {self.max_step_tokens})
        self.page_buckets = default_page_buckets(self.max_pages_per_seq, self.page_size)
        self.attention = attention or default_attention(engine_cfg.attention, platform)
        self.sm_scale = 1.0 / math.sqrt(llama_cfg.head_dim)
        self.in_place = os.environ.get("RAYDEPLOY_KV_IN_PLACE", "0") == "1"  # measurement switch (temporary)
        dp = _axes_entry(self.dp_axes)
        self.sharded_1d = NamedSharding(mesh, PartitionSpec(dp))
        self.sharded_2d = NamedSharding(mesh, PartitionSpec(dp, None))
        self.step = jax.jit(self._step_fn, donate_argnums=(1, 2, 3),
                            out_shardings=(self.pool_sharding, self.presence_sharding, self.replicated,
                                           self.replicated))
        self.presence_row = jax.jit(lambda presence, slot, row: presence.at[slot].set(row), donate_argnums=(0,),
                                    out_shardings=self.presence_sharding)

    # -- the list of programs
    def shapes(self) -> list[StepShape]:
        """Every program bring-up compiles, in warmup order."""
        return ([StepShape("step", t, p) for t in self.token_buckets for p in self.page_buckets]
                + [StepShape("presence_row")])

    def rows_for(self, tokens: int) -> int:
        """Sequence rows per group of a program with `tokens` places: no more rows than tokens or slots."""
        return min(tokens, self.slots_per_group)

    def input_shardings(self) -> dict[str, Any]:
        out = {}
        for name, layout in FIELD_LAYOUT.items():
            out[name] = (self.replicated if layout == "replicated"
                         else self.sharded_2d if name == "page_indices" else self.sharded_1d)
        return out

    def abstract_inputs(self, tokens: int, pages: int) -> StepInputs:
        shard = self.input_shardings()
        shapes = abstract_inputs(self.groups, tokens, self.rows_for(tokens), pages, self.max_slots)
        return StepInputs(**{n: jax.ShapeDtypeStruct(s, d, sharding=shard[n]) for n, (s, d) in shapes.items()})

    def abstract_state(self) -> tuple[Any, ...]:
        """(params, pool, presence, last tokens) as ShapeDtypeStructs."""
        pool = jax.ShapeDtypeStruct(self.pool_shape, self.dtype, sharding=self.pool_sharding)
        presence = jax.ShapeDtypeStruct((self.max_slots, self.cfg.vocab_size), jnp.bool_,
                                        sharding=self.presence_sharding)
        last = jax.ShapeDtypeStruct((self.max_slots,), jnp.int32, sharding=self.replicated)
        return self.abstract_params, pool, presence, last

    def abstract_args(self, shape: StepShape) -> tuple[Any, tuple[Any, ...]]:
        """(jitted function, its abstract arguments) for one program."""
        _, _, presence, _ = self.abstract_state()
        if shape.kind == "presence_row":
            return self.presence_row, (presence, jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated),
                                       jax.ShapeDtypeStruct((self.cfg.vocab_size,), jnp.bool_,
                                                            sharding=self.replicated))
        return self.step, (*self.abstract_state(), self.abstract_inputs(shape.tokens, shape.pages))

    def lower(self, shape: StepShape) -> Any:
        fn, args = self.abstract_args(shape)
        return fn.lower(*args)

    # -- jitted bodies
    def model(self, leaves: list[jax.Array]) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.param_treedef, leaves))

    def _manual(self, fn: Callable[..., Any], in_specs: tuple[Any, ...], out_specs: Any) -> Callable[..., Any]:
        """fn per (dp group, head shard) under shard_map; called directly when neither axis is split."""
        axes = frozenset(self.dp_axes) | frozenset(self.head_axes)
        if not axes:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axes,
                             check_vma=False)

    def _attend(self, pool: jax.Array, inp: StepInputs) -> Callable[..., Any]:
        """The per-layer attention of the ragged forward (pool read-only, carried cache unused): gather each
        row's pages into a compact view, place the step's new K/V in it, call the backend on the view."""
        dp, hd = _axes_entry(self.dp_axes), _axes_entry(self.head_axes)
        ps = self.page_size
        window = self.cfg.sliding_window or None

        def local(q, kv, pool, layer, view_page, offset, kv_lens, page_indices, cu_q_lens, num_seqs):
            rows, pages = page_indices.shape
            view = pool[layer, page_indices]  # [R, P, ps, 2K, H]: only the pages these rows use
            view = view.reshape(rows * pages, ps, *view.shape[-2:])
            view = view.at[view_page, offset].set(kv, mode="drop")
            table = jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages)
            return self.attention(q, view, kv_lens, table, cu_q_lens, num_seqs, sm_scale=self.sm_scale,
                                  sliding_window=window)

        sharded = self._manual(
            local,
            in_specs=(PartitionSpec(dp, hd, None), PartitionSpec(dp, hd, None),
                      PartitionSpec(None, dp, None, hd, None), PartitionSpec(), PartitionSpec(dp),
                      PartitionSpec(dp), PartitionSpec(dp), PartitionSpec(dp, None), PartitionSpec(dp),
                      PartitionSpec(dp)),
            out_specs=PartitionSpec(dp, hd, None))

        def attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, carried: Any) -> tuple[jax.Array, Any]:
            kv = _interleave(k, v).astype(pool.dtype)
            out = sharded(q, kv, pool, layer, inp.view_page, inp.write_offset, inp.kv_lens, inp.page_indices,
                          inp.cu_q_lens, inp.num_seqs)
            return out.astype(q.dtype), carried

        return attend

    def _attend_in_place(self, inp: StepInputs) -> Callable[..., Any]:
        """The per-layer attention with the pool carried through the scan: write the layer's new K/V into its
        pages, then call the backend on the layer's pool with the real page tables."""
        dp, hd = _axes_entry(self.dp_axes), _axes_entry(self.head_axes)
        window = self.cfg.sliding_window or None

        def local(q, kv, pool, layer, page, offset, kv_lens, page_indices, cu_q_lens, num_seqs):
            pool = pool.at[layer, page, offset].set(kv, mode="drop")
            out = self.attention(q, pool[layer], kv_lens, page_indices, cu_q_lens, num_seqs,
                                 sm_scale=self.sm_scale, sliding_window=window)
            return out, pool

        pool_spec = PartitionSpec(None, dp, None, hd, None)
        sharded = self._manual(
            local,
            in_specs=(PartitionSpec(dp, hd, None), PartitionSpec(dp, hd, None), pool_spec, PartitionSpec(),
                      PartitionSpec(dp), PartitionSpec(dp), PartitionSpec(dp), PartitionSpec(dp, None),
                      PartitionSpec(dp), PartitionSpec(dp)),
            out_specs=(PartitionSpec(dp, hd, None), pool_spec))

        def attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, pool: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
            kv = _interleave(k, v).astype(pool.dtype)
            out, pool = sharded(q, kv, pool, layer, inp.write_page, inp.write_offset, inp.kv_lens,
                                inp.page_indices, inp.cu_q_lens, inp.num_seqs)
            return out.astype(q.dtype), pool

        return attend

    def _write(self, pool: jax.Array, ks: jax.Array, vs: jax.Array, inp: StepInputs) -> jax.Array:
        """Every layer's new K/V [L, N, K, H] into the pool at the tokens' pages and offsets (one scatter)."""
        dp, hd = _axes_entry(self.dp_axes), _axes_entry(self.head_axes)
        layers, n, kh, h = ks.shape
        new = jax.vmap(_interleave)(ks, vs).astype(pool.dtype)

        def local(pool, new, page, offset):
            return pool.at[:, page, offset].set(new, mode="drop")

        return self._manual(local, in_specs=(PartitionSpec(None, dp, None, hd, None), PartitionSpec(None, dp, hd, None),
                                             PartitionSpec(dp), PartitionSpec(dp)),
                            out_specs=PartitionSpec(None, dp, None, hd, None))(pool, new, inp.write_page,
                                                                                inp.write_offset)

    def _step_fn(self, leaves, pool, presence, last_tokens, inp: StepInputs):
        """One ragged step. Returns the pool, the repetition-penalty sets, the slots' last tokens and the packed
        results [2, G*R] (token bits, logprob) of every row."""
        model = self.model(leaves)
        g = self.groups
        t = inp.tokens.shape[0] // g
        r = inp.kv_lens.shape[0] // g
        ms = self.max_slots
        tokens = jnp.where(inp.from_last >= 0, last_tokens[jnp.maximum(inp.from_last, 0)], inp.tokens)
        if self.in_place:
            h, _, _, pool = model.ragged(tokens, inp.positions, self._attend_in_place(inp), self.shard, pool)
        else:
            h, ks, vs, _ = model.ragged(tokens, inp.positions, self._attend(pool, inp), self.shard)
            pool = self._write(pool, ks, vs, inp)
        hg = h.reshape(g, t, h.shape[-1])
        last = jnp.take_along_axis(hg, inp.logit_index.reshape(g, r, 1), axis=1).reshape(g * r, h.shape[-1])
        logits = model.logits(last, self.shard)
        presence = presence & ~inp.reset[:, None]
        presence = presence.at[inp.token_slot, tokens].set(True, mode="drop")
        seen = presence[jnp.minimum(inp.row_slot, ms - 1)]
        tok, lp = sample(logits, seen, inp.temperature, inp.top_p, inp.top_k, inp.repetition_penalty, inp.seed,
                         inp.sample_position, inp.any_sampled)
        presence = presence.at[inp.row_slot, tok].set(True, mode="drop")
        last_tokens = last_tokens.at[inp.row_slot].set(tok, mode="drop")
        return pool, presence, last_tokens, pack(tok, lp)


def compile_threads(configured: int, platform: str) -> int:
    """`EngineConfig.compile_threads` with auto (0) resolved for this host."""
    if configured > 0:
        return configured
    return 1 if platform == "cpu" else max(1, min(8, os.cpu_count() or 1))


class PagedEngine:
    """One model replica over one mesh (possibly several processes): a paged KV pool per dp group and
    `max_slots` page-table rows. `step(plan)` runs the plan's mixed ragged step (and, for a decode-only plan,
    `decode_steps` of them with no host round trip between)."""

    def __init__(self, llama_cfg: LlamaConfig, params: Mapping[str, jax.Array], mesh: jax.sharding.Mesh,
                 rules: Mapping[str, Any], model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 attention: AttentionFn | None = None) -> None:
        if not compile_cache.configured():  # a gang host configured it for its platform before joining
            compile_cache.enable(engine_cfg.compilation_cache_dir)
        self.programs_set = ps = PagedProgramSet(llama_cfg, mesh, dict(rules), model_cfg, engine_cfg, attention)
        self.cfg = llama_cfg
        self.mesh = mesh
        self.decode_steps = engine_cfg.decode_steps
        params = stack_layers(llama_cfg, params, ps.kernel_layout, mesh, ps.rules)
        _, state = build_model(llama_cfg, params, model_cfg.dtype, model_cfg.param_dtype, ps.kernel_layout)
        del params
        self._param_leaves = jax.tree.leaves(state)
        self.pool = allocate_pool(llama_cfg, ps.total_pages, ps.page_size, ps.dtype, mesh, ps.rules)
        self.presence = jax.jit(lambda: jnp.zeros((ps.max_slots, llama_cfg.vocab_size), bool),
                                out_shardings=ps.presence_sharding)()
        self.last_tokens = jax.jit(lambda: jnp.zeros((ps.max_slots,), jnp.int32), out_shardings=ps.replicated)()
        self.tables = PageTables(ps.max_slots, ps.groups, ps.max_pages_per_seq, ps.pages_per_group)
        self._active = np.zeros(ps.max_slots, bool)  # slot-form plans: slots holding a request
        self._lengths = np.zeros(ps.max_slots, np.int64)  # slot-form plans: tokens in each slot's cache
        self._shardings = ps.input_shardings()
        self._executables: dict[StepShape, Any] = {}
        self.compile_s: dict[str, float] = {}
        self.programs: dict[str, dict[str, Any]] = {}

    # -- what the scheduler reads
    @property
    def max_slots(self) -> int:
        return self.programs_set.max_slots

    @property
    def max_seq_len(self) -> int:
        return self.programs_set.max_seq_len

    @property
    def page_size(self) -> int:
        return self.programs_set.page_size

    @property
    def pages_per_group(self) -> int:
        return self.programs_set.pages_per_group

    @property
    def slots_per_group(self) -> int:
        return self.programs_set.slots_per_group

    @property
    def groups(self) -> int:
        return self.programs_set.groups

    dp_groups = groups

    @property
    def max_pages_per_seq(self) -> int:
        return self.programs_set.max_pages_per_seq

    @property
    def max_step_tokens(self) -> int:
        return self.programs_set.max_step_tokens

    @property
    def slot_order(self) -> list[int]:
        """Slots in the order to fill them: the r-th slot of every group before any group's (r+1)-th."""
        s = self.slots_per_group
        return [g * s + r for r in range(s) for g in range(self.groups)]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.cfg.eos_token_ids)

    # -- programs
    def executable(self, shape: StepShape) -> Any:
        exe = self._executables.get(shape)
        if exe is None:
            with self._program(shape.name):
                exe = self.programs_set.lower(shape).compile()
            self._executables[shape] = exe
        return exe

    def warmup(self, threads: int = 1) -> dict[str, float]:
        """Compile (or load from the persistent cache) every program of the set, without running any."""
        shapes = [s for s in self.programs_set.shapes() if s not in self._executables]
        if threads > 1 and len(shapes) > 1:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compile") as pool:
                list(pool.map(self.executable, shapes))
        else:
            for shape in shapes:
                self.executable(shape)
        return dict(self.compile_s)

    @contextmanager
    def _program(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        with compile_cache.track() as count:
            yield
        self.compile_s[name] = time.perf_counter() - t0
        self.programs[name] = {"seconds": round(self.compile_s[name], 3), "source": count.source}

    def program_counts(self) -> dict[str, int]:
        sources = [p["source"] for p in self.programs.values()]
        return {"loaded": sources.count("cache"), "compiled": sources.count("compiled")}

    # -- host side
    def _put(self, x: np.ndarray, sharding: Any) -> jax.Array:
        """A global array from host data that is identical on every host."""
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def _device_inputs(self, arrays: Mapping[str, np.ndarray]) -> StepInputs:
        return StepInputs(**{f.name: self._put(arrays[f.name], self._shardings[f.name]) for f in fields(StepInputs)})

    def _check(self, plan: StepPlan) -> None:
        ps, t = self.programs_set, self.tables
        per_group = np.zeros(ps.groups, np.int64)
        seen: set[int] = set()
        steps = plan.decode_steps
        if steps < 1:
            raise ValueError(f"plan {plan.step_id}: decode_steps must be >= 1, got {steps}")
        for q in plan.seqs:
            t.check_slot(q.slot)
            if q.slot in seen:
                raise ValueError(f"plan {plan.step_id}: slot {q.slot} has more than one sequence in the step")
            seen.add(q.slot)
            n = int(np.asarray(q.tokens).shape[0])
            if n == 0 and not (t.started[q.slot] or q.sampling is not None):
                raise ValueError(f"plan {plan.step_id}: slot {q.slot} decodes but no request was started in it")
            if n == 0 and not q.sample:
                raise ValueError(f"plan {plan.step_id}: slot {q.slot} is a decode row that does not sample")
            if n and steps > 1:
                raise ValueError(f"plan {plan.step_id}: decode_steps {steps} > 1 with a prompt chunk in slot "
                                 f"{q.slot}; only decode rows may run several steps")
            if q.start < 0 or q.start + max(n, 1) + steps - 1 > ps.max_seq_len:
                raise ValueError(f"plan {plan.step_id}: slot {q.slot} writes positions {q.start}.."
                                 f"{q.start + max(n, 1) + steps - 2}, outside max_seq_len {ps.max_seq_len}")
            if n and q.start + n > ps.max_seq_len - 1 and q.sample:
                raise ValueError(f"plan {plan.step_id}: slot {q.slot}'s prompt of {q.start + n} tokens leaves no "
                                 f"room to generate in max_seq_len {ps.max_seq_len}")
            per_group[q.slot // ps.slots_per_group] += max(n, 1)
        if per_group.max(initial=0) > ps.max_step_tokens:
            g = int(per_group.argmax())
            raise ValueError(f"plan {plan.step_id}: dp group {g} has {int(per_group[g])} tokens in one step, more "
                             f"than engine.prefill_chunk allows ({ps.max_step_tokens}); chunk the prompt")

    def step(self, plan: StepPlan) -> StepResult:
        """Apply one plan: releases, page-table changes, then the mixed step (`decode_steps` times). A plan in
        the slot form (`prefills`, `decode`) runs over a fixed mapping of slots to pages (`_step_slots`)."""
        if plan.prefills or (plan.decode and not plan.seqs):
            return self._step_slots(plan)
        t = self.tables
        t.release(plan.release)
        for s in plan.release:
            self._active[s] = False
        t.apply(plan.pages)
        self._check(plan)
        toks, lps = self._run(list(plan.seqs), plan.decode_steps)
        return StepResult(plan.step_id, tokens=toks, logprobs=lps)

    def _run(self, seqs: list[SeqStep], steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Run `steps` passes of one step program over `seqs`: tokens and logprobs [steps, len(seqs)] (zero
        where a sequence does not sample)."""
        ps, t = self.programs_set, self.tables
        if not seqs:
            return np.zeros((steps, 0), np.int32), np.zeros((steps, 0), np.float32)
        reset = []
        for q in seqs:
            if q.sampling is not None:
                t.sampling[q.slot] = q.sampling
                t.started[q.slot] = True
                prefix = np.asarray(q.prefix_tokens if q.prefix_tokens is not None else (), np.int32).reshape(-1)
                if prefix.size:
                    row = np.zeros(self.cfg.vocab_size, bool)
                    row[prefix] = True
                    exe = self.executable(StepShape("presence_row"))
                    self.presence = exe(self.presence, self._put(np.asarray(q.slot, np.int32), ps.replicated),
                                        self._put(row, ps.replicated))
                else:
                    reset.append(q.slot)
        per_group = np.zeros(ps.groups, np.int64)
        longest = 0
        for q in seqs:
            per_group[q.slot // ps.slots_per_group] += q.num_tokens
            longest = max(longest, q.start + q.num_tokens + steps - 1)
        tokens = ps.token_buckets[bisect.bisect_left(ps.token_buckets, int(per_group.max()))]
        pages = ps.page_buckets[bisect.bisect_left(ps.page_buckets, -(-longest // ps.page_size))]
        exe = self.executable(StepShape("step", tokens, pages))
        outs, rows = [], []
        for k in range(steps):  # no host round trip between the steps of a plan
            host = build_inputs(seqs, t, ps.page_size, tokens, ps.rows_for(tokens), pages, step=k,
                                reset=reset if k == 0 else ())
            self.pool, self.presence, self.last_tokens, out = exe(
                self._param_leaves, self.pool, self.presence, self.last_tokens, self._device_inputs(host.arrays))
            outs.append(out)
            rows = host.rows
        packed = np.stack([np.asarray(o) for o in outs])  # [steps, 2, G*R]
        idx = np.asarray(rows)
        toks = packed[:, 0, :].view(np.int32)[:, idx]
        lps = packed[:, 1, :][:, idx]
        sampled = np.asarray([q.sample for q in seqs])
        return np.where(sampled, toks, 0).astype(np.int32), np.where(sampled, lps, 0.0).astype(np.float32)

    # -- the slot form of a plan
    def _step_slots(self, plan: StepPlan) -> StepResult:
        """A slot-form plan (release, prefill whole prompts into slots, decode every active slot): each slot owns
        a fixed run of pages of its group's pool, prompts are cut into chunks of at most `max_step_tokens`
        per group, chunks of several prompts share steps, and the decode rows run `decode_steps` passes."""
        ps, t = self.programs_set, self.tables
        per_slot = ps.max_pages_per_seq
        if ps.pages_per_group < ps.slots_per_group * per_slot:
            raise ValueError(f"a slot-form plan needs a pool of {ps.slots_per_group * per_slot} pages per dp group "
                             f"(every slot at max_seq_len); engine.num_pages is {ps.pages_per_group}")
        for s in plan.release:
            t.check_slot(s)
            self._active[s] = False
            self._lengths[s] = 0
        t.release(plan.release)
        items = []
        for item in plan.prefills:
            t.check_slot(item.slot)
            tokens = np.asarray(item.tokens, np.int32).reshape(-1)
            n = int(tokens.shape[0])
            if n < 1 or n >= ps.max_seq_len:
                raise ValueError(f"slot {item.slot}: prompt of {n} tokens does not fit: prompts need "
                                 f"1..{ps.max_seq_len - 1} tokens (max_seq_len {ps.max_seq_len}, at least one "
                                 f"token must be generated)")
            local = item.slot % ps.slots_per_group
            t.table[item.slot] = np.arange(local * per_slot, (local + 1) * per_slot, dtype=np.int32)
            items.append((item, tokens))
        p_tok = np.zeros(len(items), np.int32)
        p_lp = np.zeros(len(items), np.float32)
        done = [0] * len(items)
        while any(d < len(tok) for d, (_, tok) in zip(done, items, strict=True)):
            budget = [ps.max_step_tokens] * ps.groups
            seqs, which = [], []
            for i, (item, tok) in enumerate(items):
                g = item.slot // ps.slots_per_group
                n = min(len(tok) - done[i], budget[g])
                if n <= 0:
                    continue
                budget[g] -= n
                last = done[i] + n == len(tok)
                seqs.append(SeqStep(item.slot, tok[done[i]:done[i] + n], done[i], last,
                                    item.sampling if done[i] == 0 else None))
                which.append((i, last))
                done[i] += n
            toks, lps = self._run(seqs, 1)
            for j, (i, last) in enumerate(which):
                if last:
                    p_tok[i], p_lp[i] = toks[0, j], lps[0, j]
        for item, tok in items:
            self._active[item.slot] = True
            self._lengths[item.slot] = len(tok)
        result = StepResult(plan.step_id, p_tok, p_lp)
        n = plan.decode_steps
        if not plan.decode:
            return result
        result.decode_tokens = np.zeros((n, ps.max_slots), np.int32)
        result.decode_logprobs = np.zeros((n, ps.max_slots), np.float32)
        active = np.nonzero(self._active)[0]
        if not active.size:
            return result
        full = [int(s) for s in active if self._lengths[s] + n > ps.max_seq_len]
        if full:
            raise ValueError(f"slot {full[0]} has no room for {n} more token(s): its cache holds "
                             f"{int(self._lengths[full[0]])} of max_seq_len={ps.max_seq_len}; the scheduler must "
                             f"stop it or plan fewer decode steps")
        seqs = [SeqStep(int(s), np.zeros(0, np.int32), int(self._lengths[s]), True) for s in active]
        toks, lps = self._run(seqs, n)
        result.decode_tokens[:, active] = toks
        result.decode_logprobs[:, active] = lps
        self._lengths[active] += n
        return result

    def step_hlo(self, tokens: int, pages: int) -> str:
        """The optimised HLO of one step program (to inspect its collectives and copies)."""
        text = self.executable(StepShape("step", tokens, pages)).as_text()
        if text is None:
            raise RuntimeError(f"the backend gave no HLO text for step {tokens}x{pages}")
        return text

