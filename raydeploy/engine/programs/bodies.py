"""The jitted bodies of the paged engine's programs (`StepBodies`): one mixed ragged step over the carried KV
pool, sampling fused, and the small programs around it. What they run over (mesh, groups, layout, kernels) is
given to them; which programs exist and their abstract arguments are `ProgramSet`'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.engine.attention import Attention, get_attention
from raydeploy.engine.kv_cache import PoolLayout, StepInputs, to_pool_dtype
from raydeploy.engine.logprobs import (
    PLACE_COLUMNS,
    ROW_COLUMNS,
    place_block,
    place_logprobs,
    prompt_targets,
    row_alternatives,
)
from raydeploy.engine.matmul import Matmul, MatmulChoice
from raydeploy.engine.programs.kernels import KernelChoice
from raydeploy.engine.sampling import RowSampling, note_generated, note_in_sequence, sample
from raydeploy.engine.speculative import verify
from raydeploy.lora.batched import LoraRows, LoraWeights
from raydeploy.model.llama import ActivationSharding
from raydeploy.model.scan import unroll_layers


def pack(tokens: jax.Array, logprobs: jax.Array) -> jax.Array:
    """[2, B] float32: the tokens' int32 bits and their logprobs, so a step returns (and, across processes,
    gathers) one array, not two."""
    return jnp.stack([jax.lax.bitcast_convert_type(tokens, jnp.float32), logprobs])


AttentionFn = Callable[..., jax.Array]


def _interleave(k: jax.Array, v: jax.Array) -> jax.Array:
    """K and V [N, K, H] -> [N, 2K, H] interleaved on the head axis (k0, v0, k1, v1, ...)."""
    n, kh, h = k.shape
    return jnp.stack([k, v], axis=2).reshape(n, 2 * kh, h)


def _axes_entry(axes: Sequence[str]) -> Any:
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def default_attention(name: str, platform: str) -> Attention:
    return get_attention(name, platform)


class StepBodies:
    """The jitted programs of one engine over one mesh: `step` (and its unrolled and single-token variants),
    `gather_results` and `presence_row`."""

    def __init__(self, *, mesh: jax.sharding.Mesh, shard: ActivationSharding, graphdef: Any, param_treedef: Any,
                 kernels: KernelChoice, layer_specs: dict[str, PartitionSpec], attention: Attention,
                 layout: PoolLayout, groups: int, max_slots: int, head_axes: tuple[str, ...], vocab_chunks: int,
                 sm_scale: float, out_shardings: tuple[Any, ...], replicated: NamedSharding,
                 presence_sharding: NamedSharding) -> None:
        self.mesh = mesh
        self.platform = mesh.devices.flat[0].platform
        self.shard = shard
        self.dp_axes = shard.slot_axes
        self.graphdef = graphdef
        self.param_treedef = param_treedef
        self.matmul = MatmulChoice(kernels.native_matmul, kernels.stacked_matmul, self.platform)
        """The projections' matmul backend, chosen once (`raydeploy.engine.matmul`); each traced step hands the model
        its backend (`MatmulChoice.backend`), and the native one's decode-row kernel goes to the XLA attention."""
        self.layer_specs = layer_specs
        self.attention = attention.with_decode_rows(self.matmul.decode_rows)
        self.layout = layout
        self.groups = groups
        self.max_slots = max_slots
        self.head_axes = head_axes
        self.vocab_chunks = vocab_chunks
        self.sm_scale = sm_scale
        outs = out_shardings
        self.step = jax.jit(self._step_fn, donate_argnums=(1, 2, 3), out_shardings=outs)
        self.step_unrolled = jax.jit(self._step_unrolled_fn, donate_argnums=(1, 2, 3), out_shardings=outs)
        self.step_single = jax.jit(partial(self._step_fn, single_token=True), donate_argnums=(1, 2, 3),
                                   out_shardings=outs)
        self.step_unrolled_single = jax.jit(partial(self._step_unrolled_fn, single_token=True),
                                            donate_argnums=(1, 2, 3), out_shardings=outs)
        self.verify = jax.jit(self._verify_fn, donate_argnums=(1, 2, 3), out_shardings=(*outs, outs[3]))
        """A step with speculating rows (`raydeploy.engine.speculative.verify`): the step's outputs and the
        speculating rows' emitted tokens packed [2, G*S*(k+1)]."""
        self.gather_results = jax.jit(lambda *packed: jnp.stack(packed), out_shardings=replicated)
        """The packed results of a plan's passes [steps, 2, G*R], replicated: the one collective between the
        groups per plan (a dp-only mesh's passes have none)."""
        self.presence_row = jax.jit(lambda presence, slot, row: presence.at[slot].set(row.astype(presence.dtype)),
                                    donate_argnums=(0,),
                                    out_shardings=presence_sharding)

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

    def _verify_fn(self, weights, pool, presence, last_tokens, inp: StepInputs, spec: verify.SpecInputs):
        """`_step_fn` over the scanned layers with the speculating rows of `spec` verified after the step's own
        sampling (their rows in `inp` sample nothing and note no token: the engine leaves them out there)."""
        leaves, packed = weights[:2]
        matmul = self.matmul.backend(self.mesh, self.dp_axes, packed, self.layer_specs)
        return self._step_body(leaves, pool, presence, last_tokens, inp, None, self.attention.ragged, matmul, spec,
                               lora=_lora_arg(weights))

    def _step_fn(self, weights, pool, presence, last_tokens, inp: StepInputs, per_layer=None,
                 single_token: bool = False):
        """One ragged step. `weights`: (the model's leaves, the packed copies by path, `use_packed`). Returns the
        pool, the repetition-penalty sets, the slots' last tokens and the packed results [2, G*R] (token bits,
        logprob) of every row. `per_layer`: each layer's own arrays, run unrolled (`unroll_layers`) instead of
        scanning the stacked ones. `single_token`: every live sequence carries one token (the caller's promise),
        so the attention's single-token path serves the step."""
        leaves, packed = weights[:2]
        attention = self.attention.single_token if single_token else self.attention.ragged
        if attention is None:
            raise ValueError("a single-token step program needs an attention with a single-token path")
        matmul = self.matmul.backend(self.mesh, self.dp_axes, packed, self.layer_specs)
        return self._step_body(leaves, pool, presence, last_tokens, inp, per_layer, attention, matmul,
                               lora=_lora_arg(weights))

    def _step_body(self, leaves, pool, presence, last_tokens, inp: StepInputs, per_layer, attention: AttentionFn,
                   matmul: Matmul, spec: verify.SpecInputs | None = None, lora: Any = None):
        model = self.model(leaves)
        if per_layer is not None:
            unroll_layers(model.layers, per_layer)
        g = self.groups
        t = inp.tokens.shape[0] // g
        r = inp.kv_lens.shape[0] // g
        tokens = self._per_group(_last_token_inputs, 3)(last_tokens, inp.from_last, inp.tokens)
        lora_kw = {} if lora is None else {"lora": self._lora_rows(
            lora, _adapter_slots(inp, spec, g, t, self.max_slots), matmul)}
        h, _, _, pool = model.ragged(tokens, inp.positions, self._attend(inp, attention), self.shard, cache=pool,
                                     static_kinds=self.attention.static_layer_kinds, matmul=matmul, **lora_kw)
        hg = h.reshape(g, t, h.shape[-1])
        last = jnp.take_along_axis(hg, inp.logit_index.reshape(g, r, 1), axis=1).reshape(g * r, h.shape[-1])
        last = self.shard.constrain(last, ("act_batch", "act_embed"))  # rows stay on their group's devices
        logits = model.logits(last, self.shard, matmul)
        alts, places = self._logprobs(model, matmul, h.reshape(g, t, h.shape[-1]), tokens, logits, inp)
        tail = partial(_sample_rows, max_slots=self.max_slots, vocab_chunks=self.vocab_chunks)
        presence, last_tokens, tok, lp = self._per_group(tail, 8, replicated=3)(
            logits, presence, last_tokens, inp.reset, tokens, inp.token_slot, inp.sampling, inp.allowed,
            inp.any_sampled, inp.any_filtered, inp.any_adjusted)
        if spec is None:
            return pool, presence, last_tokens, pack(tok, lp), alts, places
        # the speculating rows' verification places: logits at each, drawn as plain decode rows would draw there
        d = h.shape[-1]
        hs = jnp.take_along_axis(hg, spec.place.reshape(g, -1, 1), axis=1).reshape(-1, d)
        hs = self.shard.constrain(hs, ("act_batch", "act_embed"))
        spec_logits = model.logits(hs, self.shard, matmul)
        tail = partial(verify.verify_tail, max_slots=self.max_slots, vocab_chunks=self.vocab_chunks)
        presence, last_tokens, emitted, elp = self._per_group(tail, 8, replicated=3)(
            spec_logits, presence, last_tokens, spec.slot, spec.proposals, spec.position, spec.params, spec.bias,
            spec.any_sampled, spec.any_filtered, spec.any_adjusted)
        return pool, presence, last_tokens, pack(tok, lp), alts, places, pack(emitted, elp)

    def _lora_rows(self, lora: tuple[LoraWeights, jax.Array], token_slot: jax.Array, matmul: Matmul) -> LoraRows:
        """The step's adapters (`raydeploy.lora.batched`): each token place takes its engine slot's adapter slot
        (`slot_adapter` [max_slots], -1 none; padding places none)."""
        weights, slot_adapter = lora
        ms = self.max_slots
        token_adapter = jnp.where(token_slot < ms, slot_adapter[jnp.minimum(token_slot, ms - 1)], -1)
        return LoraRows.for_tokens(weights, token_adapter, skip_inactive=self.platform == "cpu", matmul=matmul)

    def _logprobs(self, model: Any, matmul: Matmul, h_gtd: jax.Array, tokens: jax.Array, logits: jax.Array,
                  inp: StepInputs) -> tuple[jax.Array, jax.Array]:
        """The step's logprobs beyond the sampled tokens' (`raydeploy.engine.logprobs`), skipped on replicated
        flags: the rows' alternatives [2K, G*R] (under a `lax.cond`: it reads only the logits) and the places'
        prompt logprobs [2 + 2K, G*T]; zeros where no row asked. The places: on CPU under a `lax.cond` (free
        there; the loop form below cost +22% TPOT on XLA CPU, demo model, 1 and 8 streams), elsewhere a loop over
        blocks of places that runs no block when no chunk asks (a cond around the LM head made XLA TPU copy its
        weight: +262 MB of temporaries per chip, Llama-3-8B on a v5e-16)."""
        alts = jax.lax.cond(inp.any_top_logprobs,  # per dp group: no group's logits cross to another
                            lambda: self._per_group(partial(row_alternatives, chunks=self.vocab_chunks), 1)(logits),
                            lambda: jnp.zeros((logits.shape[0], ROW_COLUMNS), jnp.float32)).T
        g, t = h_gtd.shape[:2]
        targets = self._per_group(prompt_targets, 3)(tokens, inp.logit_index, inp.next_token)

        def head(x: jax.Array) -> jax.Array:  # a block's rows laid out as the sampled rows (`last`)
            return model.logits(self.shard.constrain(x, ("act_batch", "act_embed")), self.shard, matmul)

        block = place_block(self.platform)

        def rowwise(fn: Any) -> Any:
            return self._per_group(fn, 2)
        if self.platform == "cpu":
            places = jax.lax.cond(
                inp.any_prompt_logprobs,
                lambda: place_logprobs(h_gtd, targets.reshape(g, t), head, chunks=self.vocab_chunks, block=block,
                                       rowwise=rowwise),
                lambda: jnp.zeros((PLACE_COLUMNS, g * t), jnp.float32))
        else:
            places = place_logprobs(h_gtd, targets.reshape(g, t), head, chunks=self.vocab_chunks, block=block,
                                    active=inp.any_prompt_logprobs, rowwise=rowwise)
        return alts, places


