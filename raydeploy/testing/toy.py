"""A tiny stand-in engine with the real engine's step interface, for gang tests, control benchmarks and
`--engine toy` (a cluster smoke test without weights).

It runs one small jitted step per `StepPlan` over the global mesh, with a weight sharded over every
device so each step does a cross-host reduction like a real decode step, and produces deterministic
tokens (`next = f(last)`) that a test can predict. `load_toy_engine` is its engine factory
(raydeploy.gang.runtime.ENGINES["toy"]). It loads no checkpoint and compiles in about a second,
so bring-up, dispatch and failure handling can be exercised without the model. Imported only inside host
processes (it imports JAX).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from raydeploy.engine.request import RequestFailed
from raydeploy.engine.step import SeqStep, StepPlan, StepResult

TOY_VOCAB = 256


def toy_next_token(last: np.ndarray | int) -> np.ndarray:
    """What the toy step returns for a slot whose previous token is `last` (the test oracle)."""
    return (np.asarray(last, np.int64) * 7 + 3) % TOY_VOCAB


def toy_allowed_token(natural: int, allowed: np.ndarray) -> int | None:
    """What the toy draws for a constrained row (the test oracle): its natural next token if the packed bits
    `allowed` (`SeqStep.allowed`'s layout, over any vocabulary) allow it, else the smallest allowed id above it,
    else the smallest allowed id; None when no bit is set."""
    bits = np.unpackbits(np.asarray(allowed, np.uint32).reshape(-1).astype("<u4").view(np.uint8), bitorder="little")
    ids = np.flatnonzero(bits)
    if ids.size == 0:
        return None
    above = ids[ids >= natural]
    return int(above[0] if above.size else ids[0])


def toy_expected_tokens(prompt_ids: list[int] | tuple[int, ...], max_tokens: int,
                        eos_token_ids: tuple[int, ...] = (2,)) -> list[int]:
    """The tokens the toy gang generates for a prompt (the oracle of toy-engine tests); stops after eos."""
    out: list[int] = []
    last = int(prompt_ids[-1])
    while len(out) < max_tokens:
        last = int(toy_next_token(last))
        out.append(last)
        if last in eos_token_ids:
            break
    return out


class ToyEngine:
    """Slots hold their last token; decode maps it through a sharded one-hot matmul to `toy_next_token`."""

    def __init__(self, mesh: jax.sharding.Mesh, max_slots: int, eos_token_ids: tuple[int, ...] = (2,)) -> None:
        self.mesh = mesh
        self.max_slots = max_slots
        self.eos_token_ids = eos_token_ids
        axes = tuple(mesh.axis_names)
        # transition table T[v, next(v)] = 1, with the vocabulary dimension split over every device
        table = np.zeros((TOY_VOCAB, TOY_VOCAB), np.float32)
        table[np.arange(TOY_VOCAB), toy_next_token(np.arange(TOY_VOCAB))] = 1.0
        self._table = jax.make_array_from_callback(table.shape, NamedSharding(mesh, P(axes, None)),
                                                   lambda idx: table[idx])
        self._replicated = NamedSharding(mesh, P())
        self._last = np.zeros((max_slots,), np.int32)
        self._step = jax.jit(self._decode, out_shardings=self._replicated)

    @staticmethod
    def _decode(table: jax.Array, last: jax.Array) -> jax.Array:
        onehot = jax.nn.one_hot(last, TOY_VOCAB, dtype=jnp.float32)  # [slots, vocab]
        return jnp.argmax(onehot @ table, axis=-1).astype(jnp.int32)  # contraction over the sharded vocab

    def _run(self, last: np.ndarray) -> np.ndarray:
        arr = jax.make_array_from_callback(last.shape, self._replicated, lambda idx: last[idx])
        return np.asarray(self._step(self._table, arr))

    def warmup(self, threads: int = 1) -> dict[str, Any]:
        self._run(np.zeros((self.max_slots,), np.int32))
        return {"programs": 1}

    @property
    def geometry(self) -> None:
        """No KV pages: the toy keeps each slot's last token only."""
        return None

    def status(self) -> dict[str, Any]:
        return {}

    def step(self, plan: StepPlan) -> StepResult:
        """Releases, then each sequence of the plan: a prompt's chunk sets its slot's last token (its last chunk
        samples the next), and the decode rows run `decode_steps` passes of the sharded step. No pages: the
        toy keeps no cache beyond each slot's last token. A row with an allowed-token mask draws
        `toy_allowed_token` (its plan must run one pass, as the real engine's; a mask that allows nothing fails
        the row's request), so serve tests over the toy can check that masks reach the engine."""
        self._check_allowed(plan)
        for s in plan.release:
            self._last[s] = 0
        tokens = np.zeros((plan.decode_steps, len(plan.seqs)), np.int32)
        rows: list[tuple[int, int]] = []  # (column, slot) of the decode rows
        for i, q in enumerate(plan.seqs):
            new = np.asarray(q.tokens).reshape(-1)
            if new.size == 0:
                rows.append((i, q.slot))
                continue
            self._last[q.slot] = int(new[-1])
            if q.sample:
                self._last[q.slot] = tokens[0, i] = int(toy_next_token(self._last[q.slot]))
        for k in range(plan.decode_steps if rows else 0):
            decoded = self._run(self._last)
            for i, s in rows:
                self._last[s] = tokens[k, i] = decoded[s]
        for i, q in enumerate(plan.seqs):  # constrained rows: the natural token, or the mask's choice
            if q.sample and q.allowed is not None:
                chosen = toy_allowed_token(int(tokens[0, i]), q.allowed)
                assert chosen is not None  # `_check_allowed` failed the requests of masks that allow nothing
                self._last[q.slot] = tokens[0, i] = chosen
        return StepResult(plan.step_id, tokens=tokens, logprobs=np.zeros(tokens.shape, np.float32))


    @staticmethod
    def _check_allowed(plan: StepPlan) -> None:
        """The real engine's rules for masks, before anything runs: one pass per plan with a mask (ValueError
        naming the slot), and a mask that allows some token (`RequestFailed` naming the slots)."""
        masked = [q for q in plan.seqs if q.allowed is not None]
        if masked and plan.decode_steps > 1:
            raise ValueError(f"plan {plan.step_id}: slot {masked[0].slot} carries an allowed-token mask in a plan of "
                             f"decode_steps {plan.decode_steps}; a constrained row needs each token before its "
                             f"next mask, so its plan runs one pass")
        empty = tuple(q.slot for q in masked if not np.asarray(q.allowed).any())
        if empty:
            raise RequestFailed(f"slot {empty[0]}: its allowed-token mask allows no token", slots=empty)


class ToyScheduler:
    """A minimal FIFO scheduler with the real scheduler's interface (submit/abort/next_plan/on_result/fail_all).

    One whole prompt per step (one chunk that samples), beside a decode row for every slot past its first token;
    finishes on max_tokens or eos. Host-agnostic and
    JAX-free in behaviour; used with the toy engine to test the gang without the model.
    """

    def __init__(self, max_slots: int, eos_token_ids: tuple[int, ...] = (2,)) -> None:
        import threading
        from collections import deque

        self._work = threading.Event()
        self.max_slots = max_slots
        self.eos = set(eos_token_ids)
        self.queue: deque = deque()
        self.active: dict[int, list] = {}  # slot -> [req, sink, n_generated]
        self.release: list[int] = []
        self.step_id = 0

    def submit(self, req: Any, sink: Any) -> None:
        self.queue.append((req, sink))
        self._work.set()

    def wait_for_work(self, timeout_s: float) -> bool:
        got = self._work.wait(timeout_s)
        self._work.clear()
        return got

    def abort(self, request_id: str) -> bool:
        self._work.set()
        for i, (req, _) in enumerate(self.queue):
            if req.request_id == request_id:
                del self.queue[i]
                return True
        for slot, (req, _, _) in list(self.active.items()):
            if req.request_id == request_id:
                del self.active[slot]
                self.release.append(slot)
                return True
        return False

    def next_plan(self) -> StepPlan | None:
        seqs = [SeqStep(s, np.zeros(0, np.int32), len(v[0].prompt_token_ids) + v[2] - 1, True)
                for s, v in self.active.items() if v[2] > 0]
        free = [s for s in range(self.max_slots) if s not in self.active]
        if self.queue and free:
            req, sink = self.queue.popleft()
            self.active[free[0]] = [req, sink, 0]
            seqs.append(SeqStep(free[0], np.asarray(req.prompt_token_ids, np.int32), 0, True, req.sampling))
        if not seqs and not self.release:
            return None
        plan = StepPlan(self.step_id, release=tuple(self.release), seqs=tuple(seqs))
        self.release = []
        self.step_id += 1
        return plan

    def _emit(self, slot: int, token: int) -> None:
        from raydeploy.engine.request import FinishReason, TokenEvent

        req, sink, n = self.active[slot]
        done: FinishReason | None = None
        if token in self.eos and not req.ignore_eos:
            done = "stop"
        elif n + 1 >= req.max_tokens:
            done = "length"
        sink(TokenEvent(req.request_id, int(token), 0.0, n, done))
        self.active[slot][2] = n + 1
        if done:
            del self.active[slot]
            self.release.append(slot)

    def on_result(self, plan: StepPlan, result: StepResult) -> None:
        if result.tokens is None:
            raise ValueError(f"step {plan.step_id}: the engine returned no tokens")
        for i, q in enumerate(plan.seqs):
            if q.slot in self.active:
                self._emit(q.slot, int(result.tokens[0, i]))

    def fail_all(self, error: str, retriable: bool) -> None:
        from raydeploy.engine.request import TokenEvent

        for req, sink in list(self.queue):
            sink(TokenEvent(req.request_id, None, finish_reason="error", error=error, retriable=retriable))
        for req, sink, n in self.active.values():
            sink(TokenEvent(req.request_id, None, index=n, finish_reason="error", error=error, retriable=retriable))
        self.queue.clear()
        self.active.clear()

    def _rows(self, plan: StepPlan) -> list[int]:
        """The active slots `plan` carries (its prompts and its decode rows)."""
        return [q.slot for q in plan.seqs if q.slot in self.active]

    def _fail_slot(self, slot: int, plan: StepPlan, message: str, invalid: bool) -> None:
        from raydeploy.engine.request import TokenEvent

        req, sink, n = self.active.pop(slot)
        self.release.append(slot)
        why = message.removeprefix(f"request {req.request_id}: ")
        sink(TokenEvent(req.request_id, None, index=n, finish_reason="error", retriable=False, invalid=invalid,
                        error=f"request {req.request_id} failed in step {plan.step_id}: {why}"))

    def step_failed(self, plan: StepPlan, failure: Any) -> bool:
        """As `Scheduler.step_failed`: fail the named rows; the plan's other prompts go back to the queue's head
        (the engine never ran them) and its releases go out again."""
        named = [s for s in self._rows(plan)
                 if s in failure.slots or self.active[s][0].request_id in failure.request_ids]
        if not named:
            return False
        self.release = list(dict.fromkeys([*plan.release, *self.release]))
        for s in named:
            self._fail_slot(s, plan, failure.message, failure.invalid)
        for q in reversed(plan.seqs):
            if len(q.tokens) and q.slot in self.active:
                req, sink, _ = self.active.pop(q.slot)
                self.queue.appendleft((req, sink))
                self.release.append(q.slot)
        self._work.set()
        return True

    def fail_step(self, plan: StepPlan, error: str) -> None:
        for s in self._rows(plan):
            self._fail_slot(s, plan, error, False)

    def stats(self) -> dict[str, Any]:
        return {"queue_depth": len(self.queue), "slots_in_use": len(self.active), "max_slots": self.max_slots}


def load_toy_engine(cfg: Any, mesh: jax.sharding.Mesh, checkpoint_path: str | None) -> Any:
    """The engine factory of the stand-in: no checkpoint read; its scheduler is `ToyScheduler`."""
    from raydeploy.gang.runtime import LoadedEngine

    eos = (2,)
    engine = ToyEngine(mesh, cfg.engine.max_slots, eos)
    return LoadedEngine(engine, {"bytes_read": 0, "seconds": 0.0, "gbps": 0.0}, eos,
                        lambda: ToyScheduler(cfg.engine.max_slots, eos))
