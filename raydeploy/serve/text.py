"""Text <-> token ids for the HTTP layer: the checkpoint's tokenizer, its chat template, incremental
detokenization for streaming, and stop strings.

The tokenizer is the one saved in the checkpoint directory (loaded with transformers' AutoTokenizer, never
from a model hub). Streaming decodes token by token without re-decoding the whole output, holds back
bytes that do not yet form a whole character, and holds back text that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TextCodec:
    """Encode prompts (raw or chat) and decode generated ids with the model's own tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)

    @classmethod
    def from_dir(cls, path: str | Path) -> TextCodec:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """A raw prompt: tokenized as is, with the tokenizer's own special-token convention."""
        return list(self.tokenizer.encode(text))

    def chat_prompt(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to [{role, content}, ...] (as text, to report and to encode)."""
        if not self.has_chat_template:
            # A model without a template: plain "role: content" lines, then the assistant's turn.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat template (the template already holds its special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs entries)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas; the deltas concatenate to `decode(all ids)`."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the window re-decoded for context
        self._read_offset = 0  # ids before this are already emitted as text
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self._codec.decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._codec.decode(self.ids[self._prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            delta = window[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        full = self._codec.decode(self.ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self._prefix_offset = self._read_offset = len(self.ids)
        return delta


class StopMatcher:
    """Finds stop strings in streamed text; releases only text that can no longer become a stop string."""

    def __init__(self, stops: Sequence[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Text safe to emit now. After a stop string is seen, `stopped` is True and nothing more comes."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        self._pending += delta
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._pending, self.stopped = self._pending[:cut], "", True
            return out
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return ""
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out

    def finish(self) -> str:
        """The held-back tail, at the end of generation."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
