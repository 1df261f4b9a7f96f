"""Text <-> token ids for the HTTP layer: the checkpoint's tokenizer, its chat template, incremental
detokenization for streaming, and stop strings.

The tokenizer is the one saved in the checkpoint directory (loaded with transformers' AutoTokenizer, never
from a model hub). The chat template is the tokenizer's own, or the deployment's `model.chat_template` in its
place (`use_chat_template`); a request may bring its own (vLLM's `chat_template`). A model without any template
has no chat format: rendering is an error (and `raydeploy plan`/`serve` refuse such a deployment up front,
`template_problem`), not a made-up "role: content" transcript the model was never trained on. Streaming decodes token by token without re-decoding the whole output, holds back
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


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Where transformers saves a checkpoint's chat template beside tokenizer_config.json."""


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

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (Jinja source: the deployment's `model.chat_template`) instead of the
        tokenizer's own, everywhere this codec's tokenizer renders (the chat format reads it from there too)."""
        self.tokenizer.chat_template = template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw prompt: tokenized as is, with the tokenizer's own special-token convention (BOS...) unless
        `add_special_tokens` is False."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                    *, chat_template: str | None = None, continue_final_message: bool = False) -> str:
        """The chat template applied to [{role, content}, ...] (as text, to report and to encode). `tools` go to
        the template as `tools=` (HF templates that render them); `template_kwargs` are extra template variables
        (a request's chat_template_kwargs, e.g. enable_thinking). `chat_template`: a template for this call
        instead of the codec's; `continue_final_message`: the last message left open (transformers' meaning:
        the text after its content, an end of turn, is cut). Without any template: ChatTemplateError."""
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & _TEMPLATE_ARGUMENTS)
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if chat_template is None and not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template (set model.chat_template in the deployment's "
                                    "config, or send 'chat_template')")
        from jinja2 import TemplateError

        if tools:
            extra["tools"] = tools
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if continue_final_message:
            extra["continue_final_message"] = True
        try:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **extra)
        except TemplateError as e:  # the template's own raise_exception(...), or an error in its logic
            raise ChatTemplateError(getattr(e, "message", None) or str(e) or type(e).__name__) from None
        except ValueError as e:  # transformers' own refusals (continue_final_message without a final message...)
            raise ChatTemplateError(str(e) or type(e).__name__) from None

    def rendering(self, chat_template: str | None, continue_final_message: bool) -> TextCodec:
        """A view of this codec (the same tokenizer) whose `chat_prompt` renders with a request's own
        `chat_template` and `continue_final_message`; this codec itself when neither is set."""
        if chat_template is None and not continue_final_message:
            return self
        return _RenderingCodec(self, chat_template, continue_final_message)

    def encode_chat(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of a rendered chat template (the template already holds its special tokens; a request may ask for
        the tokenizer's on top, vLLM's `add_special_tokens`)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs entries)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class _RenderingCodec(TextCodec):
    """A codec that renders chats with one request's template options (`TextCodec.rendering`)."""

    def __init__(self, base: TextCodec, chat_template: str | None, continue_final_message: bool) -> None:
        super().__init__(base.tokenizer, base.model_vocab_size)
        self.eos_token_ids = base.eos_token_ids
        self._template = chat_template
        self._continue = continue_final_message

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                    *, chat_template: str | None = None, continue_final_message: bool = False) -> str:
        return super().chat_prompt(messages, add_generation_prompt, tools, template_kwargs,
                                   chat_template=chat_template or self._template,
                                   continue_final_message=continue_final_message or self._continue)


def checkpoint_chat_template(checkpoint_dir: str | Path) -> str | None:
    """The chat template saved with a checkpoint's tokenizer (`tokenizer_config.json`'s `chat_template`, or a
    `chat_template.jinja`/`.json` beside it), without loading the tokenizer; None when it has none."""
    root = Path(checkpoint_dir)
    for name in CHAT_TEMPLATE_FILES:
        path = root / name
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            if name.endswith(".json"):
                text = json.loads(text).get("chat_template") or ""
            if text.strip():
                return text
    try:
        cfg = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t.get("template") for t in template if isinstance(t, dict)
                         and t.get("name") == "default"), None)
    return template if isinstance(template, str) and template.strip() else None


def configured_chat_template(value: str, config_source: str | None) -> str:
    """`model.chat_template` as Jinja source: a path to a file (relative to the config file's folder, `~`
    expanded) when it names one, else the value itself, inline. A value that looks like a path (one line, no
    Jinja markup) but names no file is a ValueError saying where it looked."""
    if "{" not in value and "\n" not in value:
        base = Path(config_source).parent if config_source and not config_source.startswith("<") else Path.cwd()
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise ValueError(f"names no file ({path} does not exist) and holds no Jinja markup; give a template "
                             f"file's path (relative to the config file) or the template itself")
        return path.read_text(encoding="utf-8")
    return value


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


def template_problem(chat_template: str | None, config_source: str | None, checkpoint_dir: str | Path) -> str | None:
    """Why a deployment cannot chat, or None: `model.chat_template` names a file that is not there, or neither
    it nor the checkpoint's tokenizer gives a chat template (the chat endpoint would have nothing to render
    with). Checked by `raydeploy plan` and `raydeploy serve` before anything starts."""
    if chat_template:
        try:
            configured_chat_template(chat_template, config_source)
        except ValueError as e:
            return f"model.chat_template {e}"
        return None
    if checkpoint_chat_template(checkpoint_dir) is not None:
        return None
    return ("the checkpoint's tokenizer has no chat template, so /v1/chat/completions could not render a "
            "conversation for this model; set model.chat_template to the model's Jinja chat template, as a file "
            "path relative to the config file (model: {chat_template: chat_template.jinja}) or inline")


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas; the deltas concatenate to `decode(all ids)`."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the window re-decoded for context
        self._read_offset = 0  # ids before this are already emitted as text
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self._codec.decode(self.ids[self._prefix_offset:self._read_offset], self._skip)
        window = self._codec.decode(self.ids[self._prefix_offset:], self._skip)
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            delta = window[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        full = self._codec.decode(self.ids, self._skip)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        self._prefix_offset = self._read_offset = len(self.ids)
        return delta


class StopMatcher:
    """Finds stop strings in streamed text; releases only text that can no longer become a stop string."""

    def __init__(self, stops: Sequence[str] | None, include_stop: bool = False) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.include_stop = include_stop
        """The stop string found is released with the text before it (`include_stop_str_in_output`)."""
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str, armed: bool = True) -> str:
        """Text safe to emit now. After a stop string is seen, `stopped` is True and nothing more comes.
        `armed` False (the request's min_tokens not yet generated): no stop string is looked for in this text,
        but the tail a stop string could start in is held back, so one that ends once armed is found (as vLLM
        searches the new text and the stop string's length before it)."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        self._pending += delta
        found = [(i, len(s)) for i, s in ((self._pending.find(s), s) for s in self.stops) if i >= 0] if armed else []
        if found:
            cut, length = min(found, key=lambda f: (f[0], -f[1]))  # the first to start; the longest there
            end = cut + length if self.include_stop else cut
            out, self._pending, self.stopped = self._pending[:end], "", True
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
