"""Shipped configs and generated docs: every config says when to use it, loads strictly, and
docs/config.md is exactly what `raydeploy config-reference` prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydeploy.cli import main
from raydeploy.config import config_reference_markdown, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_says_when_to_use_it(path: Path) -> None:
    load_config(path)
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert len(header) >= 3, f"{path.name}: needs a comment block saying when to use it"
    assert "when to use it" in " ".join(header).lower(), f"{path.name}: the comment block must say when to use it"


def test_config_md_in_sync(capsys: pytest.CaptureFixture) -> None:
    assert main(["config-reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == config_reference_markdown() + "\n"
    doc = (REPO / "docs" / "config.md").read_text()
    assert doc == printed, "docs/config.md is stale: run `raydeploy config-reference > docs/config.md`"
