"""The paged engine on the real demo model, against transformers PyTorch float32.

The plans come from `PlanDriver` below, a small host-side planner written against the `StepPlan` contract
(slots, pages, chunks, decode rows) so the engine is tested on its own; the serving scheduler builds the same
plans.
- greedy tokens (48) match transformers up to its first small top-1/top-2 gap, and the first token's logprob
  matches the reference's log-softmax within 1e-3, on one device and with dp=2;
- a 1500-token prompt prefilled in chunks of 256 gives the same tokens as in one chunk;
- staggered arrivals (prefill chunks of new requests in the same steps as running decode rows, several decode
  steps per plan) give each request the tokens it gets alone, greedy and sampled;
- a request that starts from another's full pages (prefix reuse) gives the tokens it gets when prefilled whole;
- bad plans are refused with messages naming the slot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hf_reference import REFERENCE_TOKENS

pytestmark = pytest.mark.model

NEW_TOKENS = REFERENCE_TOKENS
MIN_GAP = 0.05


class PlanDriver:
    """Plans for a paged engine: a slot and pages per request, prompt chunks within each dp group's token
    budget (decode rows first), and several decode steps per plan when no prompt is being prefilled."""

    def __init__(self, engine, chunk: int | None = None, decode_steps: int | None = None) -> None:
        self.e = engine
        self.chunk = chunk or engine.max_step_tokens
        self.decode_steps = decode_steps or engine.decode_steps
        self.free_pages = {g: list(range(engine.pages_per_group)) for g in range(engine.groups)}
        self.refs = {g: np.zeros(engine.pages_per_group, int) for g in range(engine.groups)}
        self.free_slots = list(engine.slot_order)
        self.live: dict[int, dict] = {}
        self.step_id = 0
        self.release: list[int] = []

    def add(self, name, prompt, max_new, sampling=None, share_from: int | None = None) -> int:
        from raydeploy.engine.step import SamplingParams

        slot = self.free_slots.pop(0)
        r = {"name": name, "prompt": list(prompt), "done": 0, "out": [], "logprobs": [], "max_new": max_new,
             "sampling": sampling or SamplingParams(), "pages": [], "first": True, "prefix": None}
        if share_from is not None:
            src = self.live[share_from]
            ps = self.e.page_size
            common = 0
            while (common < min(len(prompt), len(src["prompt"])) and prompt[common] == src["prompt"][common]):
                common += 1
            full = min(common, len(prompt) - 1) // ps  # full pages only, and the last token is computed
            r["pages"] = list(src["pages"][:full])
            g = slot // self.e.slots_per_group
            assert g == share_from // self.e.slots_per_group, "pages are shared within a dp group"
            for p in r["pages"]:
                self.refs[g][p] += 1
            r["done"] = full * ps
            r["prefix"] = np.asarray(prompt[:full * ps], np.int32)
        self.live[slot] = r
        return slot

    def _pages(self, slot, r, upto, updates):
        from raydeploy.engine.step import PageUpdate

        ps, g = self.e.page_size, slot // self.e.slots_per_group
        need = -(-upto // ps)
        first = len(r["pages"])
        new = []
        while len(r["pages"]) < need:
            p = self.free_pages[g].pop(0)
            self.refs[g][p] += 1
            r["pages"].append(p)
            new.append(p)
        if first > 0 and r["first"]:  # a request starting on shared pages: its row's first entries
            updates.append(PageUpdate(slot, 0, np.asarray(r["pages"][:first], np.int32)))
        if new:
            updates.append(PageUpdate(slot, first, np.asarray(new, np.int32)))

    def plan(self):
        from raydeploy.engine.step import SeqStep, StepPlan

        seqs, updates = [], []
        budget = {g: self.e.max_step_tokens for g in range(self.e.groups)}
        prefilling = any(r["done"] < len(r["prompt"]) for r in self.live.values())
        steps = 1 if prefilling else self.decode_steps
        if not prefilling and self.live:
            steps = max(1, min(steps, max(r["max_new"] - len(r["out"]) for r in self.live.values()),
                               min(self.e.max_seq_len - (len(r["prompt"]) + len(r["out"]) - 1)
                                   for r in self.live.values())))
        for slot, r in self.live.items():  # decode rows first: running streams never wait
            if r["done"] >= len(r["prompt"]):
                g = slot // self.e.slots_per_group
                budget[g] -= 1
                start = len(r["prompt"]) + len(r["out"]) - 1
                self._pages(slot, r, start + steps, updates)
                seqs.append(SeqStep(slot, np.zeros(0, np.int32), start, True))
        for slot, r in self.live.items():
            if r["done"] < len(r["prompt"]):
                g = slot // self.e.slots_per_group
                n = min(self.chunk, budget[g], len(r["prompt"]) - r["done"])
                if n <= 0:
                    continue
                budget[g] -= n
                start = r["done"]
                self._pages(slot, r, start + n, updates)
                last = start + n == len(r["prompt"])
                seqs.append(SeqStep(slot, np.asarray(r["prompt"][start:start + n], np.int32), start, last,
                                    r["sampling"] if r["first"] else None,
                                    r["prefix"] if r["first"] else None))
                r["first"] = False
                r["done"] += n
        plan = StepPlan(self.step_id, seqs=tuple(seqs), pages=tuple(updates), release=tuple(self.release),
                        decode_steps=steps)
        self.release = []
        self.step_id += 1
        return plan

    def on_result(self, plan, result):
        for i, q in enumerate(plan.seqs):
            if not q.sample or q.slot not in self.live:
                continue
            r = self.live[q.slot]
            for k in range(result.tokens.shape[0]):
                if len(r["out"]) < r["max_new"]:
                    r["out"].append(int(result.tokens[k, i]))
                    r["logprobs"].append(float(result.logprobs[k, i]))
        finished = {}
        for slot, r in list(self.live.items()):
            if len(r["out"]) >= r["max_new"]:
                finished[r["name"]] = r
                g = slot // self.e.slots_per_group
                for p in r["pages"]:
                    self.refs[g][p] -= 1
                    if self.refs[g][p] == 0:
                        self.free_pages[g].append(p)
                del self.live[slot]
                self.free_slots.append(slot)
                self.release.append(slot)
        return finished

    def run(self, requests, stagger=None):
        """requests: list of (name, prompt, max_new, sampling); request i joins before step stagger[i]."""
        stagger = stagger or [0] * len(requests)
        pending = sorted(range(len(requests)), key=lambda i: stagger[i])
        done, step = {}, 0
        while pending or self.live:
            while pending and stagger[pending[0]] <= step:
                self.add(*requests[pending.pop(0)])
            if self.live:
                plan = self.plan()
                done.update(self.on_result(plan, self.e.step(plan)))
            step += 1
        if self.release:
            self.e.step(self.plan())
        return done


def _build_engine(checkpoint, mesh_shape, max_seq_len=256, max_slots=4, prefill_chunk=64, decode_steps=4,
                  param_dtype="float32", params_as=None, **engine_kw):
    """A paged engine over the demo checkpoint; `params_as` (a dtype) casts the loaded weights after loading
    (e.g. bfloat16-rounded weights held as float32)."""
    import jax

    from raydeploy.checkpoint.reader import CheckpointReader
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine as PagedEngine
    from raydeploy.model.registry import from_hf_config
    from raydeploy.model.sharding import build_mesh, merge_rules

    n = int(np.prod(list(mesh_shape.values())))
    mesh = build_mesh(mesh_shape, jax.devices()[:n])
    rules = merge_rules({"q_heads": None, "kv_heads": None, "cache_kv_heads": None} if "tp" in mesh_shape else {})
    reader = CheckpointReader(checkpoint)
    params, _ = reader.load(reader.param_specs(), mesh, rules, param_dtype, 4, progress=False)
    if params_as is not None:
        params = jax.tree.map(lambda a: a.astype(params_as), params)
    engine_cfg = EngineConfig(max_slots=max_slots, max_new_tokens=64,
                              prefill_chunk=prefill_chunk, decode_steps=decode_steps, **engine_kw)
    model_cfg = ModelConfig(max_seq_len=max_seq_len,
                            param_dtype=param_dtype if params_as is None else np.dtype(params_as).name)
    return PagedEngine(*from_hf_config(reader.hf_config), params, mesh, rules, model_cfg, engine_cfg)


@pytest.fixture(scope="module")
def engine(demo_checkpoint):
    return _build_engine(demo_checkpoint, {"dp": 1})


@pytest.fixture(scope="module")
def unpacked(demo_checkpoint):
    """The demo engine with float32 weights only (`engine.pack_weights: off`): its one-token program runs
    unrolled, and its projections multiply float32 weights."""
    return _build_engine(demo_checkpoint, {"dp": 1}, pack_weights="off")


def _trusted_prefix(gaps: list[float]) -> int:
    from hf_reference import trusted_steps

    return min(trusted_steps(gaps, MIN_GAP) + 1, len(gaps))


def _alone(engine, prompts, sampling=None):
    out = []
    for i, ids in enumerate(prompts):
        sp = None if sampling is None else sampling[i]
        out.append(PlanDriver(engine).run([(f"r{i}", ids, NEW_TOKENS, sp)])[f"r{i}"])
    return out


@pytest.fixture(scope="module")
def alone(engine, prompt_ids):
    return _alone(engine, prompt_ids)


def _check_reference(results, reference):
    compared = 0
    for r, (ref_tokens, gaps, ref_logits) in zip(results, reference, strict=True):
        n = _trusted_prefix(gaps)
        assert r["out"][:n] == ref_tokens[:n], f"first {n} greedy tokens differ"
        compared += n
        ref_lp = ref_logits - ref_logits.max()
        ref_lp = ref_lp - np.log(np.exp(ref_lp).sum())
        diff = abs(r["logprobs"][0] - float(ref_lp[r["out"][0]]))
        assert diff <= 1e-3, f"first token logprob differs from the reference's by {diff}"
    assert compared >= 60  # the comparison is not vacuous


def test_greedy_tokens_and_logprobs_match_transformers(alone, reference):
    _check_reference(alone, reference)


def test_one_token_steps_run_unrolled_over_views_of_the_stacked_weights(unpacked, demo_checkpoint, prompt_ids):
    """On CPU the one-token step program runs the layers unrolled, over per-layer arrays that are views of the
    stacked weights' memory (XLA CPU copies a scanned layer's weight slice before each matmul); every other
    program scans. The unrolled program's tokens and logprobs equal those of an engine with
    `engine.unroll_layers: off`, which scans everywhere. (An engine with packed weights scans everywhere: a
    layer slice names its packed copy.)"""
    from raydeploy.engine.programs import ProgramShape

    engine = unpacked
    ps = engine.programs_set
    pages = ps.page_buckets[0]
    assert ps.unrolled(ProgramShape("step", 1, pages))
    assert not any(ps.unrolled(ProgramShape("step", t, pages)) for t in ps.token_buckets if t > 1)
    views = engine._layer_views
    stacked = [engine._param_leaves[i] for i in ps.layer_leaves]
    assert len(views) == engine.cfg.num_layers and len(stacked) >= 9
    for layer in (0, 7, engine.cfg.num_layers - 1):
        for view, x in zip(views[layer], stacked, strict=True):
            step = int(np.prod(x.shape[1:])) * x.dtype.itemsize
            assert view.unsafe_buffer_pointer() == x.unsafe_buffer_pointer() + layer * step  # no copy
            np.testing.assert_array_equal(np.asarray(view), np.asarray(x)[layer])
    from raydeploy.model.scan import unroll_layers

    with pytest.raises(ValueError, match=r"layer 1: arrays of shapes \[.*\] do not match the stacked layer"):
        unroll_layers(ps.model(engine._param_leaves).layers, [views[0], views[1][1:]])
    unrolled = PlanDriver(engine).run([("r0", prompt_ids[0], NEW_TOKENS, None)])["r0"]
    off = _build_engine(demo_checkpoint, {"dp": 1}, unroll_layers="off", pack_weights="off")
    assert off.programs_set.unrolled_tokens == frozenset() and off._layer_views is None
    scanned = PlanDriver(off).run([("r0", prompt_ids[0], NEW_TOKENS, None)])["r0"]
    assert scanned["out"] == unrolled["out"]
    np.testing.assert_allclose(scanned["logprobs"], unrolled["logprobs"], atol=1e-5)


def test_cpu_steps_of_few_rows_multiply_in_the_native_kernel_over_the_stacked_weights(unpacked, demo_checkpoint,
                                                                                    prompt_ids):
    """On CPU with replicated float32 weights, a step program of 2-32 rows per device (1-32 in the AVX-512 build)
    multiplies its seven
    projections per layer and the tied LM head in the native kernel (`raydeploy.model.native`), reading each stacked weight whole
    with the layer index: q, k and v in one call, gate and up in one, o and down alone; no per-layer copy of a
    weight is made; its decode rows attend in the native attention kernel (every program). Greedy tokens and
    logprobs equal those of an engine with `engine.cpu_matmul: xla` (XLA everywhere)."""
    import re

    from raydeploy.model import native

    engine = unpacked
    ps = engine.programs_set
    assert ps.native_matmul is None and engine.matmul == "native"
    pages = ps.page_buckets[0]
    tokens = min(t for t in ps.token_buckets if t > 1)
    hlo = engine.step_hlo(tokens, pages)
    calls = re.findall(r'custom_call_target="raydeploy_small_matmul"', hlo)
    assert len(calls) == 2, f"{len(calls)} single native matmuls in the {tokens}-token step, want o and down"
    joined = re.findall(r'custom_call_target="raydeploy_small_matmul_multi"', hlo)
    assert len(joined) == 2, f"{len(joined)} joined native matmuls in the {tokens}-token step, want qkv and gate/up"
    # the tied LM head: the sampled rows', and the prompt logprobs' (in a branch that runs when a chunk asks)
    assert hlo.count('custom_call_target="raydeploy_small_matmul_out_first"') == 2
    d, f = engine.cfg.hidden_size, engine.cfg.intermediate_size
    weight = re.compile(rf"f32\[(1,)?({d},{f}|{f},{d})\]")
    copies = [line.strip()[:160] for line in hlo.splitlines() if "dynamic-slice" in line and weight.search(line)]
    assert not copies, f"per-layer weight slices in the step: {copies[:2]}"
    one_row = engine.step_hlo(1, pages)
    if native.isa() == "avx2":
        assert "raydeploy_small_matmul" not in one_row  # one float32 row: XLA's matrix-vector product
    else:  # the AVX-512 build takes one row too, in the unrolled program
        layers = engine.cfg.num_layers
        assert one_row.count('custom_call_target="raydeploy_small_matmul"') == 2 * layers
        assert one_row.count('custom_call_target="raydeploy_small_matmul_multi"') == 2 * layers
        assert one_row.count('custom_call_target="raydeploy_small_matmul_out_first"') == 2  # the head, twice (as above)
    # the decode rows' attention reads the pool in the native kernel, once per layer, in both programs
    assert hlo.count('custom_call_target="raydeploy_decode_attention"') == 1  # the scanned layer body
    assert one_row.count('custom_call_target="raydeploy_decode_attention"') == engine.cfg.num_layers  # unrolled

    xla = _build_engine(demo_checkpoint, {"dp": 1}, cpu_matmul="xla")
    assert xla.programs_set.native_matmul == "engine.cpu_matmul is xla"
    assert "raydeploy_small_matmul" not in xla.step_hlo(tokens, pages)
    assert "raydeploy_decode_attention" not in xla.step_hlo(tokens, pages)
    prompts = [(f"r{i}", ids, 24, None) for i, ids in enumerate(prompt_ids[:2])]
    ours, theirs = PlanDriver(engine).run(prompts), PlanDriver(xla).run(prompts)
    for name in ("r0", "r1"):
        assert ours[name]["out"] == theirs[name]["out"]
        np.testing.assert_allclose(ours[name]["logprobs"], theirs[name]["logprobs"],
                                   atol=5e-3 if native.isa() == "avx512" else 1e-4)


def test_packed_4bit_weights_serve_few_rows_with_the_float32_products(engine, unpacked, prompt_ids):
    """The demo's projections are a Q4_1 GGUF's blocks dequantized to float32, its tied table Q8_0's: where the kernel
    runs (its AVX-512 or AVX2 build) the engine also holds them packed (`engine.pack_weights: auto`), and every
    step program of few rows reads the packed copies (q/k/v joined, o, gate/up joined, down: four calls in
    the scanned layer body; the LM head), while a prompt
    chunk of more rows than the kernel takes keeps XLA's dot over the float32 weights. Greedy tokens equal the
    float32-only engine's: the same weights, from fewer bytes. Logprobs are within 1e-4 of its where the
    products are float32 (the AVX2 build: only the sums' order differs) and within 5e-3 where each block of x is
    rounded to 16 bits (the AVX-512 build, `packing.rounded_rows`; measured: at most 1.7e-3 over these 48
    tokens)."""
    from raydeploy.model import native

    ps = engine.programs_set
    if native.packs_weights() is not None:
        assert engine.packed_weights == [] and ps.pack_weights == native.packs_weights()
        return
    kernels = ["attn.k_proj.kernel", "attn.o_proj.kernel", "attn.q_proj.kernel", "attn.v_proj.kernel",
               "embed.embedding", "mlp.down_proj.kernel", "mlp.gate_proj.kernel", "mlp.up_proj.kernel"]
    assert engine.packed_weights == kernels  # the seven Q4_1 projections and the Q8_0 table (the tied head)
    assert engine.matmul == "native (8 weights packed)"
    # every packable weight of the demo packs, so the copies are the most `raydeploy plan` counts for a CPU config
    from raydeploy.config import load_config
    from raydeploy.plan import packed_bytes_max

    local = load_config(Path(__file__).resolve().parents[1] / "configs" / "local.yaml")
    assert sum(p.nbytes for p in engine._packed.values()) == packed_bytes_max(local, ps.family.param_specs(ps.cfg))
    assert unpacked.packed_weights == [] and unpacked.programs_set.pack_weights == "engine.pack_weights is off"
    assert ps.unrolled_tokens == frozenset()
    pages = ps.page_buckets[0]
    for tokens in (1, min(t for t in ps.token_buckets if t > 1)):
        hlo = engine.step_hlo(tokens, pages)
        assert hlo.count('custom_call_target="raydeploy_small_matmul_q4"') == 4, tokens
        assert hlo.count('custom_call_target="raydeploy_small_matmul"') == 0, tokens
        assert hlo.count('custom_call_target="raydeploy_small_matmul_q8"') == 2, tokens  # the tied head, twice
        assert 'custom_call_target="raydeploy_small_matmul_out_first"' not in hlo, tokens
    prompts = [(f"r{i}", ids, 24, None) for i, ids in enumerate(prompt_ids[:2])]
    ours, theirs = PlanDriver(engine).run(prompts), PlanDriver(unpacked).run(prompts)
    for name in ("r0", "r1"):
        assert ours[name]["out"] == theirs[name]["out"]
        np.testing.assert_allclose(ours[name]["logprobs"], theirs[name]["logprobs"],
                                   atol=5e-3 if native.isa() == "avx512" else 1e-4)


def test_a_float16_kv_cache_halves_the_pool_and_keeps_the_float32_caches_tokens(engine, demo_checkpoint, prompt_ids,
                                                                               alone, native_library):
    """`engine.kv_dtype: float16` (the embedded default's): the pools hold K and V in float16, half the bytes, and
    every reader widens them to float32 (the native decode-row kernel in every program, XLA's prompt path).
    Greedy tokens equal the float32 cache's (`auto`, the model's dtype) and logprobs are within 1e-2 (measured:
    at most 4.8e-3, mean 5e-4, over 3 prompts x 64 tokens; a bfloat16 cache was 3.2e-2)."""
    import jax.numpy as jnp

    half = _build_engine(demo_checkpoint, {"dp": 1}, kv_dtype="float16")
    assert engine.programs_set.kv_dtype == jnp.float32 and half.programs_set.kv_dtype == jnp.float16
    assert [p.dtype for p in half.pool] == [jnp.float16] * len(half.pool)
    assert half.pool[0].nbytes * 2 == engine.pool[0].nbytes > 0
    ps = half.programs_set
    pages = ps.page_buckets[0]
    tokens = min(t for t in ps.token_buckets if t > 1)
    hlo = half.step_hlo(tokens, pages)
    assert hlo.count('custom_call_target="raydeploy_decode_attention"') == 1
    assert "f16[" in hlo  # the pool, as the programs take it
    outs = _alone(half, prompt_ids)
    for want, got in zip(alone, outs, strict=True):
        assert got["out"] == want["out"]
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-2)


def test_keys_past_float16s_range_saturate_in_a_float16_pool():
    """A key or value past +-65504 would be inf in float16, and every score it meets NaN: it is stored as the
    largest finite value instead; other dtypes are cast as they are."""
    import jax.numpy as jnp

    from raydeploy.engine.kv_cache import F16_MAX, to_pool_dtype

    kv = jnp.asarray([[1e5, -3e5, 1.5, 65504.0, -0.25]], jnp.float32)
    got = np.asarray(to_pool_dtype(kv, jnp.float16))
    assert got.dtype == np.float16 and np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.asarray([[F16_MAX, -F16_MAX, 1.5, F16_MAX, -0.25]], np.float16))
    assert np.isinf(np.asarray(kv.astype(jnp.float16))).any()  # what a plain cast would store
    assert np.asarray(to_pool_dtype(kv, jnp.float32)).tolist() == np.asarray(kv).tolist()
    assert np.asarray(to_pool_dtype(kv, jnp.bfloat16)).dtype == jnp.bfloat16


def test_bfloat16_weights_on_an_avx512_cpu_multiply_in_the_native_kernel(demo_checkpoint, prompt_ids, native_library):
    """bfloat16 weights with float32 activations: where the kernel is built for AVX-512 the engine keeps them
    in_out and every step program, one row included, multiplies them in the kernel's bfloat16 handlers; greedy
    tokens equal and logprobs are within 1e-4 of an engine holding the same bfloat16-rounded weights as float32
    (the kernel widens each weight exactly and keeps x in float32; XLA's mixed dot would round x to bfloat16). Without AVX-512 the engine says why it keeps
    XLA's dot and holds them out_in."""
    import jax.numpy as jnp

    from raydeploy.engine.programs import ProgramShape
    from raydeploy.model import native

    # prompt chunks of 16 tokens: every step of these requests has few enough rows for the kernel (a longer chunk
    # goes to XLA's mixed dot, which rounds x to bfloat16)
    bf16 = _build_engine(demo_checkpoint, {"dp": 1}, prefill_chunk=16, param_dtype="bfloat16")
    ps = bf16.programs_set
    if native.isa() != "avx512":
        assert ps.kernel_layout == "out_in"
        assert bf16.matmul == ("xla (dtype float32, param_dtype bfloat16 (the kernel multiplies float32 "
                               "activations by float32 weights on this CPU))")
        return
    assert ps.native_matmul is None and bf16.matmul == "native" and ps.kernel_layout == "in_out"
    pages = ps.page_buckets[0]
    for tokens in (1, min(t for t in ps.token_buckets if t > 1)):
        hlo = bf16.step_hlo(tokens, pages)
        layers = bf16.cfg.num_layers if ps.unrolled(ProgramShape("step", tokens, pages)) else 1
        assert hlo.count('custom_call_target="raydeploy_small_matmul_bf16"') == 2 * layers, tokens  # o, down
        assert hlo.count('custom_call_target="raydeploy_small_matmul_multi_bf16"') == 2 * layers, tokens
        assert hlo.count('custom_call_target="raydeploy_small_matmul_out_first_bf16"') == 2, tokens  # head, twice
    rounded = _build_engine(demo_checkpoint, {"dp": 1}, prefill_chunk=16, param_dtype="bfloat16",
                            params_as=jnp.float32)
    assert rounded.matmul == "native"
    prompts = [(f"r{i}", ids, 24, None) for i, ids in enumerate(prompt_ids[:2])]
    ours, theirs = PlanDriver(bf16).run(prompts), PlanDriver(rounded).run(prompts)
    for name in ("r0", "r1"):
        assert ours[name]["out"] == theirs[name]["out"]
        np.testing.assert_allclose(ours[name]["logprobs"], theirs[name]["logprobs"],
                                   atol=5e-3 if native.isa() == "avx512" else 1e-4)


def test_the_native_kernel_stays_off_where_weights_are_split_or_not_float32(demo_checkpoint):
    """It multiplies replicated weights only: a mesh that splits them keeps XLA's dot, and the engine says why."""
    tp = _build_engine(demo_checkpoint, {"dp": 1, "tp": 2})
    assert tp.matmul == "xla (the mesh splits weights over {'tp': 2} (the kernel needs them replicated))"


def test_dp2_prefills_on_the_owning_group_and_matches_transformers(engine, demo_checkpoint, prompt_ids, reference):
    """dp=2: each group prefills and samples its own slots; greedy tokens match transformers, and a sampled
    request with a repetition penalty (its slot's set of seen tokens lives on its group) draws the tokens it
    draws on one device. The step programs move nothing between the groups (no logits, no repetition-penalty
    sets, no scatter indices, not even the rows' results): one gather per plan brings the passes' packed results
    together."""
    from raydeploy.compile import collectives
    from raydeploy.engine.step import SamplingParams

    dp = _build_engine(demo_checkpoint, {"dp": 2})
    assert dp.groups == 2 and dp.slot_order == [0, 2, 1, 3]
    assert dp.pool[0].sharding.spec[1] == "dp"
    for tokens in (1, 2, 16):
        found, _ = collectives(dp.step_hlo(tokens, dp.programs_set.page_buckets[0]))
        assert found == {}, f"step of {tokens} tokens: collectives {found}"
        rows = dp.groups * dp.programs_set.rows_for(tokens)
        found, _ = collectives(dp._gather_exe(dp.decode_steps, rows).as_text())
        summary = {kind: (c.count, sorted(c.shapes)) for kind, c in found.items()}
        assert summary == {"all-gather": (1, [f"f32[{dp.decode_steps},2,{rows}]"])}, f"gather of {rows}: {summary}"
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.3, seed=99)
    results = PlanDriver(dp).run([(f"r{i}", ids, NEW_TOKENS, None) for i, ids in enumerate(prompt_ids)]
                                 + [("s", prompt_ids[2], NEW_TOKENS, sampled)], stagger=[0, 2, 5, 6])
    _check_reference([results[f"r{i}"] for i in range(3)], reference)
    one_device = _alone(engine, [prompt_ids[2]], [sampled])[0]
    assert results["s"]["out"] == one_device["out"]
    assert len(set(results["s"]["out"])) > 10  # it really sampled a varied continuation


def test_staggered_arrivals_give_the_tokens_of_each_request_alone(engine, prompt_ids, alone):
    from raydeploy.engine.step import SamplingParams

    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.1, seed=1234)
    sampled_alone = _alone(engine, [prompt_ids[2]], [sampled])[0]
    # chunks of 16 tokens: prompts prefill over several steps, beside the running decode rows
    got = PlanDriver(engine, chunk=16).run(
        [("a", prompt_ids[0], NEW_TOKENS, None), ("b", prompt_ids[1], NEW_TOKENS, None),
         ("c", prompt_ids[2], NEW_TOKENS, sampled)], stagger=[0, 5, 11])
    assert got["a"]["out"] == alone[0]["out"]
    assert got["b"]["out"] == alone[1]["out"]
    assert got["c"]["out"] == sampled_alone["out"]
    assert len(set(got["c"]["out"])) > 10  # it really sampled a varied continuation


def test_prefix_reuse_gives_the_tokens_of_a_whole_prefill(engine, prompt_ids):
    from raydeploy.engine.step import SamplingParams

    penalised = SamplingParams(repetition_penalty=1.3)  # the reused prefix counts in the penalty set
    system = prompt_ids[1][:-3]
    first = system + prompt_ids[1][-3:]
    second = system + [int(t) for t in prompt_ids[0][-5:]]
    whole = _alone(engine, [second], [penalised])[0]["out"]
    d = PlanDriver(engine)
    a = d.add("a", first, 60)  # long enough to be running when b starts
    d.on_result(p := d.plan(), engine.step(p))
    d.add("b", second, NEW_TOKENS, penalised, share_from=a)
    assert d.live[a]["pages"][:2] == d.live[next(s for s in d.live if s != a)]["pages"][:2]
    got = {}
    while d.live:
        plan = d.plan()
        got.update(d.on_result(plan, engine.step(plan)))
    assert got["b"]["out"] == whole


def test_chunked_prefill_of_a_long_prompt_equals_one_chunk(demo_checkpoint, demo_hf):
    _, tok = demo_hf
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(150))
    ids = [int(i) for i in tok(text)["input_ids"]][:1500]
    assert len(ids) == 1500
    long = _build_engine(demo_checkpoint, {"dp": 1}, max_seq_len=1536, max_slots=2, prefill_chunk=1504)
    whole = PlanDriver(long).run([("w", ids, 16, None)])["w"]
    chunked = PlanDriver(long, chunk=256).run([("c", ids, 16, None)])["c"]
    assert chunked["out"] == whole["out"]
    assert np.allclose(chunked["logprobs"], whole["logprobs"], atol=1e-3)