def _lora_arg(weights: tuple[Any, ...]) -> Any:
    """The step's adapter argument, (`LoraWeights`, slot_adapter), the third entry of `weights` in an engine with
    `lora.max_adapters` > 0; None otherwise (its programs take no adapter input)."""
    return weights[2] if len(weights) > 2 else None


def _adapter_slots(inp: StepInputs, spec: verify.SpecInputs | None, groups: int, tokens: int,
                   max_slots: int) -> jax.Array:
    """Each token place's slot for its adapter (`StepInputs.token_slot`): a speculating row's places are taken out
    of the step's own token notes (`Engine._spec_inputs`), but their tokens are the row's and take its adapter."""
    if spec is None:
        return inp.token_slot
    rows = spec.slot.shape[0]
    k1 = spec.place.shape[0] // rows
    slot = jnp.repeat(spec.slot, k1)
    group = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), rows // groups * k1)
    at = jnp.where(slot < max_slots, group * tokens + spec.place, groups * tokens)  # padding rows: dropped
    return inp.token_slot.at[at].set(slot, mode="drop")


def _group_slot(slot: jax.Array, max_slots: int, slots_per_group: int) -> jax.Array:
    """A slot id as an index into its group's own slots; padding (`max_slots`) stays out of range."""
    return jnp.where(slot < max_slots, slot % slots_per_group, slots_per_group)


