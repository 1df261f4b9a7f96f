"""`raydeploy submit` without a cluster: argument handling, the staged working dir, local config checks."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from raydeploy.cli import main
from raydeploy.config import ConfigError, load_config
from raydeploy.plan import make_plan
from raydeploy.submit import (
    SubmitError,
    _absolute_paths,
    _options_before_dashes,
    dashboard_address,
    entrypoint,
    split_entry,
    stage_working_dir,
)

REPO = Path(__file__).resolve().parents[1]


def test_split_entry() -> None:
    assert split_entry(["--", "predict", "--input", "a"]) == ("predict", ["--input", "a"])
    assert split_entry(["serve"]) == ("serve", [])
    with pytest.raises(SubmitError, match="give `-- serve ARGS` or `-- predict ARGS`; found 'generate'"):
        split_entry(["--", "generate"])
    with pytest.raises(SubmitError, match="found 'nothing'"):
        split_entry([])


def test_options_before_dashes() -> None:
    args = argparse.Namespace(entry=["--address", "http://h:8265", "--no-wait", "--", "serve"], address=None,
                              no_wait=False, timeout_s=None)
    assert _options_before_dashes(args) == ["--", "serve"]
    assert args.address == "http://h:8265" and args.no_wait
    bad = argparse.Namespace(entry=["--bogus", "--", "serve"], address=None, no_wait=False, timeout_s=None)
    with pytest.raises(SubmitError, match=r"unknown option\(s\) \['--bogus'\]"):
        _options_before_dashes(bad)


def test_dashboard_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert dashboard_address(None) == "http://127.0.0.1:8265"
    assert dashboard_address("http://head:8265/") == "http://head:8265"
    with pytest.raises(SubmitError, match="needs the dashboard's http\\(s\\) address .* found 'ray://head:10001'"):
        dashboard_address("ray://head:10001")


def test_staged_working_dir_is_self_contained(tmp_path: Path) -> None:
    staged = stage_working_dir(REPO / "configs" / "tpu-v5e-16.yaml", tmp_path / "wd")
    assert staged == tmp_path / "wd" / "config.yaml"
    assert (tmp_path / "wd" / "model-config.json").is_file()
    cfg = load_config(staged)
    assert cfg.model.hf_config == "model-config.json"
    assert make_plan(cfg).ok  # plans from the staged dir alone


def test_bad_config_fails_before_submitting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {max_slotz: 4}\n")
    rc = main(["submit", str(bad), "--address", "http://127.0.0.1:9", "--", "predict", "--input", "a",
               "--output", "b"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "config error: file " in err and "key 'engine.max_slotz': unknown key" in err
    assert "cannot reach" not in err
    with pytest.raises(ConfigError, match="key 'engine.max_slotz': unknown key"):
        stage_working_dir(bad, tmp_path / "wd")


def test_entrypoint_and_paths(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("")
    argv = _absolute_paths("predict", ["--input", str(tmp_path / "in.jsonl"), "--output", "/nonexistent/dir/o.jsonl"])
    assert argv == ["--input", str(tmp_path / "in.jsonl"), "--output", "/nonexistent/dir/o.jsonl"]
    assert entrypoint("predict", ["--input", "a b.jsonl"]) == "python -m raydeploy predict config.yaml --input 'a b.jsonl'"
