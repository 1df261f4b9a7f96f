"""The per-step control message every host executes, and what a step returns.

A `StepPlan` is one ragged mixed step over the paged KV cache (`seqs`: prefill chunks and decode rows) with the
page-table changes the scheduler made (`pages`).

The coordinator (rank 0) decides one `StepPlan` per engine step; the dispatcher broadcasts it (as the bytes
of `StepPlan.to_bytes`) and every host runs `Engine.step(plan)` with it, in the same order, so all hosts
issue identical jitted calls with identical inputs. Plans are plain data (numpy + ints), small and cheap to
serialise; they never hold device arrays or Python objects from the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples its tokens: the one sampling type from the HTTP request to the jitted sampler.

    On the host each field holds one request's value. Inside the jitted programs the same type holds one array
    per field, a value per sequence row (it is a pytree there: `raydeploy.engine.sampling` registers it, so this
    module and the HTTP ingress stay free of JAX), and crosses `shard_map` as it is. It travels between hosts
    as a map of its field names (`to_wire`).

    temperature 0 is greedy; top_p 1, top_k 0 and repetition_penalty 1 turn those off. These field values are
    the neutral ones (what a slot with nothing to sample holds), not defaults for users: every command and the
    HTTP API take the values a request leaves out from `engine.sampling` of the config (`resolve`).

    Further per-request controls (penalties, logit bias, logprobs) are further fields here, with their neutral
    value as the default: `resolve` and `to_wire` carry them by name, `build_inputs` lays them out per row,
    `sample` reads them.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0

    @classmethod
    def resolve(cls, defaults: Any, *, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None, repetition_penalty: float | None = None, seed: int = 0
                ) -> SamplingParams:
        """A request's sampling: each value given, else the one of `defaults` (`engine.sampling`, a
        `SamplingDefaults`, or another SamplingParams): the one rule for the HTTP API, `generate` and `predict`."""
        return cls(temperature=float(defaults.temperature if temperature is None else temperature),
                   top_p=float(defaults.top_p if top_p is None else top_p),
                   top_k=int(defaults.top_k if top_k is None else top_k),
                   repetition_penalty=float(defaults.repetition_penalty if repetition_penalty is None
                                            else repetition_penalty),
                   seed=int(seed))

    def to_wire(self) -> dict[str, float | int]:
        """The fields by name (msgpack-able)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, v: Mapping[str, Any]) -> SamplingParams:
        """The inverse of `to_wire`; a name this type does not have is an error naming it."""
        neutral = cls()
        known = sorted(f.name for f in fields(cls))
        unknown = sorted(set(v) - set(known))
        if unknown:
            raise ValueError(f"sampling fields {unknown} are not among {known}")
        return cls(**{n: type(getattr(neutral, n))(x) for n, x in v.items()})


@dataclass(frozen=True)
class SeqStep:
    """One sequence's work in a paged step.

    `tokens` are the new input tokens (a prompt chunk); empty for a decode row, whose input is the slot's last
    sampled token (the engine keeps it on the devices). `start` is the position of the first new token (the
    tokens already in the slot's pages). `sample`: draw one token after the last new token (a prompt's last
    chunk, or a decode row). `sampling` is set on a request's first chunk only: the engine keeps it for the
    slot and resets the slot's repetition-penalty set to `prefix_tokens`, the prompt ids [0, start) that reused
    (prefix-cached) pages already hold.

    Logprobs beyond the sampled token's (`raydeploy.engine.logprobs`): `top_logprobs` on a sampling row asks for
    the `MAX_TOP_LOGPROBS` most likely tokens of the distribution it draws from (the host trims to the request's
    count); `prompt_logprobs` on a prompt chunk asks for the logprob of the token after each of its places (with
    alternatives): the chunk's own tokens after its first, then `next_token`, the prompt token after the chunk
    (-1 on the prompt's last chunk, whose last place predicts the sampled token).

    `allowed`: set on a sampling row of a constrained request (structured outputs, `raydeploy.constraints`):
    the tokens its next draw may take, as packed bits (uint32 words [ceil(vocab / 32)], token i allowed when bit
    i % 32 of word i // 32 is set; the model's vocabulary, tokens past the grammar's vocabulary cleared). Rank 0
    computes it from the request's matcher, every host applies the same bits in the jitted sampler. A plan with
    such a row runs one pass (`decode_steps` 1): the next mask needs this token.
    """

    slot: int
    tokens: np.ndarray
    start: int
    sample: bool
    sampling: SamplingParams | None = None
    prefix_tokens: np.ndarray | None = None
    allowed: np.ndarray | None = None
    top_logprobs: bool = False
    prompt_logprobs: bool = False
    next_token: int = -1

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes for the sequence (a decode row computes one)."""
        return max(int(np.asarray(self.tokens).shape[0]), 1)

    def to_wire(self) -> dict[str, Any]:
        """The fields by name (msgpack-able); the sampling and the prefix only where they are set."""
        out: dict[str, Any] = {"slot": self.slot, "tokens": np.asarray(self.tokens, np.int32).tobytes(),
                               "start": self.start, "sample": self.sample}
        if self.sampling is not None:
            out["sampling"] = self.sampling.to_wire()
        if self.prefix_tokens is not None:
            out["prefix_tokens"] = np.asarray(self.prefix_tokens, np.int32).tobytes()
        if self.allowed is not None:
            out["allowed"] = np.asarray(self.allowed, np.uint32).tobytes()
        if self.top_logprobs:
            out["top_logprobs"] = True
        if self.prompt_logprobs:
            out["prompt_logprobs"] = True
            out["next_token"] = self.next_token
        return out

    @classmethod
    def from_wire(cls, v: Mapping[str, Any]) -> SeqStep:
        sampling, prefix, allowed = v.get("sampling"), v.get("prefix_tokens"), v.get("allowed")
        return cls(int(v["slot"]), np.frombuffer(v["tokens"], np.int32), int(v["start"]), bool(v["sample"]),
                   None if sampling is None else SamplingParams.from_wire(sampling),
                   None if prefix is None else np.frombuffer(prefix, np.int32),
                   None if allowed is None else np.frombuffer(allowed, np.uint32),
                   bool(v.get("top_logprobs", False)), bool(v.get("prompt_logprobs", False)),
                   int(v.get("next_token", -1)))


@dataclass(frozen=True)
class PageUpdate:
    """page_table[slot, first : first + len(pages)] = pages, with page ids local to the slot's dp group (row
    entry i holds the slot's tokens [i * page_size, (i + 1) * page_size))."""

    slot: int
    first: int
    pages: np.ndarray

    def to_list(self) -> list:
        return [self.slot, self.first, np.asarray(self.pages, np.int32).tobytes()]

    @classmethod
    def from_list(cls, v: list) -> PageUpdate:
        return cls(int(v[0]), int(v[1]), np.frombuffer(v[2], np.int32))


