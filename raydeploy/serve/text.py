"""Text <-> token ids for the HTTP layer: the checkpoint's tokenizer, its chat template, incremental
detokenization for streaming, and stop strings.

The tokenizer is the one saved in the checkpoint directory (loaded with transformers' AutoTokenizer, never
from a model hub). Streaming decodes token by token without re-decoding the whole output, holds back
bytes that do not yet form a whole character, and holds back text that could still become a stop string.

`vocab_size` is what a client's token ids are checked against: the model's own vocabulary (the rows of its
embedding, from the checkpoint's config.json) where known, since an id past it reads past the embedding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("raydeploy.serve")


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages (Gemma's and Mistral's raise on an unexpected role order);
    the message is the template's own."""


_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "padding", "truncation",
                                 "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                 "tokenizer_kwargs"})
"""apply_chat_template's own parameters: a request's template variables may not set them."""


class TextCodec:
    """Encode prompts (raw or chat) and decode generated ids with the model's own tokenizer."""

    def __init__(self, tokenizer: Any, model_vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)
        self.model_vocab_size = model_vocab_size
        """Rows of the model's embedding (config.json's vocab_size), if known."""

    @classmethod
    def from_dir(cls, path: str | Path) -> TextCodec:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True), model_vocab_size(path))

    @property
    def vocab_size(self) -> int:
        """Token ids a request may hold are below this: the model's vocabulary where known, else the tokenizer's."""
        return self.model_vocab_size if self.model_vocab_size is not None else len(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """A raw prompt: tokenized as is, with the tokenizer's own special-token convention."""
        return list(self.tokenizer.encode(text))

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied to [{role, content}, ...] (as text, to report and to encode). `tools` go to
        the template as `tools=` (HF templates that render them); `template_kwargs` are extra template variables
        (a request's chat_template_kwargs, e.g. enable_thinking)."""
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & _TEMPLATE_ARGUMENTS)
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if not self.has_chat_template:
            # A model without a template: plain "role: content" lines, then the assistant's turn.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        from jinja2 import TemplateError

        if tools:
            extra["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
        except TemplateError as e:  # the template's own raise_exception(...), or an error in its logic
            raise ChatTemplateError(getattr(e, "message", None) or str(e) or type(e).__name__) from None

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


def model_vocab_size(checkpoint_dir: str | Path) -> int | None:
    """`vocab_size` of the checkpoint's config.json (top level, or a multimodal model's text_config), if any."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("could not read the model's vocabulary size from %s: %s", path.name, type(e).__name__)
        return None
    for d in (cfg, cfg.get("text_config") or {}):
        v = d.get("vocab_size") if isinstance(d, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


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
