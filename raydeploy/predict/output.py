"""`raydeploy predict` output: the rows, the checks that let a run resume into an existing output, durable
appends, and the lock that keeps a second run out.

Every row has the same keys (ROW_KEYS); `error` is null on a result and `{"message", "type"}` on an error row.
Rows are appended in input order, flushed at once and fsynced every FSYNC_EVERY_ROWS rows or FSYNC_EVERY_S
seconds and at the end, so after a crash (even of the machine) the file is a prefix of the rows, possibly with
a torn last line, which resuming cuts off.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raydeploy.predict.input import BadLine, Example, InputLine, PredictInputError

ROW_KEYS = ("index", "id", "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens",
            "input_sha256", "error")
"""The keys of every output row, in order."""

FSYNC_EVERY_ROWS = 256
"""Rows appended between two fsyncs of the output (at most)."""

FSYNC_EVERY_S = 5.0
"""Seconds between two fsyncs of the output while rows are being appended (at most)."""

_TAIL_CHUNK = 1 << 16


def result_row(ex: Example, token_ids: list[int], finish_reason: str | None, codec: Any) -> dict[str, Any]:
    return {"index": ex.index, "id": ex.id, "text": codec.decode(token_ids), "token_ids": token_ids,
            "finish_reason": finish_reason, "prompt_tokens": len(ex.prompt_token_ids),
            "completion_tokens": len(token_ids), "input_sha256": ex.input_sha256, "error": None}


def error_row(item: Example | BadLine, message: str, error_type: str) -> dict[str, Any]:
    """The row of a line that has no result: a malformed line (`invalid_input`) or a failed generation."""
    prompt_tokens = len(item.prompt_token_ids) if isinstance(item, Example) else None
    return {"index": item.index, "id": item.id, "text": None, "token_ids": [], "finish_reason": "error",
            "prompt_tokens": prompt_tokens, "completion_tokens": 0, "input_sha256": item.input_sha256,
            "error": {"message": message, "type": error_type}}


class OutputLock:
    """`<output>.lock`, flock-ed for the whole run with the holder's pid inside: a second run on the same output
    is refused, naming the lock and the pid. The file stays after the run (removing it could let two runs each
    lock a different file); the lock is the flock, released when the holder exits, however it exits."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output.with_name(output.name + ".lock")
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            pid = os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise PredictInputError(
                f"{self.path} is held by another raydeploy predict (pid {pid}) writing {self.output}; two runs "
                f"must not write one output: wait for that one to end, or stop it") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def cut_torn_tail(path: Path) -> int:
    """Truncate `path` after its last newline (a row torn by a crash); returns the bytes cut. Reads only the
    tail."""
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end, keep = size, 0
        while end > 0:
            start = max(0, end - _TAIL_CHUNK)
            f.seek(start)
            k = f.read(end - start).rfind(b"\n")
            if k >= 0:
                keep = start + k + 1
                break
            end = start
        if keep != size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return size - keep


def resume_rows(output: Path, input_path: Path, lines: Iterator[InputLine]) -> int:
    """Check the rows already in `output` against the input, one input line per row in order, and return how
    many there are; `lines` is left at the first input line without a row. A torn last row is cut off first.
    Raises PredictInputError on an output that is not this input's: a row of another format, a row whose
    input line number or hash differs from the input line at its position (naming that line), or more rows
    than input lines."""
    if not output.exists():
        return 0
    cut_torn_tail(output)
    n = 0
    with output.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                row = json.loads(raw)
                index, sha = int(row["index"]), row["input_sha256"]
                if not isinstance(sha, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise PredictInputError(
                    f"{output}:{n}: not a raydeploy predict output row (with index and input_sha256); refusing "
                    f"to resume into it (choose another --output)") from None
            line = next(lines, None)
            if line is None:
                raise PredictInputError(
                    f"{output} has more rows than {input_path} has non-blank lines ({n - 1}): it was not made "
                    f"from this input; refusing to resume into it (restore the input or choose another --output)")
            if line.index != index or line.sha256 != sha:
                raise PredictInputError(
                    f"{input_path}:{line.index}: the input changed since {output} was written: its row {n} was "
                    f"made from input line {index} with input_sha256 {sha}, this line's is {line.sha256}; "
                    f"refusing to resume (restore the input, or write to another --output)")
    return n


class OutputWriter:
    """Appends rows to the output: each flushed at once, fsynced every `every_rows` rows or `every_s` seconds,
    and at close."""

    def __init__(self, path: Path, every_rows: int = FSYNC_EVERY_ROWS, every_s: float = FSYNC_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        created = not path.exists()
        self.path = path
        self._f = path.open("ab")
        if created:  # the new file's directory entry, durable too
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self.every_rows, self.every_s, self.clock = every_rows, every_s, clock
        self.unsynced = 0
        self.synced_at = clock()
        self.fsyncs = 0

    def write(self, row: dict[str, Any]) -> None:
        self._f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        self._f.flush()
        self.unsynced += 1
        if self.unsynced >= self.every_rows or self.clock() - self.synced_at >= self.every_s:
            self.sync()

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self.unsynced, self.synced_at = 0, self.clock()
        self.fsyncs += 1

    def close(self) -> None:
        if not self._f.closed:
            try:
                self.sync()
            finally:
                self._f.close()

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