@dataclass(frozen=True)
class StepPlan:
    """One engine step: release slots, apply the page-table changes, then run each sequence's work in one ragged
    step; a plan of decode rows only runs `decode_steps` passes in a row (several tokens per plan: the per-plan
    costs, broadcast to the hosts and the tokens' readback, are paid once for all of them)."""

    step_id: int
    release: tuple[int, ...] = ()
    shutdown: bool = False
    decode_steps: int = 1
    seqs: tuple[SeqStep, ...] = ()
    """Each sequence's work this step (prefill chunks and decode rows in one ragged step)."""
    pages: tuple[PageUpdate, ...] = ()
    """Page-table changes, applied before the step runs."""

    def to_bytes(self) -> bytes:
        return msgpack.packb([
            self.step_id, list(self.release), self.shutdown, self.decode_steps,
            [q.to_wire() for q in self.seqs], [u.to_list() for u in self.pages],
        ], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        step_id, release, shutdown, decode_steps, seqs, pages = msgpack.unpackb(data, raw=False)
        return cls(int(step_id), tuple(int(r) for r in release), bool(shutdown), int(decode_steps),
                   tuple(SeqStep.from_wire(q) for q in seqs), tuple(PageUpdate.from_list(u) for u in pages))


@dataclass
class StepResult:
    """Tokens a step produced, as host numpy arrays (read on rank 0; followers may skip reading them).

    tokens[k, i] is plan.seqs[i]'s token from the plan's k-th pass ([decode_steps, len(plan.seqs)]; meaningful
    where the sequence samples). The logprobs are the log-probabilities of those chosen tokens under the
    unfiltered, temperature-1 distribution, shaped like `tokens`.
    """

    step_id: int
    tokens: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    """[decode_steps, len(plan.seqs), MAX_TOP_LOGPROBS] int32: the most likely tokens of each sampled token's
    distribution (the same raw one), most likely first; None when no row of the plan asked (`SeqStep.top_logprobs`)."""
    top_logprobs: np.ndarray | None = None
    """Their logprobs, shaped like `top_ids` (descending)."""
    prompt: tuple[PromptLogprobs | None, ...] | None = None
    """Per plan sequence, the prompt logprobs of a chunk that asked (`SeqStep.prompt_logprobs`); None otherwise."""


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt chunk's logprobs: entry i is the token after the chunk's place i (position start + i + 1) under the
    raw model distribution at place i, with its rank (1 = the most likely) and the `MAX_TOP_LOGPROBS` most likely
    tokens there; a chunk of n places has n entries (the prompt's last chunk n - 1: its last place predicts the
    sampled token)."""

    logprob: np.ndarray
    """[n] float32."""
    rank: np.ndarray
    """[n] int32."""
    top_ids: np.ndarray
    """[n, K] int32, most likely first."""
    top_logprobs: np.ndarray
    """[n, K] float32, descending."""
