"""The one streaming machine: generated text in, OpenAI deltas out (content, reasoning, tool calls).

Two stages. `ReasoningSplitter` sends the text between `<think>` and `</think>` to reasoning. `ToolStreamer`
passes content through as soon as it can no longer be the start of a call, holds a call block until it is
complete, and then emits the call (id and name first, then its arguments). A call is emitted only once its block
has parsed, so a client never receives a call that later proves malformed: a malformed block is sent as content,
whole. `parse` of a finished message is this machine run over the message, so streamed and whole answers agree.
"""

from __future__ import annotations

from raydeploy.serve.chat.syntax import ParsedCall, ToolSyntax, log
from raydeploy.serve.chat.types import ChatOutput, Delta, ToolCall, ToolCallDelta, new_call_id

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def held_prefix(text: str, marks: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of one of `marks` (it may become that mark)."""
    best = 0
    for m in marks:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def opens_thinking(prompt: str | None) -> bool:
    """The rendered prompt leaves a `<think>` block open (templates of thinking models that start it themselves):
    the output then begins inside the reasoning."""
    if not prompt:
        return False
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """Splits `<think>...</think>` from the rest. `<think>` counts only as the message's first non-blank text; a
    `</think>` with no `<think>` before it ends reasoning that the prompt opened."""

    def __init__(self, inside: bool = False) -> None:
        self.inside = inside
        self._started = inside  # past the point where `<think>` may open
        self._closed = False  # just past `</think>`: the blank lines templates put after it are not content
        self._pending = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """[("reasoning" | "content", text), ...] safe to send now."""
        self._pending += text
        out: list[tuple[str, str]] = []
        while self._pending:
            if not self._started:
                head = self._pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self._pending = head[len(THINK_OPEN):]
                    self.inside = self._started = True
                    continue
                if not final and (not head or THINK_OPEN.startswith(head)):
                    break  # blanks, or the beginning of `<think>`: wait
                self._started = True
            if self.inside:
                i = self._pending.find(THINK_CLOSE)
                if i >= 0:
                    out.append(("reasoning", self._pending[:i]))
                    self._pending = self._pending[i + len(THINK_CLOSE):]
                    self.inside, self._closed = False, True
                    continue
                hold = 0 if final else held_prefix(self._pending, (THINK_CLOSE,))
                out.append(("reasoning", self._pending[:len(self._pending) - hold]))
                self._pending = self._pending[len(self._pending) - hold:]
                break
            if self._closed:
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    break
                self._closed = False
            out.append(("content", self._pending))
            self._pending = ""
        if final and self._pending:
            out.append(("reasoning" if self.inside else "content", self._pending))
            self._pending = ""
        return [(k, t) for k, t in out if t]


class ToolStreamer:
    """Content in, content and whole calls out, for one format (see the module docstring)."""

    def __init__(self, syntax: ToolSyntax) -> None:
        self.syntax = syntax
        self._pending = ""
        self._in_block = False
        self._at_start = True  # nothing but blanks sent as content yet: a bare start may still open a block

    def feed(self, text: str, final: bool = False) -> list[str | list[ParsedCall]]:
        """Content strings and lists of calls, in order."""
        self._pending += text
        out: list[str | list[ParsedCall]] = []
        while self._pending:
            if self._in_block:
                n = self.syntax.end(self._pending, final)
                if n is None:
                    break
                block, self._pending = self._pending[:n], self._pending[n:]
                self._in_block = False
                calls = self.syntax.parse(block)
                if calls:
                    out.append(calls)
                else:
                    log.debug("malformed %s tool call left as content: %r", self.syntax.name, block[:200])
                    self._content(out, block)
                continue
            i = self._block_start()
            if i is not None:
                self._content(out, self._pending[:i])
                self._pending = self._pending[i:]
                self._in_block = True
                continue
            if final:
                hold = 0
            elif self._at_start and not self._pending.strip():
                hold = len(self._pending)  # leading blanks: a call may still follow
            else:
                hold = held_prefix(self._pending, self.syntax.markers)
                if self._at_start:
                    body = self._pending.lstrip()
                    if any(b.startswith(body) for b in self.syntax.bare_starts):
                        hold = len(self._pending)
            self._content(out, self._pending[:len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
            break
        return out

    def _block_start(self) -> int | None:
        found = [i for i in (self._pending.find(m) for m in self.syntax.markers) if i >= 0]
        if self._at_start:
            body = self._pending.lstrip()
            if any(body.startswith(b) for b in self.syntax.bare_starts):
                found.append(len(self._pending) - len(body))
        return min(found, default=None)

    def _content(self, out: list[str | list[ParsedCall]], text: str) -> None:
        if text:
            out.append(text)
            if text.strip():
                self._at_start = False


class ChatStreamer:
    """One choice's stream: `feed` each detokenized delta, `finish` at the end; `called` once a call went out."""

    def __init__(self, syntax: ToolSyntax | None, reasoning: bool, inside_reasoning: bool = False) -> None:
        self._tools = ToolStreamer(syntax) if syntax is not None else None
        self._reasoning = ReasoningSplitter(inside_reasoning) if reasoning else None
        self._calls = 0

    @property
    def called(self) -> bool:
        """Some tool call was emitted (the choice finishes with `tool_calls`)."""
        return self._calls > 0

    def feed(self, delta: str) -> list[Delta]:
        return self._step(delta, final=False)

    def finish(self) -> list[Delta]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> list[Delta]:
        pieces = self._reasoning.feed(text, final) if self._reasoning else [("content", text)]
        out: list[Delta] = []
        content: list[str] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append(Delta(reasoning_content=piece))
            else:
                content.append(piece)
        if self._tools is None:
            out += [Delta(content=c) for c in content if c]
            return out
        items = self._tools.feed("".join(content), final)
        if final:
            items += self._tools.feed("", True)
        for item in items:
            if isinstance(item, str):
                out.append(Delta(content=item))
                continue
            for call in item:
                index, self._calls = self._calls, self._calls + 1
                out.append(Delta(tool_call=ToolCallDelta(index, new_call_id(), call.name, "")))
                out.append(Delta(tool_call=ToolCallDelta(index, None, None, call.arguments)))
        return out


def collect(deltas: list[Delta]) -> ChatOutput:
    """A whole message from its deltas (what `parse` returns)."""
    content = "".join(d.content for d in deltas if d.content is not None)
    reasoning = "".join(d.reasoning_content for d in deltas if d.reasoning_content is not None)
    calls: list[ToolCall] = []
    for d in deltas:
        tc = d.tool_call
        if tc is None:
            continue
        if tc.id is not None:
            calls.append(ToolCall(tc.id, tc.name or "", ""))
        else:
            last = calls[-1]
            calls[-1] = ToolCall(last.id, last.name, last.arguments + tc.arguments)
    if calls and not content.strip():
        text: str | None = None
    else:
        text = content.strip() if calls else content
    return ChatOutput(text, reasoning.strip() or None, tuple(calls))
