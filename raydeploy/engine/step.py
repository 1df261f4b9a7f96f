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

MAX_LOGIT_BIAS = 300
"""Entries of one request's logit_bias (OpenAI's bound); each row of a step carries this many (`LogitBiasRows`)."""


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

    Further per-request controls are further fields here, with their neutral value as the default: `resolve`
    and `to_wire` carry them by name, `build_inputs` lays them out per row, `sample` reads them. Scalar fields
    become one array per field; `logit_bias` becomes a fixed-width table per row and `min_tokens` a ban in the
    row's allowed-token bits (`raydeploy.engine.kv_cache.build_inputs`), so inside the programs those two keep
    their neutral values.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0
    """Any integer; reduced modulo 2**64 (`raydeploy.engine.sampling.seed_words`: the key takes both 32-bit
    words, and a seed below 2**32 draws what it always drew)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token the request has generated so far (not its prompt)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time the request has generated it (not its prompt)."""
    min_p: float = 0.0
    """Keep only tokens whose probability (after temperature) is at least min_p times the most likely one's."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value) pairs, sorted by id, added to the logits first; -100 is an exact ban. A mapping given
    here is kept as its sorted pairs (the type stays frozen and hashable)."""
    min_tokens: int = 0
    """The request's stop tokens (eos unless ignored, and its stop ids) cannot be drawn before this many tokens
    were generated (the scheduler sends them with the first chunk: `SeqStep.stop_ids`)."""

    def __post_init__(self) -> None:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))

    @classmethod
    def resolve(cls, defaults: Any, *, temperature: float | None = None, top_p: float | None = None,
                top_k: int | None = None, repetition_penalty: float | None = None, seed: int = 0,
                presence_penalty: float | None = None, frequency_penalty: float | None = None,
                min_p: float | None = None, logit_bias: Mapping[int, float] | None = None,
                min_tokens: int | None = None) -> SamplingParams:
        """A request's sampling: each value given, else the one of `defaults` (`engine.sampling`, a
        `SamplingDefaults`, or another SamplingParams): the one rule for the HTTP API, `generate` and `predict`.
        The OpenAI controls (penalties, min_p, logit_bias, min_tokens) have no config default: None is neutral.
        A value out of its range is a ValueError naming the field (`check`)."""
        out = cls(temperature=float(defaults.temperature if temperature is None else temperature),
                  top_p=float(defaults.top_p if top_p is None else top_p),
                  top_k=int(defaults.top_k if top_k is None else top_k),
                  repetition_penalty=float(defaults.repetition_penalty if repetition_penalty is None
                                           else repetition_penalty),
                  seed=int(seed),
                  presence_penalty=0.0 if presence_penalty is None else float(presence_penalty),
                  frequency_penalty=0.0 if frequency_penalty is None else float(frequency_penalty),
                  min_p=0.0 if min_p is None else float(min_p),
                  logit_bias=() if logit_bias is None else tuple(logit_bias.items()),
                  min_tokens=0 if min_tokens is None else int(min_tokens))
        out.check()
        return out

    def check(self) -> None:
        """ValueError naming the first field outside what the engine honours: penalties in [-2, 2], min_p in
        [0, 1], at most `MAX_LOGIT_BIAS` logit_bias entries with values in [-100, 100] and ids >= 0, min_tokens
        >= 0."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"sampling {name} {v} is outside [-2, 2]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling min_p {self.min_p} is outside [0, 1]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"sampling logit_bias has {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise ValueError("sampling logit_bias names a token id more than once")
        for t, b in self.logit_bias:
            if t < 0 or not -100.0 <= b <= 100.0:
                raise ValueError(f"sampling logit_bias entry {t}: {b} needs a token id >= 0 and a value in "
                                 f"[-100, 100]")
        if self.min_tokens < 0:
            raise ValueError(f"sampling min_tokens {self.min_tokens} is negative")

    def to_wire(self) -> dict[str, Any]:
        """The fields by name (msgpack-able; logit_bias as [id, value] pairs)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, v: Mapping[str, Any]) -> SamplingParams:
        """The inverse of `to_wire`; a name this type does not have is an error naming it."""
        neutral = cls()
        known = sorted(f.name for f in fields(cls))
        unknown = sorted(set(v) - set(known))
        if unknown:
            raise ValueError(f"sampling fields {unknown} are not among {known}")
        values: dict[str, Any] = {n: (tuple((int(t), float(b)) for t, b in x) if n == "logit_bias"
                                      else type(getattr(neutral, n))(x)) for n, x in v.items()}
        return cls(**values)


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
    computes it from the request's matcher, every host applies the same bits in the jitted sampler. Such a row
    draws in its plan's first pass only (`first_pass_only`): the next mask needs this token.

    `stop_ids`, `stop_until`: set on the first chunk of a request with `min_tokens`: the ids that would end it
    (the model's eos unless ignored, and its stop ids) and the position before which its draws may not take them
    (prompt length + min_tokens). The engine keeps them for the slot and clears those tokens' allowed bits in each
    pass whose draw takes a position below `stop_until`, so the ban is exact in every pass of a multi-pass plan.
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
    stop_ids: np.ndarray | None = None
    stop_until: int = 0
    spec: int = 0
    """A speculating decode row (`raydeploy.engine.speculative`): its `tokens` are the slot's last sampled token
    then `spec` proposed tokens, at positions `start`.., verified in a one-pass plan; it samples at each of its
    places and emits the accepted proposals and the draw after them (`StepResult.spec_tokens`)."""
    adapter: int = -1
    """Set on a request's first chunk: the LoRA adapter slot every token of the request uses (-1: the base
    model); the engine keeps it for the slot (`raydeploy.lora`)."""

    @property
    def first_pass_only(self) -> bool:
        """Whether this row draws in its plan's first pass only: a constrained row (`allowed`), whose next mask
        needs this token on rank 0. The engine leaves it out of the plan's later passes (it writes no K/V, token
        state or last token there) and its plan's later token rows hold 0 for it."""
        return self.allowed is not None

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
        if self.stop_ids is not None:
            out["stop_ids"] = np.asarray(self.stop_ids, np.int32).tobytes()
            out["stop_until"] = self.stop_until
        if self.spec:
            out["spec"] = self.spec
        if self.adapter >= 0:
            out["adapter"] = self.adapter
        return out

    @classmethod
    def from_wire(cls, v: Mapping[str, Any]) -> SeqStep:
        sampling, prefix, allowed = v.get("sampling"), v.get("prefix_tokens"), v.get("allowed")
        stop_ids = v.get("stop_ids")
        return cls(int(v["slot"]), np.frombuffer(v["tokens"], np.int32), int(v["start"]), bool(v["sample"]),
                   None if sampling is None else SamplingParams.from_wire(sampling),
                   None if prefix is None else np.frombuffer(prefix, np.int32),
                   None if allowed is None else np.frombuffer(allowed, np.uint32),
                   bool(v.get("top_logprobs", False)), bool(v.get("prompt_logprobs", False)),
                   int(v.get("next_token", -1)),
                   None if stop_ids is None else np.frombuffer(stop_ids, np.int32), int(v.get("stop_until", 0)),
                   int(v.get("spec", 0)), adapter=int(v.get("adapter", -1)))


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
    spec_tokens: np.ndarray | None = None
    """[len(plan.seqs), k + 1] int32 in a plan with speculating rows (`SeqStep.spec`): each such row's emitted
    tokens (its accepted proposals, then the token drawn after them), -1 after them and on other rows; their
    first is `tokens[0, i]`. None in a plan without one."""
    spec_logprobs: np.ndarray | None = None
    """Their raw logprobs, shaped like `spec_tokens`."""


MAX_TOP_LOGPROBS = 20
"""Alternatives a step computes per token (OpenAI's bound on `top_logprobs`); a request's smaller count is cut on the
host (`raydeploy.engine.logprobs`)."""


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
