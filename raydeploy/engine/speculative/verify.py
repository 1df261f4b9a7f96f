"""The verification of speculating rows inside the step program: its inputs (`SpecInputs`, built on the host by
`build_spec_inputs`), the acceptance rule (`accept_lengths`) and the sampling tail (`verify_tail`).

A verify program (`ProgramShape` "verify") is a step program with S speculating rows per dp group beside the
step's other rows. A speculating row is a chunk [last token, p_1 .. p_n] (n <= k proposals) at positions
start .. start + n; the step writes its K/V like any chunk's. Its k + 1 verification places j = 0 .. k (padding
past n) each get logits, and a draw as a plain decode row would make there:
- the same processed distribution: the row's slot state (`STATE_DTYPE`) with p_1 .. p_j counted as generated
  (the penalties' view of the sequence at that place), its logit_bias, temperature, top-k, top-p, min_p;
- the same randomness: the key of the position the drawn token takes (start + j + 1).
`accept_lengths` then takes the longest prefix of proposals that equal the draws before them; the row emits
those proposals and the draw after them, and only those tokens enter the slot's state and its last token.

Rows that are not speculating never reach this module: a step without a speculating row runs the plain step
programs, which take no `SpecInputs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from raydeploy.engine.sampling import (
    BIAS_PAD,
    COUNT_MAX,
    MAX_LOGIT_BIAS,
    NEUTRAL,
    ROW_DTYPES,
    ROW_WIDTHS,
    LogitBiasRows,
    row_value,
    sample,
)
from raydeploy.engine.step import SamplingParams, SeqStep


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecInputs:
    """A verify step's speculating rows: S rows per dp group, k + 1 verification places each, laid out group
    after group like `StepInputs` (leading axis split over dp)."""

    slot: jax.Array          # i32[G*S] global slot of each speculating row; max_slots for padding
    proposals: jax.Array     # i32[G*S, k] the proposed tokens; -1 past a row's proposals (never accepted)
    place: jax.Array         # i32[G*S*(k+1)] each verification place's token place within its group
    position: jax.Array      # i32[G*S*(k+1)] the position the token drawn there takes (its randomness key)
    params: SamplingParams   # [G*S*(k+1)] the row's sampling at each of its places
    bias: LogitBiasRows      # [G*S*(k+1), MAX_LOGIT_BIAS]
    any_sampled: jax.Array   # bool[] some speculating row samples (temperature > 0)
    any_filtered: jax.Array  # bool[] some has top-k, top-p or min_p
    any_adjusted: jax.Array  # bool[] some has a logit bias or a presence / frequency penalty


SPEC_LAYOUT = {"slot": "rows", "proposals": "rows", "place": "rows", "position": "rows",
               **{f"params.{n}": "rows" for n in ROW_DTYPES}, "bias.ids": "rows", "bias.values": "rows",
               "any_sampled": "replicated", "any_filtered": "replicated", "any_adjusted": "replicated"}
"""Each field by flat name: "rows" = split over dp on its leading axis, "replicated"."""


def abstract_spec_inputs(groups: int, rows: int, k: int) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """Shape and dtype of every `SpecInputs` field by flat name, for `rows` (S) speculating rows per group of k
    proposals."""
    i32 = np.dtype(np.int32)
    s, p = groups * rows, groups * rows * (k + 1)
    out: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {
        "slot": ((s,), i32), "proposals": ((s, k), i32), "place": ((p,), i32), "position": ((p,), i32)}
    out.update({f"params.{n}": ((p, *ROW_WIDTHS.get(n, ())), dt) for n, dt in ROW_DTYPES.items()})
    out["bias.ids"] = ((p, MAX_LOGIT_BIAS), i32)
    out["bias.values"] = ((p, MAX_LOGIT_BIAS), np.dtype(np.float32))
    for flag in ("any_sampled", "any_filtered", "any_adjusted"):
        out[flag] = ((), np.dtype(bool))
    return out


def spec_from_flat(arrays: dict[str, Any]) -> SpecInputs:
    params = SamplingParams(**{n: arrays[f"params.{n}"] for n in ROW_DTYPES})
    bias = LogitBiasRows(ids=arrays["bias.ids"], values=arrays["bias.values"])
    return SpecInputs(slot=arrays["slot"], proposals=arrays["proposals"], place=arrays["place"],
                      position=arrays["position"], params=params, bias=bias, any_sampled=arrays["any_sampled"],
                      any_filtered=arrays["any_filtered"], any_adjusted=arrays["any_adjusted"])


@dataclasses.dataclass
class HostSpec:
    """A verify step's `SpecInputs` on the host, and where each speculating plan sequence's results land."""

    arrays: dict[str, np.ndarray]
    rows: dict[int, int]
    """plan sequence index -> its speculating row ([G*S]); its places are rows * (k + 1) .. + k."""


def build_spec_inputs(seqs: Sequence[SeqStep], places: Sequence[int], tokens: int, groups: int,
                      slots_per_group: int, rows: int, k: int, max_slots: int,
                      sampling: Sequence[SamplingParams], bias: Sequence[tuple[np.ndarray, np.ndarray] | None]
                      ) -> HostSpec:
    """The host arrays of a verify pass: `seqs` the plan's sequences (those with `spec` speculate), `places`
    each one's first flat token place (`HostStep.places`), `tokens` the program's places per group (T), `rows`
    (S) and `k` the program's speculating rows per group and proposals per row; `sampling` and `bias` every
    slot's (`PageTables`)."""
    shapes = abstract_spec_inputs(groups, rows, k)
    a = {n: np.zeros(shape, dt) for n, (shape, dt) in shapes.items()}
    a["slot"][:] = max_slots
    a["proposals"][:] = -1
    a["bias.ids"][:] = BIAS_PAD
    for name in ROW_DTYPES:
        a[f"params.{name}"][:] = row_value(NEUTRAL, name)
    fill = np.zeros(groups, np.int64)
    out: dict[int, int] = {}
    any_sampled = any_filtered = any_adjusted = False
    for i, q in enumerate(seqs):
        if not q.spec:
            continue
        g = q.slot // slots_per_group
        if fill[g] >= rows:
            raise ValueError(f"slot {q.slot}: more than {rows} speculating rows in dp group {g} "
                             f"(engine.speculative.max_rows)")
        row = g * rows + int(fill[g])
        fill[g] += 1
        out[i] = row
        toks = np.asarray(q.tokens, np.int32).reshape(-1)
        n = int(q.spec)
        a["slot"][row] = q.slot
        a["proposals"][row, :n] = toks[1:1 + n]
        local = places[i] - g * tokens
        first = row * (k + 1)
        j = np.arange(k + 1)
        a["place"][first:first + k + 1] = local + np.minimum(j, n)
        a["position"][first:first + k + 1] = q.start + np.minimum(j, n) + 1
        sp = sampling[q.slot]
        for name in ROW_DTYPES:
            a[f"params.{name}"][first:first + k + 1] = row_value(sp, name)
        any_sampled |= sp.temperature > 0
        any_filtered |= sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0)
        b = bias[q.slot]
        any_adjusted |= b is not None or sp.presence_penalty != 0 or sp.frequency_penalty != 0
        if b is not None:
            a["bias.ids"][first:first + k + 1] = b[0]
            a["bias.values"][first:first + k + 1] = b[1]
    a["any_sampled"] = np.asarray(any_sampled)
    a["any_filtered"] = np.asarray(any_filtered)
    a["any_adjusted"] = np.asarray(any_adjusted)
    return HostSpec(a, out)


