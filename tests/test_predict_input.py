"""`raydeploy predict` input and resume handling (no Ray): bad lines name their line number, are skipped
or fatal per --on-bad-line, and an interrupted output file is resumed from its last complete line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydeploy.cli import main
from raydeploy.config import load_config
from raydeploy.predict import PredictInputError, load_done, read_examples

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def codec(demo_checkpoint: Path):
    from raydeploy.serve.text import TextCodec

    return TextCodec.from_dir(demo_checkpoint)


@pytest.fixture(scope="module")
def cfg():
    return load_config(REPO / "configs" / "predict-small.yaml")


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


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_good_lines(tmp_path: Path, codec, cfg) -> None:
    p = _write(tmp_path, ['{"prompt": "The capital of France is", "id": "a"}', "",
                          '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}'])
    examples, bad = read_examples(p, codec, cfg, 16)
    assert bad == []
    assert [(e.index, e.id, e.max_tokens) for e in examples] == [(1, "a", 16), (3, 3, 5)]
    assert list(examples[0].prompt_token_ids) == codec.encode("The capital of France is")
    assert codec.decode(examples[1].prompt_token_ids).rstrip().endswith("assistant")


@pytest.mark.parametrize(("line", "reason"), BAD, ids=[r for _, r in BAD])
def test_bad_line_skipped_with_line_number(tmp_path: Path, codec, cfg, line: str, reason: str) -> None:
    p = _write(tmp_path, ['{"prompt": "ok"}', line, '{"prompt": "also ok"}'])
    examples, bad = read_examples(p, codec, cfg, 64, "skip")
    assert [e.index for e in examples] == [1, 3]
    assert len(bad) == 1 and bad[0].index == 2 and reason in bad[0].reason
    with pytest.raises(PredictInputError, match=rf"in.jsonl:2: .*{reason[:20]}"):
        read_examples(p, codec, cfg, 64, "fail")


def test_cli_fails_on_bad_line_before_starting_anything(tmp_path: Path, demo_checkpoint: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    p = _write(tmp_path, ['{"prompt": "ok"}', "{oops"])
    rc = main(["predict", str(REPO / "configs" / "predict-small.yaml"), "--input", str(p),
               "--output", str(tmp_path / "out.jsonl"), "--on-bad-line", "fail"])
    assert rc == 1
    assert "in.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_input(tmp_path: Path, demo_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["predict", str(REPO / "configs" / "predict-small.yaml"), "--input", str(tmp_path / "nope.jsonl"),
               "--output", str(tmp_path / "out.jsonl")])
    assert rc == 1 and "cannot read input" in capsys.readouterr().err


def test_resume_drops_torn_last_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 1, "text": "a"}\n{"index": 3, "text": "b"}\n{"index": 4, "te')
    assert load_done(out) == {1, 3}
    assert out.read_text() == '{"index": 1, "text": "a"}\n{"index": 3, "text": "b"}\n'
    assert load_done(tmp_path / "absent.jsonl") == set()


def test_resume_refuses_foreign_output(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 1}\n{"something": "else"}\n')
    with pytest.raises(PredictInputError, match="out.jsonl:2: not a raydeploy predict output line"):
        load_done(out)


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class _FakeCoordinator:
    """Rank 0's feed calls (submit / feed / abort / close_feed) as a fast stand-in: each request's tokens are the
    prompt's last id + 1, + 2, ..., one list each."""

    def __init__(self, fail_first: set[int]) -> None:
        import types

        self.fail_first = fail_first
        self._actor_id = types.SimpleNamespace(hex=lambda: "fake-coordinator")
        self.feeds: dict = {}
        self.submit, self.feed = _Method(self._submit), _Method(self._feed)
        self.abort, self.close_feed = _Method(lambda request_id: None), _Method(self._close)

    def _queue(self, name: str):
        import asyncio

        return self.feeds.setdefault(name, asyncio.Queue())

    async def _submit(self, req, name: str) -> None:
        from raydeploy.engine.request import TokenEvent

        q = self._queue(name)
        if int(req.request_id.split("-")[1]) in self.fail_first and req.request_id.endswith("-0"):
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
    def __init__(self, restarting_calls: int, fail_first: set[int]) -> None:
        self.restarting_calls = restarting_calls
        self.coord = _FakeCoordinator(fail_first)
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
        """Each wait is one restart: the generation moves past the one the caller saw fail."""
        self.waits += 1
        assert newer_than is not None, "a retry must wait for a generation after the failed one"
        self.generation = max(self.generation, newer_than + 1)
        return self.state()


def test_generate_all_retries_gang_restarts_and_keeps_order(cfg) -> None:
    import asyncio

    from raydeploy.predict import Example, generate_all

    examples = [Example(i, i, (100 * i, 10 * i), max_tokens=1 + i % 3) for i in range(1, 8)]
    gang = _FakeGang(restarting_calls=2, fail_first={3, 5})
    written = []
    asyncio.run(generate_all(gang, examples, 0.0, cfg, lambda ex, out: written.append((ex.index, out)), in_flight=3))
    assert [i for i, _ in written] == list(range(1, 8))
    for i, out in written:
        assert out.token_ids == [10 * i + k + 1 for k in range(1 + i % 3)] and out.finish_reason == "length"
    assert gang.waits == 4  # two "restarting" refusals and two retriable error events, each retried once ready


def test_generate_all_gives_up_after_max_restarts(cfg) -> None:
    import asyncio

    from raydeploy.predict import Example, generate_all

    gang = _FakeGang(restarting_calls=100, fail_first=set())
    with pytest.raises(RuntimeError, match="gang is not ready"):
        asyncio.run(generate_all(gang, [Example(1, 1, (5,), 2)], 0.0, cfg, lambda ex, out: None, in_flight=1))
    assert gang.waits == cfg.cluster.max_restarts