def test_bad_plans_are_refused_naming_the_slot(engine):
    from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan

    def plan(*seqs, pages=(), steps=1):
        return StepPlan(99, seqs=tuple(seqs), pages=tuple(pages), decode_steps=steps)

    with pytest.raises(ValueError, match="slot 3 decodes but no request was started in it"):
        engine.step(plan(SeqStep(3, np.zeros(0, np.int32), 5, True)))
    with pytest.raises(ValueError, match="slot 9 is out of range"):
        engine.step(plan(SeqStep(9, np.ones(4, np.int32), 0, True, SamplingParams())))
    with pytest.raises(ValueError, match="page ids 0..9999 are outside its dp group's pool"):
        engine.step(plan(pages=[PageUpdate(1, 0, np.asarray([0, 9999], np.int32))]))
    with pytest.raises(ValueError, match="dp group 0 has 100 tokens in one step, more than engine.prefill_chunk"):
        engine.step(plan(SeqStep(0, np.ones(100, np.int32), 0, True, SamplingParams())))
    with pytest.raises(ValueError, match="decode_steps 2 > 1 with a prompt chunk in slot 0"):
        engine.step(plan(SeqStep(0, np.ones(4, np.int32), 0, True, SamplingParams()), steps=2))
    with pytest.raises(ValueError, match="slot 0 has more than one sequence"):
        engine.step(plan(SeqStep(0, np.ones(4, np.int32), 0, False, SamplingParams()),
                         SeqStep(0, np.ones(4, np.int32), 4, True)))


def test_plan_bytes_round_trip():
    from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan

    plan = StepPlan(7, seqs=(SeqStep(1, np.arange(5, dtype=np.int32), 16, True, SamplingParams(0.5, 0.9, 4, 1.1, 3),
                                     np.arange(16, dtype=np.int32)),
                             SeqStep(2, np.zeros(0, np.int32), 40, True)),
                    pages=(PageUpdate(1, 1, np.asarray([4, 5], np.int32)),), release=(3,), decode_steps=1)
    back = StepPlan.from_bytes(plan.to_bytes())
    assert back.step_id == 7 and back.release == (3,)
    assert [(q.slot, q.tokens.tolist(), q.start, q.sample, q.sampling) for q in back.seqs] == [
        (1, [0, 1, 2, 3, 4], 16, True, SamplingParams(0.5, 0.9, 4, 1.1, 3)), (2, [], 40, True, None)]
    assert back.seqs[0].prefix_tokens.tolist() == list(range(16)) and back.seqs[1].prefix_tokens is None
    assert [(u.slot, u.first, u.pages.tolist()) for u in back.pages] == [(1, 1, [4, 5])]

