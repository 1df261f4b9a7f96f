"""The per-step control message every host executes, and what a step returns.

The coordinator (rank 0) decides one `StepPlan` per engine step; the dispatcher broadcasts it (as the bytes
of `StepPlan.to_bytes`) and every host runs `Engine.step(plan)` with it, in the same order, so all hosts
issue identical jitted calls with identical inputs. Plans are plain data (numpy + ints), small and cheap to
serialise; they never hold device arrays or Python objects from the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Per-slot sampling. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0

    def to_list(self) -> list:
        return [self.temperature, self.top_p, self.top_k, self.repetition_penalty, self.seed]

    @classmethod
    def from_list(cls, v: list) -> SamplingParams:
        return cls(float(v[0]), float(v[1]), int(v[2]), float(v[3]), int(v[4]))


@dataclass(frozen=True)
class PrefillItem:
    """Prefill `tokens` (unpadded int32 prompt ids) into batch slot `slot`, sampling its first token."""

    slot: int
    tokens: np.ndarray
    sampling: SamplingParams


@dataclass(frozen=True)
class StepPlan:
    """One engine step: release slots, prefill zero or more prompts into slots, then decode all active slots
    `decode_steps` times in a row (several tokens per plan: the per-plan costs, broadcast to the hosts and the
    tokens' readback, are paid once for all of them)."""

    step_id: int
    prefills: tuple[PrefillItem, ...] = ()
    decode: bool = False
    release: tuple[int, ...] = ()
    shutdown: bool = False
    decode_steps: int = 1

    def to_bytes(self) -> bytes:
        return msgpack.packb([
            self.step_id,
            [[p.slot, np.asarray(p.tokens, np.int32).tobytes(), p.sampling.to_list()] for p in self.prefills],
            self.decode, list(self.release), self.shutdown, self.decode_steps,
        ], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        step_id, prefills, decode, release, shutdown, decode_steps = msgpack.unpackb(data, raw=False)
        items = tuple(PrefillItem(int(s), np.frombuffer(t, np.int32), SamplingParams.from_list(sp))
                      for s, t, sp in prefills)
        return cls(int(step_id), items, bool(decode), tuple(int(r) for r in release), bool(shutdown),
                   int(decode_steps))


@dataclass
class StepResult:
    """Tokens a step produced, as host numpy arrays (read on rank 0; followers may skip reading them).

    prefill_tokens[i] is the first generated token of plan.prefills[i]. decode_tokens[k, s] is slot s's token
    from the plan's k-th decode step ([decode_steps, slots]; meaningless for inactive slots). The logprobs are the log-probabilities of those chosen tokens
    under the unfiltered, temperature-1 distribution.
    """

    step_id: int
    prefill_tokens: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.int32))
    prefill_logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.float32))
    decode_tokens: np.ndarray | None = None
    decode_logprobs: np.ndarray | None = None