def as_single_rows(seqs: Sequence[SeqStep]) -> tuple[list[SeqStep], list[int]]:
    """`seqs` with each speculating row split into one-token rows, one per place (its last token, then each
    proposal, at positions start, start + 1, ..; sampling nothing: the verification draws), so each place attends
    as a plain decode row there does (`ProgramSet.verify_rows`); and each plan sequence's first row among them."""
    out: list[SeqStep] = []
    first: list[int] = []
    for q in seqs:
        first.append(len(out))
        if not q.spec:
            out.append(q)
            continue
        toks = np.asarray(q.tokens, np.int32).reshape(-1)
        out.extend(SeqStep(q.slot, toks[j:j + 1], q.start + j, False) for j in range(toks.size))
    return out, first


def accept_lengths(drawn_sk: jax.Array, proposals_sk: jax.Array) -> jax.Array:
    """Accepted proposals per row [S]: the longest prefix where each proposal equals the draw at the place before
    it (`drawn_sk[:, j]` is the token drawn after the row's place j, i.e. in proposal j's position)."""
    match = (drawn_sk == proposals_sk).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(match, axis=-1), axis=-1)


def _with_generated(state_sv: jax.Array, tokens_sn: jax.Array, take_sn: jax.Array) -> jax.Array:
    """Slot states [S, V] (`STATE_DTYPE`) with the tokens where `take` holds counted as generated once per
    occurrence (saturating at `COUNT_MAX`, in-sequence bit set)."""
    s, v = state_sv.shape
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], tokens_sn.shape)
    cols = jnp.where(take_sn & (tokens_sn >= 0), tokens_sn, v)  # v: dropped
    times = jnp.zeros((s, v), jnp.int32).at[rows, cols].add(1, mode="drop")
    old = state_sv.astype(jnp.int32)
    new = jnp.minimum(old + 2 * times, 2 * COUNT_MAX) | 1
    return jnp.where(times > 0, new, old).astype(state_sv.dtype)


