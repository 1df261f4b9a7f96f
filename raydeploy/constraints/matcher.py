"""Rank 0's grammar engine: constraints compiled against the model's tokenizer, and per-request matchers that
give the packed allowed-token bits of each draw and follow the tokens drawn.

`GrammarEngine` is built once per deployment from the checkpoint's tokenizer (or a Hugging Face tokenizer) and
the model's vocabulary size; `GrammarEngine.matcher(c)` compiles `c` (compiled grammars are kept by
`Constraint.key`, least recently used dropped first) and hands out a fresh `Matcher` for one request. The
scheduler fills `SeqStep.allowed` from `Matcher.fill` (one row) or `GrammarEngine.fill` (several rows at once, on
llguidance's thread pool) and advances the matcher with `Matcher.accept` only when a token is emitted, so a step
that fails and is planned again finds its matcher where it was.

The masks are over the MODEL's vocabulary (its logits' width), which may differ from the tokenizer's: padded
embedding rows past the tokenizer's last id are never allowed. The model's eos ids are the grammar's end
tokens: llguidance allows them exactly where the grammar may end. No JAX here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from raydeploy.constraints.grammar import ConstraintError, _brief, check, to_grammar
from raydeploy.constraints.spec import Constraint

COMPILED_CACHE_SIZE = 256
"""Compiled grammars kept (by `Constraint.key`); agent frameworks send the same few schemas again and again."""


def words_for(vocab_size: int) -> int:
    """uint32 words of a packed mask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def _first_line(message: str) -> str:
    """llguidance's error without the dump of the parser state and the whole grammar that follows it."""
    message = message.split("<state>")[0].split("<grammar>")[0].strip()
    return _brief(message) if message else "unknown grammar error"


def _clear_from(words: np.ndarray, first: int) -> None:
    """Clear the bits of tokens `first` and above (of one mask [words], or of each row of masks [rows, words])."""
    w, bit = divmod(first, 32)
    if w < words.shape[-1]:
        words[..., w] &= np.uint32((1 << bit) - 1)
        words[..., w + 1:] = 0


