"""The data of the repo's lm-eval tasks, read from the JSONL files beside this module.

Each task YAML here names one of these functions as its `custom_dataset`: lm-eval resolves `!function` against
the YAML's own folder, so the tasks load from any working directory and without a dataset hub. lm-eval calls
them with the task's metadata as keywords, which they do not need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def _test_split(file_name: str) -> datasets.DatasetDict:
    lines = (HERE / file_name).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def science_mc(**_: Any) -> datasets.DatasetDict:
    """ARC-style science questions, four choices each, `answer` the index of the right one."""
    return _test_split("science_mc.jsonl")


def short_qa(**_: Any) -> datasets.DatasetDict:
    """Short factual questions with one-phrase answers."""
    return _test_split("short_qa.jsonl")
