"""The jitted engine: prefill-and-insert and decode over a slot KV cache, one `StepPlan` at a time.

The same `Engine` runs on every host of a gang. `step(plan)` issues the same jitted calls with the same
shapes on every host, in plan order (releases, then each prefill, then one decode), and is deterministic
given the plan: sampling randomness comes from each request's seed and token position, never from host
state. Inputs are replicated global arrays built with `make_array_from_callback` and outputs (tokens,
logprobs) are replicated, so the code never assumes one process and any host can read the results.

Programs (each compiled once, on `warmup()` or first use; `raydeploy.engine.programs` describes them, and
`raydeploy compile` compiles the same list without weights):
- `prefill[bucket]`: one prompt padded to a prefill bucket, with its true length carried explicitly (the pad
  id is also the eos id in chat prompts, so padding is never inferred from tokens); writes the prompt's K/V
  into its slot of the donated cache, resets the slot's repetition-penalty token set, samples token 0.
- `decode[window, rows]`: one token for each of the first `rows` slots of every slot group (a group is the
  slots one shard of the slot axis holds: with dp=2 and 8 slots, slots 0-3 and 4-7), so a step costs what
  the occupied slots need, not all `max_slots` (inactive slots inside the prefix are computed but ignored).
  `slot_order` lists slots so that filling them in that order keeps every group's prefix short; the
  scheduler allocates in that order. Attends over the first `window` cache positions, the smallest window
  holding the longest active sequence, so short sequences do not pay for reading the whole cache.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raydeploy.config import EngineConfig, ModelConfig
from raydeploy.engine import compile_cache
from raydeploy.engine.kv_slots import DecodeSlots, allocate_kv_cache
from raydeploy.engine.programs import PREFILL_INTS, ProgramSet, ProgramShape
from raydeploy.engine.sampling import SlotSampling
from raydeploy.engine.step import StepPlan, StepResult
from raydeploy.model.llama import DTYPES, build_model, stack_layers
from raydeploy.model.spec import LlamaConfig


def compile_threads(configured: int, platform: str) -> int:
    """`EngineConfig.compile_threads` with auto (0) resolved for this host."""
    if configured > 0:
        return configured
    return 1 if platform == "cpu" else max(1, min(8, os.cpu_count() or 1))


def _unpack(out: jax.Array | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed results [..., 2, B] -> (tokens int32 [..., B], logprobs float32 [..., B]) on the host."""
    arr = np.asarray(out)
    return arr[..., 0, :].view(np.int32), arr[..., 1, :]


