"""Prompt lookup (the `ngram` method): the continuation of the latest earlier occurrence of the sequence's last
n tokens in its own prompt and output. No model, no JAX: rank 0 runs it while it plans.

Longer suffixes are tried first (`ngram_max` down to `ngram_min`): a longer match predicts better. The latest
occurrence followed by k tokens wins (in an edit of a text the part being rewritten now is the nearest one), else
the earliest (the longest continuation: in a run of one repeated token the latest occurrences overlap the suffix
and have one token after them). A match needs at least one token after it (the occurrence ending at the
sequence's end is the suffix itself)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int] | np.ndarray, k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `k` proposed next tokens for a sequence of `tokens` (prompt then output), or [] when no suffix of
    `ngram_min`..`ngram_max` tokens occurred earlier with a continuation."""
    if k < 1:
        return []
    seq = np.asarray(tokens, np.int64).reshape(-1)
    size = seq.size
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        if n < 1:
            break
        suffix = seq[size - n:]
        # candidate starts i with seq[i:i+n] == suffix and i + n < size (a continuation exists)
        windows = np.lib.stride_tricks.sliding_window_view(seq[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= size]  # occurrences followed by k tokens
            start = int(full[-1] if full.size else hits[0]) + n
            return [int(t) for t in seq[start:start + k]]
    return []
