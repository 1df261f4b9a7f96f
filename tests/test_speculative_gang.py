"""Speculative decoding on a real 2-host gang whose mesh shards the weights across the hosts (real Ray, real
jax.distributed, the real gang actors, 2 virtual CPU devices per host, fsdp=2 outermost and tp=2 inside each host,
as tests/test_gang_model.py starts it), the real demo model, `engine.speculative.method: ngram`.

Rank 0 proposes and its plans carry the proposals to rank 1, which verifies the same tokens in the same verify
programs. Greedy tokens equal those of the same config with speculation off (the engine of that config in this
process, over 4 of its virtual devices with the same mesh shape: tests/test_gang_model.py shows that engine and
the gang agree), with proposals verified and accepted:
- prompts longer than a prefill chunk (prefilled in several steps), then a prompt that shares whole pages with an
  earlier one (a prefix-cache hit), one after another;
- two requests at once (both slots speculating in one step).

One gang is shared by every test of this module.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import jax
import pytest

from raydeploy.config import load_config
from raydeploy.engine.local import LocalRunner
from raydeploy.engine.request import GenerationRequest
from raydeploy.gang.feed import stream_events
from raydeploy.gang.gang import start_gang
from raydeploy.gang.runtime import load_checkpoint_engine
from raydeploy.model.sharding import build_mesh
from raydeploy.serve.text import TextCodec

pytestmark = [pytest.mark.ray, pytest.mark.model, pytest.mark.slow]

OVERRIDES = ["cluster.devices_per_host=2", "mesh.axes={fsdp: 2, tp: 2}",
             "mesh.rules={q_heads: null, kv_heads: null, cache_kv_heads: null}", "model.max_seq_len=256",
             "engine.max_new_tokens=64", "engine.max_slots=2", "engine.prefill_chunk=16",
             "cluster.init_timeout_s=60", "cluster.rpc_timeout_s=1200", "cluster.step_timeout_s=600"]
"""test_gang_model's gang with prompt chunks of 16 tokens (every prompt here is prefilled in several steps)."""
PAGE = 16  # the config's page size: a prompt sharing 2 pages' worth of tokens with an earlier one reuses them
N_TOKENS = 48
PARAGRAPH = ("The quick brown fox jumpd over the lazy dog. It was a sunny day, and the feilds were full of "
             "flowers. The farmer walked slowley to the barn, carrying a bucket of water for the horses.")
MESSAGES = {
    "copy": [{"role": "user", "content": f"Copy this text exactly.\n\n{PARAGRAPH}"}],
    "copy-again": [{"role": "user", "content": f"Copy this text exactly.\n\n{PARAGRAPH}\n\nThen stop."}],
    "fix": [{"role": "user", "content": f"Fix the spelling in this text.\n\n{PARAGRAPH}"}],
    "list": [{"role": "user", "content": "Repeat after me: one, two, three, one, two, three, one, two, three."}],
}


@pytest.fixture(scope="module")
def prompts(demo_checkpoint: Path) -> dict[str, tuple[int, ...]]:
    codec = TextCodec.from_dir(demo_checkpoint)
    out = {n: tuple(codec.encode_chat(codec.chat_prompt(m))) for n, m in MESSAGES.items()}
    shared = next(i for i, (a, b) in enumerate(zip(out["copy"], out["copy-again"], strict=False)) if a != b)
    assert shared >= 2 * PAGE and min(map(len, out.values())) > 16  # whole pages shared; chunked prompts
    return out


@pytest.fixture(scope="module")
def gang(demo_checkpoint: Path):
    import ray

    cfg = load_config(None, [*OVERRIDES, "engine.speculative.method=ngram"])
    ray.init(num_cpus=2, _temp_dir=f"/tmp/rdsg-{os.getpid()}", include_dashboard=False,
             configure_logging=False, log_to_driver=False)
    g = start_gang(cfg, checkpoint_path=str(demo_checkpoint))
    try:
        g.wait_ready(1200)
        yield g
    finally:
        g.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def plain(demo_checkpoint: Path):
    """The same config with speculation off, in this process over 4 virtual devices with the same mesh."""
    cfg = load_config(None, OVERRIDES)
    assert cfg.engine.speculative.method == "none"
    loaded = load_checkpoint_engine(cfg, build_mesh(cfg.mesh_shape, jax.local_devices()[:4]), str(demo_checkpoint))
    return LocalRunner(loaded.engine, loaded.make_scheduler())


def _greedy(rid: str, prompt: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens=N_TOKENS, ignore_eos=True)


def _tokens(events) -> list[int]:
    assert events[-1].finish_reason == "length", events[-1]
    return [e.token_id for e in events if e.token_id is not None]


def _stats(gang) -> dict:
    stats = gang.status()["stats"]
    assert stats and not stats.get("error"), stats
    return stats


def test_chunked_prefill_then_a_prefix_hit_equal_no_speculation(gang, plain, prompts):
    before = _stats(gang)
    got = [_tokens(gang.generate(_greedy(f"g-{n}", prompts[n]), timeout_s=900)) for n in ("copy", "copy-again")]
    want = [plain.generate([_greedy(f"p-{n}", prompts[n])], timeout_s=900)[0].token_ids
            for n in ("copy", "copy-again")]
    assert got == want
    after = _stats(gang)
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"], after  # copy-again reused copy's pages
    assert after["spec_decode_num_drafts"] > before.get("spec_decode_num_drafts", 0), after
    assert after["spec_decode_num_accepted_tokens"] > before.get("spec_decode_num_accepted_tokens", 0), after


def test_two_speculating_rows_at_once_equal_no_speculation(gang, plain, prompts):
    names = ("fix", "list")
    before = _stats(gang)

    async def both() -> list[list]:
        async def one(n: str) -> list:
            events: list = []
            async for batch in stream_events(gang.coordinator(), _greedy(f"g2-{n}", prompts[n])):
                events.extend(batch)
            return events

        return list(await asyncio.wait_for(asyncio.gather(*(one(n) for n in names)), 900))

    got = [_tokens(ev) for ev in asyncio.run(both())]
    want = [o.token_ids for o in plain.generate([_greedy(f"p2-{n}", prompts[n]) for n in names], timeout_s=900)]
    assert got == want
    after = _stats(gang)
    assert after["spec_decode_num_accepted_tokens"] > before.get("spec_decode_num_accepted_tokens", 0), after
