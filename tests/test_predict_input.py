"""`raydeploy predict` without Ray: input lines parsed one at a time (a bad line names its reason and becomes an
error row), the output's resume checks (torn last row cut, edited input refused naming the line), the lock
against a second writer, fsync cadence, and the whole driver (`run_predict`) over a stand-in coordinator: error
rows, --on-error fail, resume, and a window that bounds how far reading runs ahead of writing."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import pytest

from raydeploy.cli import main
from raydeploy.config import load_config
from raydeploy.predict import generate_all, run_predict
from raydeploy.predict.input import (
    BadLine,
    Example,
    InputLine,
    PredictInputError,
    input_lines,
    line_sha256,
    parse_line,
)
from raydeploy.predict.output import ROW_KEYS, OutputLock, OutputWriter, cut_torn_tail, resume_rows

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "predict-small.yaml"
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def codec(demo_checkpoint: Path):
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(demo_checkpoint)


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG)


BAD = [
    ('{"prompt": "Hello"', "not valid JSON"),
    ('["Hello"]', "expected a JSON object, found list"),
    ('{"text": "Hello"}', 'needs exactly one of "prompt"'),
    ('{"prompt": "a", "messages": []}', 'needs exactly one of "prompt"'),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
    ('{"prompt": "Hi", "max_tokens": 0}', '"max_tokens" must be a positive integer, found 0'),
    ('{"prompt": "Hi", "max_tokens": 65}', '"max_tokens" 65 exceeds engine.max_new_tokens 64'),
    (json.dumps({"prompt": "word " * 400}), "tokens; model.max_seq_len 256 with max_tokens 64 leaves room for 192"),
]


def _write(tmp_path: Path, lines: list[str], name: str = "in.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def _parse_all(p: Path, codec, cfg, max_tokens: int = 64) -> list[Example | BadLine]:
    with p.open("rb") as f:
        return [parse_line(line, codec, cfg, max_tokens) for line in input_lines(f)]


def test_good_lines(tmp_path: Path, codec, cfg) -> None:
    p = _write(tmp_path, ['{"prompt": "The capital of France is", "id": "a"}', "",
                          '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}'])
    examples = _parse_all(p, codec, cfg, 16)
    assert all(isinstance(e, Example) for e in examples)
    assert [(e.index, e.id, e.max_tokens) for e in examples] == [(1, "a", 16), (3, 3, 5)]
    assert list(examples[0].prompt_token_ids) == codec.encode("The capital of France is")
    assert codec.decode(examples[1].prompt_token_ids).rstrip().endswith("assistant")
    assert examples[0].input_sha256 == line_sha256(b'{"prompt": "The capital of France is", "id": "a"}')


@pytest.mark.parametrize(("line", "reason"), BAD, ids=[r for _, r in BAD])
def test_bad_line_names_its_reason(tmp_path: Path, codec, cfg, line: str, reason: str) -> None:
    p = _write(tmp_path, ['{"prompt": "ok"}', line, '{"prompt": "also ok"}'])
    items = _parse_all(p, codec, cfg)
    assert [type(i).__name__ for i in items] == ["Example", "BadLine", "Example"]
    bad = items[1]
    assert isinstance(bad, BadLine) and bad.index == 2 and reason in bad.reason
    assert bad.input_sha256 == line_sha256(line.encode())


def test_bad_line_keeps_its_id_and_a_bad_template_is_a_bad_line(tmp_path: Path, cfg) -> None:
    class Codec:
        def chat_prompt(self, msgs):
            raise RuntimeError("Conversation roles must alternate user/assistant")

    line = InputLine(7, b'{"id": "q7", "messages": [{"role": "user", "content": "a"}]}')
    bad = parse_line(line, Codec(), cfg, 8)
    assert isinstance(bad, BadLine) and bad.id == "q7"
    assert bad.reason == "the model's chat template refused the messages: Conversation roles must alternate " \
                         "user/assistant"
    assert isinstance(parse_line(InputLine(1, b"\xff{}"), Codec(), cfg, 8), BadLine)


# -- output: resume, lock, fsync -------------------------------------------------------------------------------


def _rows_for(inp: Path, n: int) -> str:
    """Rows as a run writes them for the first `n` non-blank lines of `inp`."""
    with inp.open("rb") as f:
        lines = list(input_lines(f))[:n]
    return "".join(json.dumps({"index": ln.index, "id": ln.index, "text": "x", "token_ids": [1],
                               "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 1,
                               "input_sha256": ln.sha256, "error": None}) + "\n" for ln in lines)


def test_resume_cuts_torn_last_row_and_checks_hashes(tmp_path: Path) -> None:
    inp = _write(tmp_path, ['{"prompt": "a"}', "", '{"prompt": "b"}', '{"prompt": "c"}'])
    out = tmp_path / "out.jsonl"
    good = _rows_for(inp, 2)
    out.write_text(good + '{"index": 4, "te')
    with inp.open("rb") as f:
        lines = input_lines(f)
        assert resume_rows(out, inp, lines) == 2
        assert next(lines).index == 4  # the input is left at the first line without a row
    assert out.read_text() == good
    with inp.open("rb") as f:
        assert resume_rows(tmp_path / "absent.jsonl", inp, input_lines(f)) == 0


def test_cut_torn_tail_reads_only_the_tail(tmp_path: Path) -> None:
    p = tmp_path / "o.jsonl"
    p.write_bytes(b"a\n" + b"x" * 200_000)  # a tail longer than one read chunk
    assert cut_torn_tail(p) == 200_000 and p.read_bytes() == b"a\n"
    p.write_bytes(b"y" * 10)
    assert cut_torn_tail(p) == 10 and p.read_bytes() == b""


def test_resume_refuses_an_edited_input_naming_the_line(tmp_path: Path, codec, cfg,
                                                       capsys: pytest.CaptureFixture) -> None:
    inp = _write(tmp_path, [json.dumps({"prompt": f"line {i}"}) for i in range(1, 6)])
    out = tmp_path / "out.jsonl"
    out.write_text(_rows_for(inp, 4))
    edited = inp.read_text().splitlines()
    edited[2] = json.dumps({"prompt": "line 3, edited"})
    inp.write_text("\n".join(edited) + "\n")
    with inp.open("rb") as f, pytest.raises(PredictInputError, match=r"in.jsonl:3: the input changed since .*out"
                                                                      r"\.jsonl was written: its row 3 was made"):
        resume_rows(out, inp, input_lines(f))
    # through the command: refused before anything starts, the output untouched
    before = out.read_bytes()
    assert main(["predict", str(CONFIG), "--input", str(inp), "--output", str(out)]) == 1
    assert "in.jsonl:3: the input changed since" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_resume_refuses_foreign_and_longer_output(tmp_path: Path) -> None:
    inp = _write(tmp_path, ['{"prompt": "a"}', '{"prompt": "b"}'])
    out = tmp_path / "out.jsonl"
    out.write_text(_rows_for(inp, 1) + '{"index": 2, "text": "old format, no hash"}\n')
    with inp.open("rb") as f, pytest.raises(PredictInputError, match="out.jsonl:2: not a raydeploy predict output"):
        resume_rows(out, inp, input_lines(f))
    out.write_text(_rows_for(inp, 2) * 2)
    with inp.open("rb") as f, pytest.raises(PredictInputError, match="more rows than .*in.jsonl has non-blank "
                                                                     r"lines \(2\)"):
        resume_rows(out, inp, input_lines(f))


def test_second_writer_is_refused_naming_lock_and_pid(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    inp = _write(tmp_path, ['{"prompt": "a"}'])
    out = tmp_path / "out.jsonl"
    with OutputLock(out) as lock:
        assert lock.path == tmp_path / "out.jsonl.lock"
        assert lock.path.read_text().strip() == str(os.getpid())
        with pytest.raises(PredictInputError, match=rf"out.jsonl.lock is held by another raydeploy predict "
                                                    rf"\(pid {os.getpid()}\) writing .*out.jsonl"):
            OutputLock(out).__enter__()
        assert main(["predict", str(CONFIG), "--input", str(inp), "--output", str(out)]) == 1
        assert f"out.jsonl.lock is held by another raydeploy predict (pid {os.getpid()})" in capsys.readouterr().err
        assert not out.exists()
    with OutputLock(out):  # released: the next run takes it
        pass


def test_writer_fsyncs_every_n_rows_every_t_seconds_and_at_close(tmp_path: Path) -> None:
    now = [0.0]
    w = OutputWriter(tmp_path / "o.jsonl", every_rows=3, every_s=10.0, clock=lambda: now[0])
    for _ in range(7):
        w.write({"a": 1})
    assert w.fsyncs == 2 and w.unsynced == 1
    now[0] = 10.0
    w.write({"a": 2})
    assert w.fsyncs == 3 and w.unsynced == 0
    w.write({"a": 3})
    w.close()
    assert w.fsyncs == 4 and (tmp_path / "o.jsonl").read_text().count("\n") == 9


# -- the driver over a stand-in coordinator -------------------------------------------------------------------


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class _FakeCoordinator:
    """Rank 0's feed calls (submit / feed / abort / close_feed) as a fast stand-in: each request's tokens are the
    prompt's last id + 1, + 2, ..., one list each. Lines in `fail_first` fail retriably on their first attempt;
    lines in `poison` fail (not retriably) on every attempt."""

    def __init__(self, fail_first: set[int], poison: set[int]) -> None:
        import types

        self.fail_first, self.poison = fail_first, poison
        self._actor_id = types.SimpleNamespace(hex=lambda: "fake-coordinator")
        self.feeds: dict = {}
        self.submitted: list[str] = []
        self.submit, self.feed = _Method(self._submit), _Method(self._feed)
        self.abort, self.close_feed = _Method(lambda request_id: None), _Method(self._close)

    def _queue(self, name: str):
        return self.feeds.setdefault(name, asyncio.Queue())

    async def _submit(self, req, name: str) -> None:
        from raydeploy.engine.request import TokenEvent

        self.submitted.append(req.request_id)
        q = self._queue(name)
        line = int(req.request_id.split("-")[1])
        if line in self.poison:
            q.put_nowait([TokenEvent(req.request_id, None, finish_reason="error", error="NaN in the logits")])
            return
        if line in self.fail_first and req.request_id.endswith("-0"):
            q.put_nowait([TokenEvent(req.request_id, None, finish_reason="error", error="host died", retriable=True)])
            return
        for i in range(req.max_tokens):
            done = "length" if i + 1 == req.max_tokens else None
            q.put_nowait([TokenEvent(req.request_id, req.prompt_token_ids[-1] + i + 1, 0.0, i, done)])

    async def _feed(self, name: str):
        async def ready(batch):
            return batch

        q = self._queue(name)
        while (batch := await q.get()) is not None:
            yield ready(batch)

    async def _close(self, name: str) -> None:
        self._queue(name).put_nowait(None)


class _FakeGang:
    def __init__(self, restarting_calls: int = 0, fail_first: set[int] = frozenset(),
                 poison: set[int] = frozenset()) -> None:
        self.restarting_calls = restarting_calls
        self.coord = _FakeCoordinator(set(fail_first), set(poison))
        self.waits = 0
        self.generation = 1

    def coordinator(self):
        from raydeploy.gang.bringup import GangError

        if self.restarting_calls > 0:
            self.restarting_calls -= 1
            raise GangError("gang is not ready (state restarting)", phase="serve")
        return self.coord

    def state(self):
        return {"state": "ready", "generation": self.generation}

    def wait_ready(self, timeout_s: float, newer_than: int | None = None):
        """A wait after a failure is one restart: the generation moves past the one the caller saw fail."""
        if newer_than is None:
            return self.state()
        self.waits += 1
        self.generation = max(self.generation, newer_than + 1)
        return self.state()


def test_generate_all_retries_gang_restarts_and_keeps_order(cfg) -> None:
    examples = [Example(i, i, (100 * i, 10 * i), max_tokens=1 + i % 3) for i in range(1, 8)]
    gang = _FakeGang(restarting_calls=2, fail_first={3, 5})
    written = []
    asyncio.run(generate_all(gang, examples, 0.0, cfg, lambda ex, out: written.append((ex.index, out)), in_flight=3))
    assert [i for i, _ in written] == list(range(1, 8))
    for i, out in written:
        assert out.token_ids == [10 * i + k + 1 for k in range(1 + i % 3)] and out.finish_reason == "length"
    assert gang.waits == 4  # two "restarting" refusals and two retriable error events, each retried once ready


def test_generate_all_stops_when_the_gang_does_not_come_back(cfg) -> None:
    from raydeploy.predict import PredictRunError

    gang = _FakeGang(restarting_calls=100)
    with pytest.raises(PredictRunError, match="input line 1: gang is not ready"):
        asyncio.run(generate_all(gang, [Example(1, 1, (5,), 2)], 0.0, cfg, lambda ex, out: None, in_flight=1))
    assert gang.waits == cfg.cluster.max_restarts


def test_window_bounds_lines_read_ahead_of_rows_written(cfg) -> None:
    """The driver holds at most `window` lines between reading and writing, however long the input: the
    lines taken from the input never run more than the window ahead of the rows written."""
    taken, ahead = [0], []

    def lines():
        for i in range(1, 201):
            taken[0] += 1
            yield Example(i, i, (i,), 1 + i % 5)

    written: list[int] = []

    def write(ex, out) -> None:
        written.append(ex.index)
        ahead.append(taken[0] - len(written))

    asyncio.run(generate_all(_FakeGang(), lines(), 0.0, cfg, write, in_flight=3, window=8))
    assert written == list(range(1, 201))
    assert max(ahead) <= 8 and max(ahead) >= 7  # bounded by the window, and the window is used


def _args(inp: Path, out: Path, on_error: str = "skip") -> argparse.Namespace:
    return argparse.Namespace(input=str(inp), output=str(out), max_tokens=None, temperature=0.0,
                              on_error=on_error, address=None)


def _mixed_input(tmp_path: Path) -> Path:
    lines = [json.dumps({"prompt": f"Line {i} of the input", "id": f"q{i}", "max_tokens": 2 + i % 3})
             for i in range(1, 9)]
    lines[2] = '{"prompt": "line 3 is cut'   # malformed, mid-file
    lines.insert(5, "")                       # a blank line: no row
    return _write(tmp_path, lines)


def test_run_writes_error_rows_and_completes(tmp_path: Path, codec, cfg, capsys: pytest.CaptureFixture) -> None:
    """A malformed line and a line whose generation fails (not retriably) each get an error row naming the
    line; every other line gets its result, in input order, and the run exits 0."""
    inp, out = _mixed_input(tmp_path), tmp_path / "out.jsonl"
    gang = _FakeGang(poison={5})
    assert run_predict(cfg, _args(inp, out), gang=gang) == 0
    err = capsys.readouterr().err
    assert "in.jsonl:3: invalid_input: not valid JSON" in err
    assert "in.jsonl:5: generation_error: NaN in the logits (error row written)" in err
    assert "wrote 8 row(s) (2 error row(s))" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [1, 2, 3, 4, 5, 7, 8, 9]
    assert all(tuple(r) == ROW_KEYS for r in rows)
    with inp.open("rb") as f:
        assert [r["input_sha256"] for r in rows] == [ln.sha256 for ln in input_lines(f)]
    by_index = {r["index"]: r for r in rows}
    assert by_index[3]["error"]["type"] == "invalid_input" and "not valid JSON" in by_index[3]["error"]["message"]
    assert by_index[3]["id"] == 3 and by_index[3]["text"] is None and by_index[3]["finish_reason"] == "error"
    assert by_index[5]["error"] == {"message": "NaN in the logits", "type": "generation_error"}
    assert by_index[5]["id"] == "q5" and by_index[5]["token_ids"] == []
    assert [s for s in gang.coord.submitted if s.startswith("predict-5-")] == ["predict-5-0"]  # not retried
    for r in rows:
        if r["error"] is None:
            assert r["id"] == f"q{r['index'] - (r['index'] > 6)}" and r["finish_reason"] == "length"


def test_on_error_fail_stops_after_earlier_rows(tmp_path: Path, codec, cfg, capsys: pytest.CaptureFixture) -> None:
    inp, out = _mixed_input(tmp_path), tmp_path / "out.jsonl"
    assert run_predict(cfg, _args(inp, out, "fail"), gang=_FakeGang()) == 1
    err = capsys.readouterr().err
    assert "in.jsonl:3: invalid_input: not valid JSON" in err and "--on-error fail" in err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [1, 2]
    # the line fixed, the same command resumes at it
    lines = inp.read_text().splitlines()
    lines[2] = json.dumps({"prompt": "line 3, fixed"})
    inp.write_text("\n".join(lines) + "\n")
    assert run_predict(cfg, _args(inp, out, "fail"), gang=_FakeGang(poison={8})) == 1
    assert "in.jsonl:8: generation_error: NaN in the logits" in capsys.readouterr().err
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [1, 2, 3, 4, 5, 7]


def test_cli_fail_on_first_line_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = _write(tmp_path, ["{oops", '{"prompt": "ok"}'])
    rc = main(["predict", str(CONFIG), "--input", str(p), "--output", str(tmp_path / "out.jsonl"),
               "--on-bad-line", "fail"])
    assert rc == 1
    assert "in.jsonl:1: invalid_input: not valid JSON" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_text() == ""


def test_gang_that_does_not_come_up_is_one_clear_error(tmp_path: Path, codec, cfg,
                                                        capsys: pytest.CaptureFixture) -> None:
    from raydeploy.gang.bringup import GangError

    class DeadGang(_FakeGang):
        def wait_ready(self, timeout_s: float, newer_than: int | None = None):
            raise GangError("gang failed: placement of 2 hosts timed out", phase="placement", retriable=False)

    inp, out = _mixed_input(tmp_path), tmp_path / "out.jsonl"
    assert run_predict(cfg, _args(inp, out), gang=DeadGang()) == 1
    assert "the gang did not come up (placement): gang failed: placement of 2 hosts timed out" in \
        capsys.readouterr().err
    assert out.read_text() == ""


def test_missing_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["predict", str(CONFIG), "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o.jsonl")])
    assert rc == 1 and "cannot read input" in capsys.readouterr().err


def test_resume_redoes_only_missing_rows(tmp_path: Path, codec, cfg, capsys: pytest.CaptureFixture) -> None:
    inp, out = _mixed_input(tmp_path), tmp_path / "out.jsonl"
    assert run_predict(cfg, _args(inp, out), gang=_FakeGang()) == 0
    full = out.read_text().splitlines(keepends=True)
    out.write_text("".join(full[:4]) + full[4][:15])
    gang = _FakeGang()
    capsys.readouterr()
    assert run_predict(cfg, _args(inp, out), gang=gang) == 0
    assert "4 line(s) already in" in capsys.readouterr().err
    assert out.read_text().splitlines(keepends=True) == full
    assert sorted({s.split("-")[1] for s in gang.coord.submitted}) == ["5", "7", "8", "9"]
    # all done: nothing is generated and no gang is needed
    assert run_predict(cfg, _args(inp, out), gang=None) == 0
    assert "wrote 0 row(s)" in capsys.readouterr().err


def test_without_a_cap_a_line_generates_until_the_context_ends(tmp_path: Path, codec) -> None:
    uncapped = load_config(None, ["model.max_seq_len=256"])  # engine.max_new_tokens: null (no operator cap)
    assert uncapped.engine.max_new_tokens is None
    p = _write(tmp_path, ['{"prompt": "The capital of France is"}', '{"prompt": "Hi", "max_tokens": 500}',
                          '{"prompt": "Hi", "max_tokens": 200}'])
    first, too_long, fits = _parse_all(p, codec, uncapped, None)
    assert isinstance(first, Example)
    assert first.max_tokens == 256 - len(first.prompt_token_ids)
    assert isinstance(too_long, BadLine) and too_long.reason == '"max_tokens" 500 leaves no room for a prompt in model.max_seq_len 256'
    assert isinstance(fits, Example) and fits.max_tokens == 200
