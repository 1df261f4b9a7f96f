"""`raydeploy predict` input: the file's lines one at a time, each parsed and tokenized into an `Example`, or a
`BadLine` saying why it cannot be used. Nothing here holds more than one line."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from raydeploy.config import Config
from raydeploy.engine.geometry import AdmissionLimits

INPUT_SHA256_HEX = 16
"""Hex digits of the SHA-256 of an input line kept in its output row (64 bits: enough to tell an edit)."""


class PredictInputError(ValueError):
    """An input or output file that cannot be used (unreadable, edited since the output was made, locked)."""


def line_sha256(raw: bytes) -> str:
    """The hash an output row carries of its input line: the line's bytes without its line ending."""
    return hashlib.sha256(raw).hexdigest()[:INPUT_SHA256_HEX]


@dataclass(frozen=True)
class InputLine:
    """One non-blank input line: its 1-based line number and its bytes without the line ending."""

    index: int
    raw: bytes

    @property
    def sha256(self) -> str:
        return line_sha256(self.raw)


@dataclass(frozen=True)
class Example:
    """One prompt to generate for; `index` is its 1-based line number in the input file."""

    index: int
    id: Any
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    input_sha256: str = ""


@dataclass(frozen=True)
class BadLine:
    """An input line that cannot be used, and why; it gets an error row."""

    index: int
    id: Any
    reason: str
    input_sha256: str = ""


def input_lines(f: IO[bytes]) -> Iterator[InputLine]:
    """The non-blank lines of a binary file, read one at a time (blank lines get no output row)."""
    for i, raw in enumerate(f, start=1):
        raw = raw.rstrip(b"\n").rstrip(b"\r")
        if raw.strip():
            yield InputLine(i, raw)


def _tokens(row: dict[str, Any], codec: Any) -> list[int]:
    has_prompt, has_messages = "prompt" in row, "messages" in row
    if has_prompt == has_messages:
        raise ValueError('needs exactly one of "prompt" (a string) or "messages" (a list of {role, content})')
    if has_prompt:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError('"prompt" must be a non-empty string')
        return list(codec.encode(row["prompt"]))
    msgs = row["messages"]
    if (not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs)):
        raise ValueError('"messages" must be a non-empty list of {"role": str, "content": str}')
    try:
        text = codec.chat_prompt(msgs)
    except Exception as e:  # noqa: BLE001 - a template may raise anything (Jinja's raise_exception on role order)
        raise ValueError(f"the model's chat template refused the messages: {e}") from None
    return list(codec.encode_chat(text))


def parse_line(line: InputLine, codec: Any, cfg: Config, default_max_tokens: int | None) -> Example | BadLine:
    """One input line -> an Example, or a BadLine with the reason it cannot be used."""
    sha = line.sha256
    row: Any = None
    try:
        try:
            row = json.loads(line.raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"not valid UTF-8 (byte {e.start + 1})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"expected a JSON object, found {type(row).__name__}")
        ids = _tokens(row, codec)
        admits = AdmissionLimits.from_config(cfg)
        if not ids:
            raise ValueError("the prompt has no tokens")
        max_tokens = row.get("max_tokens", default_max_tokens)
        if max_tokens is None:  # no cap anywhere: until the context ends (or a stop), as the HTTP API
            max_tokens = max(admits.max_seq_len - len(ids), 1)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f'"max_tokens" must be a positive integer, found {max_tokens!r}')
        if admits.max_new_tokens is not None and max_tokens > admits.max_new_tokens:
            raise ValueError(f'"max_tokens" {max_tokens} exceeds engine.max_new_tokens {admits.max_new_tokens}')
        limit = admits.max_seq_len - max_tokens
        if limit < 1:
            raise ValueError(f'"max_tokens" {max_tokens} leaves no room for a prompt in model.max_seq_len '
                             f'{admits.max_seq_len}')
        if len(ids) > limit:
            raise ValueError(f"prompt has {len(ids)} tokens; model.max_seq_len {admits.max_seq_len} with "
                             f"max_tokens {max_tokens} leaves room for {limit}")
    except ValueError as e:
        line_id = row.get("id", line.index) if isinstance(row, dict) else line.index
        return BadLine(line.index, line_id, str(e), sha)
    return Example(line.index, row.get("id", line.index), tuple(int(t) for t in ids), max_tokens, sha)