class Matcher:
    """One request's position in its grammar. Not thread-safe: the scheduler's step loop alone uses it."""

    def __init__(self, ll: LLMatcher, vocab_size: int, tokenizer_vocab: int, llg_vocab: int) -> None:
        self._ll = ll
        self.vocab_size = vocab_size
        """The model's vocabulary: `fill` writes words_for(vocab_size) words."""
        self._tokenizer_vocab = tokenizer_vocab
        self._llg_words = words_for(llg_vocab)
        self._scratch = None if self._llg_words == words_for(vocab_size) else np.zeros(self._llg_words, np.uint32)
        self.tokens = 0
        """Tokens accepted so far."""
        self._refused: str | None = None  # a token id no grammar can take (llguidance is never given it)

    @property
    def done(self) -> bool:
        """The grammar has ended: no further token but the end (eos) can follow."""
        return self._refused is None and self._ll.is_stopped() and not self._ll.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token the grammar does not allow, a parser limit), or None."""
        if self._refused is not None:
            return self._refused
        return _first_line(self._ll.get_error()) if self._ll.is_error() else None

    def fill(self, words: np.ndarray) -> None:
        """Write the allowed next tokens into `words` (uint32 [words_for(vocab_size)], token i allowed iff bit
        i % 32 of word i // 32 is set). A failed matcher allows nothing."""
        n = words_for(self.vocab_size)
        if words.dtype != np.uint32 or words.shape != (n,) or not words.flags.c_contiguous:
            raise ValueError(f"mask buffer must be contiguous uint32 [{n}], found {words.dtype} {words.shape}")
        if self._refused is not None or self._ll.is_error():
            words[:] = 0
            return
        if self._scratch is None:
            self._ll.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        else:
            self._ll.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            m = min(n, self._llg_words)
            words[:m] = self._scratch[:m]
            words[m:] = 0
        _clear_from(words, min(self._tokenizer_vocab, self.vocab_size))

    def mask(self) -> np.ndarray:
        """A new mask array filled by `fill`."""
        words = np.empty(words_for(self.vocab_size), np.uint32)
        self.fill(words)
        return words

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and `error` says why) when the grammar does not allow it."""
        if self.error is not None:
            return False
        known = min(self._tokenizer_vocab, self.vocab_size)
        if not 0 <= token < known:
            self._refused = f"token {token} is outside the grammar's vocabulary (ids 0..{known - 1})"
            return False
        ok = bool(self._ll.consume_token(int(token)))
        if ok:
            self.tokens += 1
        return ok

    def __repr__(self) -> str:
        return f"Matcher(tokens={self.tokens}, done={self.done}, error={self.error!r})"


class GrammarEngine:
    """Compiles constraints against one tokenizer, for a model with `vocab_size` logits."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int],
                 cache_size: int = COMPILED_CACHE_SIZE) -> None:
        eos = [int(e) for e in eos_ids] or None
        self.tokenizer_json = tokenizer_json
        """The tokenizer (Hugging Face tokenizers' JSON) the grammars are compiled against."""
        self.tokenizer_vocab = LLTokenizer(tokenizer_json, eos_token=eos, slices=[]).vocab_size
        """Ids the tokenizer knows (its added tokens included)."""
        self.vocab_size = int(vocab_size)
        """The model's logits width (the masks' length in tokens)."""
        # over a larger model vocabulary llguidance's masks take its width at once (the extra ids never allowed)
        n_vocab = max(self.vocab_size, self.tokenizer_vocab)
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
        self.eos_ids = tuple(self.tokenizer.eos_tokens)
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: LLExecutor | None = None  # llguidance's thread pool for `fill`, built on first use
        self.compiles = 0
        """Grammars compiled (cache misses)."""

    @classmethod
    def from_checkpoint(cls, path: str | Path, vocab_size: int, eos_ids: Sequence[int]) -> GrammarEngine:
        """From the tokenizer.json of a checkpoint directory (the one the HTTP layer's tokenizer reads); a
        directory without one goes through transformers' AutoTokenizer, which converts a slow tokenizer."""
        f = Path(path) / "tokenizer.json"
        if not f.exists():
            from transformers import AutoTokenizer

            return cls.from_hf(AutoTokenizer.from_pretrained(str(path), local_files_only=True), vocab_size, eos_ids)
        return cls(f.read_text(), vocab_size, eos_ids)

    @classmethod
    def from_hf(cls, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int] | None = None) -> GrammarEngine:
        """From a fast Hugging Face tokenizer (its Rust tokenizer's JSON, added tokens included); eos ids default
        to the tokenizer's."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"structured outputs need a fast tokenizer, found {type(tokenizer).__name__}")
        if eos_ids is None:
            eos_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        return cls(backend.to_str(), vocab_size, eos_ids)

    def matcher(self, c: Constraint) -> Matcher:
        """A fresh matcher for `c` at the start of its grammar; ConstraintError naming the problem when `c` does
        not compile. Compiling takes the GIL off for its duration (llguidance), so callers compile outside
        their locks."""
        with self._lock:
            compiled = self._compiled.get(c.key)
            if compiled is not None:
                self._compiled.move_to_end(c.key)
        if compiled is None:
            check(c)  # the ingress's message for a constraint it would refuse (cached by key)
            compiled = LLMatcher(self.tokenizer, to_grammar(c), log_level=0)
            if compiled.is_error():
                raise ConstraintError(f"{c.kind} constraint does not compile: {_first_line(compiled.get_error())}")
            with self._lock:
                self.compiles += 1
                self._compiled[c.key] = compiled
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        return Matcher(compiled.deep_copy(), self.vocab_size, self.tokenizer_vocab, self.tokenizer.vocab_size)

    def fill(self, matchers: Sequence[Matcher], words: np.ndarray) -> None:
        """Write each matcher's allowed next tokens into its row of `words` (uint32 [len(matchers),
        words_for(vocab_size)]), all rows in one call on llguidance's thread pool: the same bits as
        `Matcher.fill` row by row (a failed matcher allows nothing; ids past the tokenizer's are never allowed),
        in about the time of the slowest row where cores allow. The matchers must be this engine's, and no other
        thread may use them meanwhile."""
        rows, n = len(matchers), words_for(self.vocab_size)
        if words.dtype != np.uint32 or words.shape != (rows, n) or not words.flags.c_contiguous:
            raise ValueError(f"mask buffer must be contiguous uint32 [{rows}, {n}] (one row per matcher), found "
                             f"{words.dtype} {words.shape}")
        llg_words = words_for(self.tokenizer.vocab_size)
        for m in matchers:
            if (m.vocab_size, m._tokenizer_vocab, m._llg_words) != (self.vocab_size, self.tokenizer_vocab, llg_words):
                raise ValueError(f"{m!r} was not made by this grammar engine (vocabulary {m.vocab_size} over a "
                                 f"tokenizer of {m._tokenizer_vocab}, this engine's: {self.vocab_size} over "
                                 f"{self.tokenizer_vocab})")
        live = [(m._ll, i) for i, m in enumerate(matchers) if m._refused is None and not m._ll.is_error()]
        # llguidance writes masks of its own width: wider than the model's when the tokenizer knows more ids
        target = words if llg_words == n else np.empty((rows, llg_words), np.uint32)
        target[:] = 0  # rows of failed matchers allow nothing
        if live:
            with self._lock:
                if self._executor is None:
                    self._executor = LLExecutor()
                executor = self._executor
            executor.unsafe_compute_mask_ptr(live, target.ctypes.data, llg_words * 4, rows)
        if target is not words:
            kept = min(n, llg_words)
            words[:, :kept] = target[:, :kept]
            words[:, kept:] = 0
        _clear_from(words, min(self.tokenizer_vocab, self.vocab_size))