class Engine:
    """One model replica over one mesh (possibly spanning several processes), with `max_slots` KV slots."""

    def __init__(self, llama_cfg: LlamaConfig, params: Mapping[str, jax.Array], mesh: jax.sharding.Mesh,
                 rules: Mapping[str, Any], model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 decode_windows: Sequence[int] | None = None) -> None:
        if not compile_cache.configured():  # a gang host configured it for its platform before joining
            compile_cache.enable(engine_cfg.compilation_cache_dir)
        self.programs_set = ps = ProgramSet(llama_cfg, mesh, dict(rules), model_cfg, engine_cfg, decode_windows)
        self.cfg = llama_cfg
        self.mesh = mesh
        self.rules = ps.rules
        self._max_slots = ps.max_slots
        self._max_seq_len = ps.max_seq_len
        self.buckets = ps.buckets
        self.windows = ps.windows
        self.dtype = ps.dtype
        self.kernel_layout = ps.kernel_layout
        params = stack_layers(llama_cfg, params, self.kernel_layout, mesh, self.rules)
        _, state = build_model(llama_cfg, params, model_cfg.dtype, model_cfg.param_dtype, self.kernel_layout)
        del params
        self._param_leaves = jax.tree.leaves(state)
        self.k_cache, self.v_cache = allocate_kv_cache(llama_cfg, self._max_slots, self._max_seq_len,
                                                       DTYPES[model_cfg.dtype], mesh, self.rules)
        self._replicated = ps.replicated
        self.presence = jax.jit(lambda: jnp.zeros((self._max_slots, llama_cfg.vocab_size), bool),
                                out_shardings=ps.presence_sharding)()
        self.slots = DecodeSlots(self._max_slots, self._max_seq_len)
        self._groups = ps.groups
        self._group_size = ps.group_size
        self.decode_rows = ps.decode_rows
        self.decode_steps = ps.decode_steps
        self._rows_sharding = ps.rows_sharding
        self._executables: dict[ProgramShape, Any] = {}  # compiled from the ProgramSet's abstract inputs
        self.compile_s: dict[str, float] = {}
        self.programs: dict[str, dict[str, Any]] = {}  # name -> {seconds, source: cache|compiled|none}

    # -- properties
    @property
    def max_slots(self) -> int:
        return self._max_slots

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def slot_order(self) -> list[int]:
        """Slots in the order to fill them: the r-th slot of every group before any group's (r+1)-th."""
        return [g * self._group_size + r for r in range(self._group_size) for g in range(self._groups)]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.cfg.eos_token_ids)

    # -- host side
    def _put(self, x: np.ndarray) -> jax.Array:
        """A replicated global array from host data that is identical on every host."""
        return jax.make_array_from_callback(x.shape, self._replicated, lambda idx: x[idx])

    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if n < 1 or i == len(self.buckets):
            raise ValueError(f"prompt of {n} tokens does not fit: prompts need 1..{self.buckets[-1]} tokens "
                             f"(largest prefill bucket, max_seq_len {self._max_seq_len})")
        return self.buckets[i]

    def window_for(self, longest: int) -> int:
        """Smallest decode window holding positions [0, longest]."""
        i = bisect.bisect_left(self.windows, longest + 1)
        return self.windows[min(i, len(self.windows) - 1)]

    def _prefill_args(self, tokens: np.ndarray, slot: int, sp: SlotSampling) -> tuple[Any, ...]:
        """The prefill program's arguments for one prompt (padded to its bucket)."""
        n = int(tokens.shape[0])
        bucket = self.bucket_for(n)
        if n >= self._max_seq_len:
            raise ValueError(f"prompt of {n} tokens leaves no room to generate in max_seq_len {self._max_seq_len}")
        ints = np.zeros(bucket + PREFILL_INTS, np.int32)
        ints[:n] = tokens
        ints[bucket:] = [n, slot, sp.top_k[0], sp.seed.view(np.int32)[0]]
        floats = np.asarray([sp.temperature[0], sp.top_p[0], sp.repetition_penalty[0]], np.float32)
        return (self._param_leaves, self.k_cache, self.v_cache, self.presence, self._put(ints), self._put(floats))

    def executable(self, shape: ProgramShape) -> Any:
        """The compiled program for `shape`: compiled (or loaded from the persistent cache) on first use from
        the ProgramSet's abstract inputs, exactly as `raydeploy compile` compiles it; every call of the
        engine goes through one, so nothing is traced or compiled behind the program list's back."""
        exe = self._executables.get(shape)
        if exe is None:
            with self._program(shape.name):
                exe = self.programs_set.lower(shape).compile()
            self._executables[shape] = exe
        return exe

    def _run_prefill(self, tokens: np.ndarray, slot: int, sp: SlotSampling) -> jax.Array:
        args = self._prefill_args(tokens, slot, sp)
        exe = self.executable(self.programs_set.prefill_shape(self.bucket_for(int(tokens.shape[0]))))
        self.k_cache, self.v_cache, self.presence, out = exe(*args)
        return out

    def rows_for(self, active: np.ndarray) -> int:
        """Smallest decode row bucket covering every active slot's place in its group."""
        places = np.nonzero(active)[0] % self._group_size
        need = int(places.max()) + 1 if places.size else 1
        return self.decode_rows[bisect.bisect_left(self.decode_rows, need)]

    def decoded_slots(self, rows: int) -> np.ndarray:
        """The slots a decode with `rows` rows per group covers, in output order."""
        return (np.arange(self._groups)[:, None] * self._group_size + np.arange(rows)[None, :]).reshape(-1)

    def _decode_steps(self, window: int, rows: int, steps: int) -> list[jax.Array]:
        """Dispatch `steps` decode steps of the first `rows` slots per group; their packed results stay on the
        devices of their rows ([2, rows*groups] each)."""
        tokens, floats, ints = self._decode_inputs(rows)
        exe = self.executable(self.programs_set.decode_shape(window, rows))
        outs = []
        for k in range(steps):  # no host round trip between the steps of a plan
            self.k_cache, self.v_cache, self.presence, tokens, out = exe(
                self._param_leaves, self.k_cache, self.v_cache, self.presence, tokens, ints(k), floats)
            outs.append(out)
        return outs

    def _decode_inputs(self, rows: int) -> tuple[jax.Array, jax.Array, Any]:
        """The decode program's per-plan inputs for the first `rows` slots of each group: the input tokens (on
        their rows' devices), the float sampling parameters, and a function giving step k's int inputs."""
        s = self.slots
        sp = s.slot_sampling()
        idx = self.decoded_slots(rows)
        sampled = np.full(self._max_slots, int(bool(np.any(s.active[idx] & (sp.temperature[idx] > 0)))))
        floats = self._put(np.stack([sp.temperature, sp.top_p, sp.repetition_penalty]).astype(np.float32)[:, idx])
        last = s.last_token[idx]
        tokens = jax.make_array_from_callback(last.shape, self._rows_sharding, lambda i: last[i])

        def ints(k: int) -> jax.Array:
            positions = np.where(s.active, s.lengths + k, 0)
            return self._put(np.stack([positions, s.active.astype(np.int32), sp.top_k, sp.seed.view(np.int32),
                                       sampled]).astype(np.int32)[:, idx])

        return tokens, floats, ints

    def _run_decode(self, window: int, rows: int, steps: int) -> np.ndarray:
        """`steps` decode steps, gathered to every host at once: packed results [steps, 2, rows*groups]. The
        gather always takes `decode_steps` results (a shorter plan repeats its last), so one program serves
        every plan length."""
        if not 1 <= steps <= self.decode_steps:
            raise ValueError(f"a plan decodes 1..{self.decode_steps} steps (engine.decode_steps), got {steps}")
        outs = self._decode_steps(window, rows, steps)
        padded = outs + [outs[-1]] * (self.decode_steps - steps)
        return np.asarray(self.executable(self.programs_set.gather_shape(rows))(padded))[:steps]

    def step(self, plan: StepPlan) -> StepResult:
        """Apply one plan: release slots, prefill each item into its slot, then decode every active slot."""
        for slot in plan.release:
            self.slots.release(slot)
        outs, lengths = [], []
        for item in plan.prefills:  # dispatch every prefill before reading any result back
            self.slots.check_slot(item.slot)
            tokens = np.asarray(item.tokens, np.int32).reshape(-1)
            outs.append(self._run_prefill(tokens, item.slot, SlotSampling.from_params([item.sampling])))
            lengths.append(tokens.shape[0])
        p_tok, p_lp = np.zeros(len(outs), np.int32), np.zeros(len(outs), np.float32)
        for i, (item, out, n) in enumerate(zip(plan.prefills, outs, lengths, strict=True)):
            t, logp = _unpack(out)
            p_tok[i], p_lp[i] = t[0], logp[0]
            self.slots.start(item.slot, n, int(t[0]), item.sampling)
        result = StepResult(plan.step_id, p_tok, p_lp)
        n = plan.decode_steps
        if plan.decode and self.slots.active.any():
            self.slots.check_room(n)
            active = self.slots.active.copy()
            rows = self.rows_for(active)
            packed = self._run_decode(self.window_for(self.slots.longest_active() + n - 1), rows, n)
            idx = self.decoded_slots(rows)
            tokens = np.zeros((n, self._max_slots), np.int32)
            logprobs = np.zeros((n, self._max_slots), np.float32)
            tokens[:, idx], logprobs[:, idx] = _unpack(packed)
            for k in range(n):
                self.slots.advance(active, tokens[k])
            result.decode_tokens = np.where(active, tokens, 0).astype(np.int32)
            result.decode_logprobs = np.where(active, logprobs, 0.0).astype(np.float32)
        elif plan.decode:
            result.decode_tokens = np.zeros((n, self._max_slots), np.int32)
            result.decode_logprobs = np.zeros((n, self._max_slots), np.float32)
        return result

    def decode_hlo(self, window: int, rows: int) -> str:
        """The optimised HLO of the decode program for (window, rows): to inspect its collectives and copies."""
        text = self.executable(self.programs_set.decode_shape(window, rows)).as_text()
        if text is None:
            raise RuntimeError(f"the backend gave no HLO text for decode {window}x{rows}")
        return text

    def warmup(self, threads: int = 1) -> dict[str, float]:
        """Compile (or load from the persistent cache) every program of the ProgramSet, without running any.

        With `threads` > 1, programs compile side by side (XLA compiles without the GIL; worth it on hosts
        with many cores, such as TPU VMs). Must be called before any request is in a slot. Returns seconds
        per program, e.g. {"prefill_64": 9.8, "decode_256x4": 10.4} (window x rows per group); `programs`
        also says per program whether it came from the cache.
        """
        if self.slots.active.any():
            raise RuntimeError("warmup() must run before any slot is active")
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
        """Time one program's compile (or cache load) and first run; record where it came from."""
        t0 = time.perf_counter()
        with compile_cache.track() as count:
            yield
        self.compile_s[name] = time.perf_counter() - t0
        self.programs[name] = {"seconds": round(self.compile_s[name], 3), "source": count.source}

    def program_counts(self) -> dict[str, int]:
        """How many of this host's programs were loaded from the persistent cache and how many compiled."""
        sources = [p["source"] for p in self.programs.values()]
        return {"loaded": sources.count("cache"), "compiled": sources.count("compiled")}

