"""The paged engine: one mixed ragged step program over a paged KV cache, one `StepPlan` at a time.

The same `Engine` runs on every host of a gang. `step(plan)` issues the same jitted calls with the same shapes
on every host, in plan order, and is deterministic given the plan: sampling randomness comes from each
request's seed and token position, never from host state. Inputs are global arrays built with
`make_array_from_callback` (a `StepInputs` pytree: per token and per sequence row, laid out dp group after dp
group) and results are replicated, so any host can read them.

Device state: the paged KV pool (`raydeploy.engine.kv_cache`; each dp group owns `pages_per_group` pages), the
repetition-penalty token set of every slot, and every slot's last sampled token (the next decode input, so
a plan of several decode steps needs no host round trip). Host state, identical on every host because every
host applies the same plans: each slot's page-table row and sampling parameters (`PageTables`).

A plan (`seqs`, `pages`) carries the scheduler's page-table changes, prefix reuse, and prompt chunks mixed with
decode rows. Programs: `raydeploy.engine.programs.ProgramSet` (`raydeploy compile` compiles the same list).
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raydeploy.config import Config, EngineConfig, ModelConfig
from raydeploy.config.schema import LoraConfig
from raydeploy.engine import compile_cache
from raydeploy.engine.attention import Attention
from raydeploy.engine.geometry import EngineGeometry
from raydeploy.engine.kv_cache import (
    ALLOWED_FIELD,
    BIAS_FIELDS,
    BIAS_IDS,
    PageTables,
    StepInputs,
    abstract_inputs,
    allocate_pool,
    build_inputs,
)
from raydeploy.engine.logprobs import MAX_TOP_LOGPROBS, PLACE_COLUMNS, ROW_COLUMNS
from raydeploy.engine.programs import MIXED_STEP_CAP_PLATFORMS, ProgramSet, ProgramShape
from raydeploy.engine.request import RequestFailed
from raydeploy.engine.sampling import BIAS_PAD, STATE_DTYPE, mask_words
from raydeploy.engine.speculative import verify
from raydeploy.engine.speculative.draft import Drafter
from raydeploy.engine.step import PromptLogprobs, SeqStep, StepPlan, StepResult
from raydeploy.lora.commands import AdapterCommand
from raydeploy.lora.device import AdapterSlots
from raydeploy.model.registry import Family

AttentionFn = Callable[..., jax.Array]


def compile_threads(configured: int, platform: str) -> int:
    """`EngineConfig.compile_threads` with auto (0) resolved for this host."""
    if configured > 0:
        return configured
    return 1 if platform == "cpu" else max(1, min(8, os.cpu_count() or 1))


def _indexer(a: np.ndarray) -> Callable[[Any], np.ndarray]:
    return lambda idx: a[idx]


def pack_weights(ps: ProgramSet, leaves: list[jax.Array]) -> dict[str, jax.Array]:
    """The packed copies (`raydeploy.model.native.packing`) of the weights the native kernel may read packed
    (`ProgramSet.packable`) whose float32 values are exactly 4-bit blocks (layer kernels) or 8-bit blocks (a tied
    embedding table), replicated like the weights, by name. Every host packs its own replica of the same
    checkpoint, so every host packs the same weights."""
    from raydeploy.model.native import packing

    out: dict[str, jax.Array] = {}
    for i, name in enumerate(ps.param_names):
        path = name.removeprefix("layers.")
        k_dims = ps.packable.get(path)
        if k_dims is None:
            continue
        w = np.asarray(leaves[i].addressable_data(0))
        packed = (packing.pack_q8(w) if k_dims == 0
                  else packing.pack_q4(w.reshape(w.shape[0], int(np.prod(w.shape[1:1 + k_dims])), -1)))
        if packed is not None:
            out[path] = jax.make_array_from_callback(packed.shape, ps.replicated, _indexer(packed))
    return out


def checkpoint_packing(cfg: Config, ps: ProgramSet) -> dict[str, tuple[int, ...]]:
    """The packed copies an engine over `cfg`'s checkpoint holds (`pack_weights`), by name with their shapes, from
    the weights read as bring-up reads them: what `raydeploy compile` compiles the programs for. Empty (nothing
    read) where nothing may be packed."""
    if not ps.packable:
        return {}
    from raydeploy.checkpoint.demo import resolve_checkpoint
    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.model.sharding import merge_rules

    path = resolve_checkpoint(cfg.model.checkpoint, split_for=cfg)
    reader = CheckpointReader(path)
    rules = merge_rules(cfg.mesh.rules)
    family, model = ps.family, ps.cfg
    params, _ = reader.load(family.checkpoint_specs(model, reader.index.tensors), ps.mesh, {**family.rules, **rules},
                            cfg.model.param_dtype, cfg.model.load_threads, progress=False,
                            verify=cfg.model.verify_checksums)
    params = family.stack_layers(model, params, ps.kernel_layout, ps.mesh, ps.rules)
    _, state = family.build_model(model, params, cfg.model.dtype, cfg.model.param_dtype, ps.kernel_layout)
    return {n: tuple(p.shape) for n, p in pack_weights(ps, jax.tree.leaves(state)).items()}


class Engine:
    """One model replica over one mesh (possibly several processes): a paged KV pool per dp group and
    `max_slots` page-table rows. `step(plan)` runs the plan's mixed ragged step (and, for a decode-only plan,
    `decode_steps` of them with no host round trip between)."""

    def __init__(self, family: Family, cfg: Any, params: Mapping[str, jax.Array], mesh: jax.sharding.Mesh,
                 rules: Mapping[str, Any], model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 attention: AttentionFn | Attention | None = None, lora_cfg: LoraConfig | None = None) -> None:
        """`family` and its parsed `cfg` (`raydeploy.model.registry.from_hf_config`); `params` named as the
        family's `param_specs` (a checkpoint's per-layer tensors, already placed on `mesh`). `lora_cfg`: the
        config's `lora` section (None or max_adapters 0: no adapter slots, the programs of an engine without LoRA)."""
        if not compile_cache.configured():  # a gang host configured it for its platform before joining
            compile_cache.enable(engine_cfg.compilation_cache_dir)
        self.programs_set = ps = ProgramSet(family, cfg, mesh, dict(rules), model_cfg, engine_cfg, attention,
                                            lora_cfg)
        self.family = family
        self.cfg = cfg
        self.mesh = mesh
        self.decode_steps = engine_cfg.decode_steps
        params = family.stack_layers(cfg, params, ps.kernel_layout, mesh, ps.rules)
        _, state = family.build_model(cfg, params, model_cfg.dtype, model_cfg.param_dtype, ps.kernel_layout)
        del params
        self._param_leaves = jax.tree.leaves(state)
        self._packed = pack_weights(ps, self._param_leaves)
        ps.use_packed({n: p.shape for n, p in self._packed.items()})
        # the one-token CPU programs' weights: per-layer arrays over the stacked ones' memory (or none)
        self._layer_views = ps.layer_views(self._param_leaves)
        if self._layer_views is None:
            ps.scan_everywhere()
        self.pool = allocate_pool(family, cfg, ps.layout, ps.total_pages, ps.page_size, ps.max_slots, ps.kv_dtype, mesh,
                                  ps.rules)
        vocab = cfg.vocab_size
        # each slot's token state: in-sequence bit and generated counts (`STATE_DTYPE`, one byte a token)
        self.presence = jax.jit(lambda: jnp.zeros((ps.max_slots, vocab), STATE_DTYPE),
                                out_shardings=ps.presence_sharding)()
        self.last_tokens = jax.jit(lambda: jnp.zeros((ps.max_slots,), jnp.int32), out_shardings=ps.sharded_1d)()
        self.tables = PageTables(ps.max_slots, ps.groups, ps.max_pages_per_seq, ps.pages_per_group,
                                 ps.layout.ring_pages)
        self._shardings = ps.input_shardings()
        self.adapters = AdapterSlots(ps.lora, mesh, ps.rules, ps.max_slots) if ps.lora is not None else None
        """The device-side LoRA slots (`raydeploy.lora.device`), None without LoRA."""
        self._spec_shardings = ps.spec_shardings() if ps.spec_tokens else {}
        self.draft: Drafter | None = None
        """The draft model of `engine.speculative.method: draft` (`attach_draft`), None otherwise."""
        self._executables: dict[ProgramShape, Any] = {}
        self._gathers: dict[tuple[int, int, int], Any] = {}
        self._all_allowed_by_rows: dict[int, jax.Array] = {}
        self._neutral_bias_by_rows: dict[int, dict[str, jax.Array]] = {}
        self.compile_s: dict[str, float] = {}
        self.programs: dict[str, dict[str, Any]] = {}

    @property
    def packed_weights(self) -> list[str]:
        """The weights whose decode-size steps read a packed copy (`engine.pack_weights`): layer kernels (4-bit) by
        path in the layer module, the tied embedding table (8-bit) as "embed.embedding"."""
        return sorted(self._packed)

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
    def window_rings(self) -> bool:
        """The model's sliding-window layers keep rings of pages (`engine.window_pages: ring`): no prefix reuse."""
        return self.programs_set.layout.ring_pages > 0

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
    def matmul(self) -> str:
        """What multiplies the step programs' few rows by the weights: "native" (the CPU kernels), "pallas" (the
        GPU's stacked-weight kernel) or "xla (why not the platform's kernel)" (`raydeploy.engine.matmul`,
        `MatmulChoice.describe`); hosts report it in their status."""
        return self.programs_set.bodies.matmul.describe(len(self._packed))

    @property
    def kv_dtype(self) -> str:
        """The KV pools' dtype (`engine.kv_dtype` resolved); hosts report it in their status."""
        return self.programs_set.kv_dtype.name

    @property
    def mixed_step_tokens(self) -> int | None:
        """Token budget of a step that carries decode rows beside a prompt (a quarter chunk) on a platform in
        `MIXED_STEP_CAP_PLATFORMS`, or None (the whole chunk)."""
        q = self.max_step_tokens // 4
        ps = self.programs_set
        return q if ps.platform in MIXED_STEP_CAP_PLATFORMS and q in ps.token_buckets else None

    @property
    def slot_order(self) -> list[int]:
        """Slots in the order to fill them: the r-th slot of every group before any group's (r+1)-th."""
        s = self.slots_per_group
        return [g * s + r for r in range(s) for g in range(self.groups)]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.family.eos_ids(self.cfg)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table: a token id must be below it (the scheduler refuses others at submit)."""
        return int(self.cfg.vocab_size)

    def _check_tokens(self, plan: StepPlan, rows: list[tuple[int, np.ndarray]]) -> None:
        """`RequestFailed` naming the rows whose new tokens fall outside the vocabulary (an id past the embedding
        gives NaN logits, then garbage in the slot's pages). Checked before any device work, so every host raises
        it alike and the step loop fails just those requests."""
        v = self.vocab_size
        bad = [(slot, t) for slot, t in rows if t.size and (int(t.min()) < 0 or int(t.max()) >= v)]
        if bad:
            slot, t = bad[0]
            tid = int(t[(t < 0) | (t >= v)][0])
            raise RequestFailed(f"prompt token id {tid} is outside the model's vocabulary (ids 0..{v - 1}, "
                                f"vocab_size {v})", slots=tuple(s for s, _ in bad), invalid=True)

    # -- programs
    def executable(self, shape: ProgramShape) -> Any:
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
        ps = self.programs_set
        verify_rows = [ps.rows_of(ProgramShape("verify", t)) for t in ps.verify_buckets]
        for rows in sorted({ps.groups * r for r in [*map(ps.rows_for, ps.token_buckets), *verify_rows]}):
            self._gather_exe(self.decode_steps, rows)
            self._gather_exe(self.decode_steps, rows, ROW_COLUMNS)
            self._neutral_bias(rows)
            self._all_allowed(rows)
        for t in ps.token_buckets:
            self._gather_exe(1, ps.groups * t, PLACE_COLUMNS)
        for t in ps.verify_buckets:  # the speculating rows' emitted tokens of a verify step
            self._gather_exe(1, ps.groups * ps.spec_rows_for(t) * (ps.spec_tokens + 1))
        if self.draft is not None:  # the draft's programs, named apart from the target's
            for name, seconds in self.draft.engine.warmup(threads).items():
                self.compile_s[f"draft_{name}"] = seconds
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

    @property
    def geometry(self) -> EngineGeometry:
        """The engine's slots, pages and step sizes (`ProgramSet.geometry`)."""
        return self.programs_set.geometry

    def status(self) -> dict[str, Any]:
        """What a host reports of its engine: the matmul choice, the KV dtype, the step programs compiled so far
        by source (`programs`: loaded from the cache or compiled; `program_sources`: name -> seconds, source) and,
        under the draft method, its draft model's steps (`draft`: catch-up chunks and proposal passes run, and
        speculating rows left unproposed because the draft was not told their tokens, which should stay 0)."""
        out = {"matmul": self.matmul, "kv_dtype": self.kv_dtype, "programs": self.program_counts(),
               "program_sources": dict(self.programs)}
        if self.draft is not None:  # this host's draft model (every host runs the same draft steps)
            out["draft"] = {"checkpoint": self.draft.source, "steps": self.draft.draft_steps,
                            "unknown_rows": self.draft.unknown}
        return out

    # -- host side
    def _put(self, x: np.ndarray, sharding: Any) -> jax.Array:
        """A global array from host data that is identical on every host."""
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def _device_inputs(self, arrays: Mapping[str, np.ndarray], rows: int) -> StepInputs:
        """The step's inputs on the devices; a step without constrained rows (no `allowed` among `arrays`) takes
        the device-resident all-ones mask of its `rows` (G*R), so it moves no mask."""
        inputs = {n: self._put(a, self._shardings[n]) for n, a in arrays.items()}
        if ALLOWED_FIELD not in inputs:
            inputs[ALLOWED_FIELD] = self._all_allowed(rows)
        if BIAS_IDS not in inputs:
            inputs.update(self._neutral_bias(rows))
        return StepInputs.from_flat(inputs)

    def _neutral_bias(self, rows: int) -> dict[str, jax.Array]:
        """Logit-bias tables [rows, MAX_LOGIT_BIAS] with every entry unused (`BIAS_FIELDS`), made once on the
        devices per row count and kept: what every step without a logit_bias row passes (a fresh pair would be
        2.4 KB a row every pass)."""
        tables = self._neutral_bias_by_rows.get(rows)
        if tables is None:
            ps = self.programs_set
            shapes = abstract_inputs(ps.groups, 1, rows // ps.groups, 1, ps.max_slots, self.vocab_size)
            tables = {}
            for name in BIAS_FIELDS:
                shape, dt = shapes[name]
                fill = BIAS_PAD if name == BIAS_IDS else 0
                tables[name] = jax.jit(lambda shape=shape, dt=dt, fill=fill: jnp.full(shape, fill, dt),
                                       out_shardings=self._shardings[name])()
            self._neutral_bias_by_rows[rows] = tables
        return tables

    def _all_allowed(self, rows: int) -> jax.Array:
        """An all-ones allowed-token mask [rows, ceil(vocab / 32)], made once on the devices per row count and
        kept: what every step without a constrained row passes, so such a step moves no mask to the devices
        (a fresh one would be [G*R, W] uint32 every pass: 196 KB at 32 rows of a 49k vocabulary)."""
        ones = self._all_allowed_by_rows.get(rows)
        if ones is None:
            shape = (rows, mask_words(self.vocab_size))
            ones = jax.jit(lambda: jnp.full(shape, np.iinfo(np.uint32).max, jnp.uint32),
                           out_shardings=self._shardings[ALLOWED_FIELD])()
            self._all_allowed_by_rows[rows] = ones
        return ones

    def _check_allowed(self, plan: StepPlan) -> None:
        """The plan's allowed-token masks: each on a sampling row (ValueError naming the slot; in a plan of several
        passes the row draws in the first only: `SeqStep.first_pass_only`), each of ceil(vocab / 32) words (`RequestFailed` naming the rows
        whose mask has another length). Checked before any device work, so every host raises alike."""
        words = mask_words(self.vocab_size)
        bad = []
        for q in plan.seqs:
            if q.allowed is None:
                continue
            if not q.sample:
                raise ValueError(f"plan {plan.step_id}: slot {q.slot} carries an allowed-token mask but does not "
                                 f"sample")
            n = int(np.asarray(q.allowed).size)
            if n != words:
                bad.append((q.slot, n))
        if bad:
            slot, n = bad[0]
            raise RequestFailed(f"slot {slot}: its allowed-token mask has {n} words, the model's vocabulary of "
                                f"{self.vocab_size} tokens takes {words} (ceil(vocab / 32) uint32 words)",
                                slots=tuple(s for s, _ in bad))

    def _check_spec(self, plan: StepPlan) -> None:
        """The plan's speculating rows (`SeqStep.spec`): only in an engine with speculation, in a one-pass plan, as
        sampling decode rows of the slot's last token and at most k proposals, unconstrained, no more per dp group
        than a verify program holds (ValueError naming the slot). Checked before any device work."""
        ps = self.programs_set
        per_group = np.zeros(ps.groups, np.int64)
        for q in plan.seqs:
            if not q.spec:
                continue
            where = f"plan {plan.step_id}: slot {q.slot} speculates"
            if not ps.spec_tokens:
                raise ValueError(f"{where}, but this engine has no speculation (engine.speculative.method none)")
            n = int(np.asarray(q.tokens).shape[0])
            if not (0 < q.spec <= ps.spec_tokens and n == q.spec + 1):
                raise ValueError(f"{where} with {q.spec} proposals in {n} tokens: a speculating row is its last token "
                                 f"then 1..{ps.spec_tokens} proposals (engine.speculative.num_tokens)")
            if plan.decode_steps != 1 or not q.sample or q.allowed is not None or q.sampling is not None:
                raise ValueError(f"{where} in a plan of decode_steps {plan.decode_steps} (sample {q.sample}, "
                                 f"constrained {q.allowed is not None}, first chunk {q.sampling is not None}): a "
                                 f"speculating row is an unconstrained decode row of a one-pass plan")
            per_group[q.slot // ps.slots_per_group] += 1
        if per_group.max(initial=0) > ps.spec_rows:
            raise ValueError(f"plan {plan.step_id}: {int(per_group.max())} speculating rows in one dp group, a verify "
                             f"program holds {ps.spec_rows} (engine.speculative.max_rows)")

    def attach_draft(self, draft: Drafter) -> None:
        """Propose with `draft` (`engine.speculative.method: draft`): its engine shares this engine's page table
        from now on (`raydeploy.engine.speculative.draft`)."""
        if not self.programs_set.spec_tokens:
            raise ValueError("a draft model needs an engine with speculation (engine.speculative.method draft)")
        self.draft = draft

    def _adapter_slots(self) -> AdapterSlots:
        if self.adapters is None:
            raise ValueError("this engine has no adapter slots (lora.max_adapters 0)")
        return self.adapters

    def check_adapter_command(self, cmd: AdapterCommand) -> None:
        """What an adapter command (`raydeploy.lora.device`) can fail on before any device work: rank 0 runs it
        before sending the command, so a bad adapter (AdapterError naming its file or tensor) changes nothing."""
        cmd.check(self._adapter_slots())

    def adapter_command(self, cmd: AdapterCommand) -> dict[str, Any]:
        """Load or clear an adapter slot, between two steps (the dispatcher runs it on every host in the plans'
        order)."""
        return cmd.apply(self._adapter_slots())

    def _check_adapters(self, plan: StepPlan) -> None:
        """Each first chunk's adapter slot (`SeqStep.adapter`) is one of this engine's (ValueError naming the slot);
        checked before any device work."""
        slots = 0 if self.adapters is None else self.adapters.layout.slots
        for q in plan.seqs:
            if q.adapter >= 0 and (q.adapter >= slots or q.sampling is None):
                raise ValueError(f"plan {plan.step_id}: slot {q.slot} names adapter slot {q.adapter}, but this engine "
                                 f"has {slots} (lora.max_adapters) and the adapter is set on a first chunk only")

    def _check(self, plan: StepPlan) -> None:
        self._check_adapters(plan)
        self._check_tokens(plan, [(q.slot, np.asarray(q.tokens).reshape(-1)) for q in plan.seqs])
        self._check_allowed(plan)
        self._check_spec(plan)
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
        """Apply one plan: releases, page-table changes, then the mixed step (`decode_steps` times)."""
        t = self.tables
        t.release(plan.release)
        t.apply(plan.pages)
        self._check(plan)
        seqs = list(plan.seqs)
        if self.draft is not None:  # the draft's proposals in place of the plan's placeholders, on every host
            seqs = self.draft.propose(seqs, plan.step_id)
        result = self._run(seqs, plan.decode_steps)
        if self.draft is not None:
            self.draft.observe(seqs, result, plan.decode_steps)
        result.step_id = plan.step_id
        return result

    def _run(self, seqs: list[SeqStep], steps: int) -> StepResult:
        """Run `steps` passes of one step program over `seqs`: tokens and logprobs [steps, len(seqs)] (zero
        where a sequence does not sample), and the alternatives and prompt logprobs the sequences asked for
        (`_logprob_results`)."""
        ps, t = self.programs_set, self.tables
        if not seqs:
            return StepResult(-1, np.zeros((steps, 0), np.int32), np.zeros((steps, 0), np.float32))
        reset = []
        for q in seqs:
            if q.sampling is not None:
                t.start(q, self.vocab_size)
                if self.adapters is not None:
                    self.adapters.use(q.slot, q.adapter)
                prefix = np.asarray(q.prefix_tokens if q.prefix_tokens is not None else (), np.int32).reshape(-1)
                if prefix.size:
                    row = np.zeros(self.cfg.vocab_size, bool)
                    row[prefix] = True
                    exe = self.executable(ProgramShape("presence"))
                    self.presence = exe(self.presence, self._put(np.asarray(q.slot, np.int32), ps.replicated),
                                        self._put(row, ps.replicated))
                else:
                    reset.append(q.slot)
        per_group = np.zeros(ps.groups, np.int64)
        longest = 0
        for q in seqs:
            per_group[q.slot // ps.slots_per_group] += q.num_tokens
            longest = max(longest, q.start + q.num_tokens + steps - 1)
        pages = ps.page_buckets[bisect.bisect_left(ps.page_buckets, -(-longest // ps.page_size))]
        speculating = any(q.spec for q in seqs)
        if speculating:
            spec_rows = np.bincount([q.slot // ps.slots_per_group for q in seqs if q.spec], minlength=ps.groups)
            tokens = ps.verify_bucket(int(per_group.max()), int(spec_rows.max()))
        else:
            tokens = ps.token_buckets[bisect.bisect_left(ps.token_buckets, int(per_group.max()))]
        shape = (ProgramShape("verify", tokens, pages) if speculating
                 else ps.program_for(tokens, pages, all(q.num_tokens == 1 for q in seqs)))
        exe = self.executable(shape)
        weights: tuple[Any, ...] = (self._param_leaves, self._packed)
        if self.adapters is not None:
            weights = (*weights, self.adapters.step_arg())
        params = (weights, self._layer_views) if ps.unrolled(shape) else weights
        outs, alts = [], []
        places, host_places = None, []
        spec_out, spec_host = None, None
        # a constrained row draws in the first pass only (`SeqStep.first_pass_only`): later passes leave it out
        later = [i for i, q in enumerate(seqs) if not q.first_pass_only]
        passes = steps if later else 1
        at = np.full((steps, len(seqs)), -1, np.int64)  # each sequence's row in each pass (-1: not in it)
        rows_per_group = ps.rows_of(shape)
        for k in range(passes):  # no host round trip between the steps of a plan
            cols = list(range(len(seqs))) if k == 0 else later
            work, first = [seqs[i] for i in cols], list(range(len(cols)))
            if speculating and ps.verify_rows:  # (a speculating plan has one pass)
                work, first = verify.as_single_rows(work)
            host = build_inputs(work, t, ps.page_size, tokens, rows_per_group, pages, step=k,
                                reset=reset if k == 0 else (), vocab=self.vocab_size)
            host_rows, first_places = [host.rows[j] for j in first], [host.places[j] for j in first]
            if speculating:
                spec_host = self._spec_inputs(seqs, host.arrays, host_rows, first_places, tokens)
                (self.pool, self.presence, self.last_tokens, out, alt, places_k, spec_out) = exe(
                    params, self.pool, self.presence, self.last_tokens,
                    self._device_inputs(host.arrays, ps.groups * rows_per_group),
                    verify.spec_from_flat({n: self._put(a, self._spec_shardings[n])
                                           for n, a in spec_host.arrays.items()}))
            else:
                self.pool, self.presence, self.last_tokens, out, alt, places_k = exe(
                    params, self.pool, self.presence, self.last_tokens,
                    self._device_inputs(host.arrays, ps.groups * rows_per_group))
            outs.append(out)
            alts.append(alt)
            places = places if places is not None else places_k  # prompt chunks run in one-pass plans
            at[k, cols] = host_rows
            if k == 0:
                host_places = first_places
        packed = self._gather(outs)  # [passes, 2, G*R]
        kept = at[:passes] >= 0
        idx = np.where(kept, at[:passes], 0)
        pass_ix = np.arange(passes)[:, None]
        toks = packed[:, 0, :].view(np.int32)[pass_ix, idx]
        lps = packed[:, 1, :][pass_ix, idx]
        sampled = kept & np.asarray([q.sample for q in seqs])
        result = StepResult(-1, np.zeros((steps, len(seqs)), np.int32), np.zeros((steps, len(seqs)), np.float32))
        assert result.tokens is not None and result.logprobs is not None
        result.tokens[:passes] = np.where(sampled, toks, 0)
        result.logprobs[:passes] = np.where(sampled, lps, 0.0)
        if spec_out is not None and spec_host is not None:
            self._spec_results(result, seqs, spec_out, spec_host)
        self._logprob_results(result, seqs, alts, idx, places, host_places)
        return result

    def _spec_inputs(self, seqs: list[SeqStep], arrays: dict[str, np.ndarray], rows: list[int], places: list[int],
                     tokens: int) -> verify.HostSpec:
        """The verify pass's `SpecInputs` on the host; the speculating rows' own entries in the step's inputs are
        taken out of its sampling (their row draws nothing, their places note no token: the verification draws
        and notes their emitted tokens)."""
        ps, t = self.programs_set, self.tables
        for i, q in enumerate(seqs):
            if q.spec:
                arrays["sampling.slot"][rows[i]] = ps.max_slots
                arrays["token_slot"][places[i]:places[i] + q.num_tokens] = ps.max_slots
        return verify.build_spec_inputs(seqs, places, tokens, ps.groups, ps.slots_per_group,
                                        ps.spec_rows_for(tokens), ps.spec_tokens, ps.max_slots, t.sampling, t.bias)

    def _spec_results(self, result: StepResult, seqs: list[SeqStep], spec_out: jax.Array,
                      spec_host: verify.HostSpec) -> None:
        """The speculating rows' emitted tokens and logprobs into `result` (`spec_tokens`, `spec_logprobs`; their
        first also in `tokens[0]`)."""
        k1 = self.programs_set.spec_tokens + 1
        packed = self._gather([spec_out], pad=False)[0]  # [2, G*S*(k+1)]
        emitted = packed[0].view(np.int32).reshape(-1, k1)
        lps = packed[1].reshape(-1, k1)
        result.spec_tokens = np.full((len(seqs), k1), -1, np.int32)
        result.spec_logprobs = np.zeros((len(seqs), k1), np.float32)
        tokens, logprobs = result.tokens, result.logprobs
        assert tokens is not None and logprobs is not None
        for i, row in spec_host.rows.items():
            result.spec_tokens[i] = emitted[row]
            result.spec_logprobs[i] = lps[row]
            tokens[0, i] = emitted[row, 0]
            logprobs[0, i] = lps[row, 0]

    def _logprob_results(self, result: StepResult, seqs: list[SeqStep], alts: list[jax.Array], idx: np.ndarray,
                         places: Any, first_places: list[int]) -> None:
        """Read the alternatives and prompt logprobs back only when some sequence asked for them (so a step without
        moves nothing more than its tokens) into `result`: [steps, seqs, K] ids and logprobs (`idx`: each
        sequence's row in each pass that ran, [passes, seqs]; zeros where it was not in one), and per sequence
        its chunk's `PromptLogprobs`."""
        k = MAX_TOP_LOGPROBS
        if any(q.top_logprobs and q.sample for q in seqs):
            assert result.tokens is not None
            both = np.zeros((result.tokens.shape[0], len(seqs), 2 * k), np.float32)  # [steps, seqs, 2K]
            both[:idx.shape[0]] = self._gather(alts)[np.arange(idx.shape[0])[:, None], :, idx]
            result.top_ids = np.ascontiguousarray(both[:, :, :k].view(np.int32))
            result.top_logprobs = np.ascontiguousarray(both[:, :, k:])
        if places is None or not any(q.prompt_logprobs for q in seqs):
            return
        table = self._gather([places], pad=False)[0]  # [2 + 2K, G*T]
        out: list[PromptLogprobs | None] = []
        for q, first in zip(seqs, first_places, strict=True):
            n = int(np.asarray(q.tokens).shape[0])
            if not (q.prompt_logprobs and n):
                out.append(None)
                continue
            n -= int(q.next_token < 0)  # the prompt's last chunk: its last place predicts the sampled token
            cols = table[:, first:first + n]
            out.append(PromptLogprobs(cols[0].copy(), cols[1].astype(np.int32),
                                      np.ascontiguousarray(cols[2:2 + k].view(np.int32).T),
                                      np.ascontiguousarray(cols[2 + k:].T)))
        result.prompt = tuple(out)

    def _gather_exe(self, width: int, rows: int, height: int = 2) -> Any:
        """The program that stacks `width` passes' results [height, rows] (each sharded over the groups) and
        replicates them: one gather per plan (another for the alternatives or prompt logprobs, when asked).
        Tiny, so not counted among the step programs."""
        exe = self._gathers.get((width, rows, height))
        if exe is None:
            ps = self.programs_set
            arg = jax.ShapeDtypeStruct((height, rows), jnp.float32, sharding=ps.sharded_rows)
            exe = ps.gather_results.lower(*[arg] * width).compile()
            self._gathers[(width, rows, height)] = exe
        return exe

    def _gather(self, outs: list[jax.Array], pad: bool = True) -> np.ndarray:
        """The passes' results [steps, height, columns] on the host. A plan of fewer passes than `decode_steps` pads
        the list with its last entry (so one program per shape serves them), cut off here; `pad` False: no padding
        (a one-pass result only)."""
        width = max(len(outs), self.decode_steps) if pad else len(outs)
        exe = self._gather_exe(width, outs[0].shape[1], outs[0].shape[0])
        return np.asarray(exe(*outs, *[outs[-1]] * (width - len(outs))))[: len(outs)]

    def step_hlo(self, tokens: int, pages: int) -> str:
        """The optimised HLO of one step program (to inspect its collectives and copies)."""
        text = self.executable(ProgramShape("step", tokens, pages)).as_text()
        if text is None:
            raise RuntimeError(f"the backend gave no HLO text for step {tokens}x{pages}")
        return text