def _last_token_inputs(last_tokens: jax.Array, from_last: jax.Array, tokens: jax.Array) -> jax.Array:
    """A group's token places: a decode row's input is its slot's last sampled token (`from_last` >= 0, the
    slot), a prompt place its own token."""
    src = jnp.where(from_last >= 0, from_last % last_tokens.shape[0], 0)
    return jnp.where(from_last >= 0, last_tokens[src], tokens)


def _sample_rows(logits: jax.Array, presence: jax.Array, last_tokens: jax.Array, reset: jax.Array,
                 tokens: jax.Array, token_slot: jax.Array, rows: RowSampling, allowed: jax.Array,
                 any_sampled: jax.Array, any_filtered: jax.Array, any_adjusted: jax.Array, *, max_slots: int,
                 vocab_chunks: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A group's sampling: its slots' token states (`presence`, `STATE_DTYPE`: in-sequence bits and generated
    counts) take this step's tokens as in the sequence (`tokens` in `token_slot`, after the slots in `reset`
    start over), its rows sample with their `SamplingParams` and logit-bias tables (`rows`: one array per field,
    passed through `shard_map` whole) among their allowed tokens (`allowed`, packed bits; all ones for an
    unconstrained row), and each sampled token is counted in its slot's state and becomes the slot's last token.
    Every pass of a multi-pass plan runs this, so the counts follow each draw."""
    spg = presence.shape[0]
    tslot = _group_slot(token_slot, max_slots, spg)
    rslot = _group_slot(rows.slot, max_slots, spg)
    presence = jnp.where(reset[:, None], jnp.zeros((), presence.dtype), presence)
    presence = note_in_sequence(presence, tslot, tokens)
    seen = presence[jnp.minimum(rslot, spg - 1)]
    tok, lp = sample(logits, seen, rows.params, rows.position, any_sampled=any_sampled, any_filtered=any_filtered,
                     vocab_chunks=vocab_chunks, allowed_bw=allowed, bias=rows.bias, any_adjusted=any_adjusted)
    presence = note_generated(presence, rslot, tok)
    last_tokens = last_tokens.at[rslot].set(tok, mode="drop")
    return presence, last_tokens, tok, lp