def verify_tail(logits: jax.Array, presence: jax.Array, last_tokens: jax.Array, slot: jax.Array,
                proposals: jax.Array, position: jax.Array, params: SamplingParams, bias: LogitBiasRows,
                any_sampled: jax.Array, any_filtered: jax.Array, any_adjusted: jax.Array, *, max_slots: int,
                vocab_chunks: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A group's speculating rows: `logits` [S*(k+1), V] at their verification places, `presence` and
    `last_tokens` the group's slots'. Returns the slots' states and last tokens with each row's emitted tokens
    noted, and the emitted tokens [S*(k+1)] (accepted proposals, then the draw after them, then -1) with their
    raw logprobs (the unfiltered temperature-1 distribution's, as every reported logprob)."""
    s, k = proposals.shape
    spg = presence.shape[0]
    local = jnp.where(slot < max_slots, slot % spg, spg)
    base = presence[jnp.minimum(local, spg - 1)]  # [S, V]
    # the state at place j counts p_1 .. p_j as generated
    j = jnp.arange(k + 1)
    upto = j[:, None] >= (jnp.arange(k)[None, :] + 1)  # [k+1, k]: proposal i (0-based) is before place j
    states = _with_generated(jnp.repeat(base, k + 1, axis=0), jnp.repeat(proposals, k + 1, axis=0),
                             jnp.tile(upto, (s, 1)))  # [S*(k+1), V]
    drawn, _ = sample(logits, states, params, position, any_sampled=any_sampled,
                      any_filtered=any_filtered, vocab_chunks=vocab_chunks, bias=bias, any_adjusted=any_adjusted)
    drawn = drawn.reshape(s, k + 1)
    accepted = accept_lengths(drawn[:, :k], proposals)  # [S]
    padded = jnp.concatenate([proposals, jnp.full((s, 1), -1, proposals.dtype)], axis=1)
    bonus = jnp.take_along_axis(drawn, accepted[:, None], axis=1)  # [S, 1]
    emitted = jnp.where(j[None, :] < accepted[:, None], padded, jnp.where(j[None, :] == accepted[:, None], bonus, -1))
    live = (slot < max_slots)[:, None]
    emitted = jnp.where(live, emitted, -1)
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(raw, jnp.maximum(emitted.reshape(-1), 0)[:, None], axis=-1)[:, 0]
    rows_state = _with_generated(base, emitted, emitted >= 0)
    presence = presence.at[local].set(rows_state, mode="drop")
    last_tokens = last_tokens.at[local].set(bonus[:, 0], mode="drop")
    return presence, last_tokens, emitted.reshape(-1).astype(jnp.int32), lp
