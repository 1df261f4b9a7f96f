"""Device layouts of the model that must not change its numbers: the out_in kernel layout (kernels transposed
at load) and the head-major KV cache, on a tiny random model, one device and a (dp=2, tp=2) mesh.

Fast: one process, the 4 virtual CPU devices of conftest, a 2-layer model with every kind of kernel (q/k/v
with bias, o_proj, MLP, untied LM head).
"""

from __future__ import annotations

import numpy as np
import pytest

from raydeploy.model.spec import (
    LlamaConfig,
    is_kernel,
    kernel_input_dims,
    out_in_spec,
    param_specs,
    stacked_param_specs,
)

TINY = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, attention_bias=True, tie_word_embeddings=False,
                   eos_token_ids=(1,))


def _random_params(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(spec.shape) * 0.2).astype(np.float32)
            for name, spec in param_specs(cfg).items()}


def _mesh(shape: dict[str, int]):
    import jax

    from raydeploy.model.sharding import build_mesh

    n = int(np.prod(list(shape.values())))
    return build_mesh(shape, jax.devices()[:n])


def _placed(params, mesh, rules):
    import jax
    from jax.sharding import NamedSharding

    from raydeploy.model.sharding import partition_spec

    specs = param_specs(TINY)
    return {n: jax.device_put(a, NamedSharding(mesh, partition_spec(specs[n].logical_axes, rules,
                                                                     dict(mesh.shape), n)))
            for n, a in params.items()}


def test_out_in_spec_moves_input_dims_last_with_their_axes():
    specs = param_specs(TINY)
    q = out_in_spec(specs["layers.0.attn.q_proj.kernel"])
    assert q.shape == (4, 8, 32) and q.logical_axes == ("q_heads", "head_dim", "embed")
    o = out_in_spec(specs["layers.0.attn.o_proj.kernel"])
    assert kernel_input_dims("layers.0.attn.o_proj.kernel") == 2
    assert o.shape == (32, 4, 8) and o.logical_axes == ("embed", "q_heads", "head_dim")
    assert out_in_spec(specs["lm_head.kernel"]).shape == (96, 32)
    assert out_in_spec(specs["embed.embedding"]) == specs["embed.embedding"]
    assert sum(is_kernel(n) for n in specs) == 2 * 7 + 1


@pytest.mark.parametrize("mesh_shape,rules", [
    ({"dp": 1}, {}),
    ({"dp": 2, "tp": 2}, {}),  # heads, MLP and vocab over tp
])
def test_out_in_kernels_give_the_same_logits(mesh_shape, rules):
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp

    from raydeploy.model.llama import ActivationSharding, build_model, engine_param_specs, stack_layers
    from raydeploy.model.sharding import merge_rules

    mesh = _mesh(mesh_shape)
    rules = merge_rules(rules)
    params = _placed(_random_params(TINY), mesh, rules)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 8)), jnp.int32)
    shard = ActivationSharding.create(mesh, rules)

    def logits(layout):
        p = stack_layers(TINY, params, layout, mesh, rules)
        graphdef, state = build_model(TINY, p, kernel_layout=layout)
        stacked = stacked_param_specs(TINY)
        assert set(p) == set(stacked) == set(engine_param_specs(TINY, layout))
        for name, arr in p.items():  # out_in kernels keep their logical axes' shardings
            want = out_in_spec(stacked[name]) if layout == "out_in" else stacked[name]
            assert arr.shape == want.shape, name
            assert arr.shape[0] == TINY.num_layers or not name.startswith("layers."), name
        return jax.jit(lambda st, t: nnx.merge(graphdef, st).logits(
            nnx.merge(graphdef, st).prefill(t, jnp.broadcast_to(jnp.arange(8), (2, 8)), shard)[0][:, -1], shard))(
            state, tokens)

    ref, got = np.asarray(logits("in_out")), np.asarray(logits("out_in"))
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_stacked_checkpoint_params_give_the_engine_the_same_params(layout):
    """A checkpoint stored stacked over the layers is read as `stacked_param_specs` and handed to the engine
    as it is (in_out: the loaded arrays themselves; out_in: transposed only): the same arrays and shardings as
    stacking a per-layer checkpoint's."""
    import jax
    from jax.sharding import NamedSharding

    from raydeploy.model.registry import LLAMA
    from raydeploy.model.sharding import merge_rules, partition_spec

    mesh, rules = _mesh({"fsdp": 2, "tp": 2}), merge_rules({"q_heads": None, "kv_heads": None})
    per_layer = _placed(_random_params(TINY, 3), mesh, rules)
    specs = stacked_param_specs(TINY)
    assert LLAMA.checkpoint_specs(TINY, per_layer) == param_specs(TINY)
    assert LLAMA.checkpoint_specs(TINY, specs) == specs
    stacked = {n: jax.device_put(np.stack([np.asarray(per_layer[f"layers.{i}.{n[len('layers.'):]}"])
                                           for i in range(TINY.num_layers)]) if n.startswith("layers.")
                                 else np.asarray(per_layer[n]),
                                 NamedSharding(mesh, partition_spec(s.logical_axes, rules, dict(mesh.shape), n)))
               for n, s in specs.items()}
    want = LLAMA.stack_layers(TINY, per_layer, layout, mesh, rules)
    got = LLAMA.stack_layers(TINY, stacked, layout, mesh, rules)
    assert set(got) == set(want) == set(specs)
    for n in want:
        assert got[n].sharding == want[n].sharding, n
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]), err_msg=n)
        if layout == "in_out":
            assert got[n] is stacked[n], n  # no copy: the loaded array is the engine's
    with pytest.raises(ValueError, match=r"params do not match the model: missing 1 tensor\(s\), e\.g\. "
                                         r"layers\.mlp\.up_proj\.kernel"):
        LLAMA.stack_layers(TINY, {k: v for k, v in stacked.items() if k != "layers.mlp.up_proj.kernel"}, layout)


def _paged_engine(mesh_shape, rules_overrides, **engine_kw):
    from raydeploy.config import EngineConfig, ModelConfig
    from raydeploy.engine.engine import Engine as PagedEngine
    from raydeploy.model.sharding import merge_rules

    mesh = _mesh(mesh_shape)
    rules = merge_rules(rules_overrides)
    kw = {"max_slots": 4, "max_new_tokens": 16, "page_size": 4, "prefill_chunk": 8,
          "decode_steps": 3, **engine_kw}
    from raydeploy.model.registry import LLAMA

    return PagedEngine(LLAMA, TINY, _placed(_random_params(TINY, 2), mesh, rules), mesh, rules,
                       ModelConfig(max_seq_len=64), EngineConfig(**kw))


def _plain_greedy(engine, prompt, n):
    """Greedy tokens and their logprobs from the plain causal forward (no cache), one full forward per token."""
    import jax
    import jax.numpy as jnp

    forward = jax.jit(lambda leaves, t: engine.programs_set.model(leaves)(t))
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = np.asarray(forward(engine._param_leaves, jnp.asarray([ids], jnp.int32)))[0, -1]
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))
        ids.append(int(lp.argmax()))
        lps.append(float(lp.max()))
    return ids[len(prompt):], lps


@pytest.mark.parametrize("mesh_shape,rules,engine_kw", [
    ({"dp": 1}, {}, {}),
    # kernels held out_in (transposed once at load; the model reads them as in_out through `OutIn` views), XLA's dot
    ({"dp": 1}, {}, {"kernel_layout": "out_in", "cpu_matmul": "xla"}),
    ({"dp": 2, "tp": 2}, {}, {}),  # slots and pages over dp, kv heads over tp inside the shard_map
    ({"fsdp": 2, "tp": 2}, {"q_heads": None, "kv_heads": None, "cache_kv_heads": None}, {}),
])
def test_ragged_paged_steps_equal_the_plain_forward(mesh_shape, rules, engine_kw):
    """Prompts prefilled in chunks (pages of 4 tokens, chunks of up to 8 tokens per dp group, two prompts
    sharing a step), then decoded several steps per plan: every greedy token and logprob equals the plain
    causal forward's, whatever the mesh and the kernels' layout."""
    from raydeploy.engine.step import PageUpdate, SamplingParams, SeqStep, StepPlan

    eng = _paged_engine(mesh_shape, rules, **engine_kw)
    assert eng.programs_set.kernel_layout == engine_kw.get("kernel_layout", "in_out")
    if "dp" in mesh_shape and mesh_shape["dp"] == 2:
        assert eng.groups == 2 and eng.pool[0].sharding.spec[1] == "dp" and eng.pool[0].sharding.spec[3] == "tp"
    rng = np.random.default_rng(4)
    prompts = {0: rng.integers(0, TINY.vocab_size, 10).tolist(), 1: rng.integers(0, TINY.vocab_size, 6).tolist()}
    want = {s: _plain_greedy(eng, p, 7) for s, p in prompts.items()}
    g = eng.slots_per_group
    pages = {0: [0, 1, 2, 3, 4], 1: [5, 6, 7, 8]} if eng.groups == 1 else {0: [0, 1, 2, 3, 4], 1: [4, 3, 2, 1]}
    slots = {0: 0, 1: 1 if eng.groups == 1 else g}  # with dp=2 the second request lives in the other group
    upd = tuple(PageUpdate(slots[r], 0, np.asarray(pages[r], np.int32)) for r in (0, 1))
    sp = SamplingParams()
    got = {0: [], 1: []}
    lps = {0: [], 1: []}
    # step 1: prompt 0 chunk [0, 5) and prompt 1 chunk [0, 3); step 2: prompt 0 [5, 10), prompt 1 [3, 6)
    p1 = StepPlan(0, seqs=(SeqStep(slots[0], np.asarray(prompts[0][:5], np.int32), 0, False, sp),
                           SeqStep(slots[1], np.asarray(prompts[1][:3], np.int32), 0, False, sp)), pages=upd)
    p2 = StepPlan(1, seqs=(SeqStep(slots[0], np.asarray(prompts[0][5:], np.int32), 5, True),
                           SeqStep(slots[1], np.asarray(prompts[1][3:], np.int32), 3, True)))
    for plan in (p1, p2):
        res = eng.step(plan)
        assert res.tokens.shape == (1, 2)
    for r in (0, 1):
        got[r].append(int(res.tokens[0, r]))
        lps[r].append(float(res.logprobs[0, r]))
    for step_id, steps in ((2, 3), (3, 3)):  # decode rows, 3 steps per plan without a host round trip
        plan = StepPlan(step_id, seqs=tuple(SeqStep(slots[r], np.zeros(0, np.int32),
                                                    len(prompts[r]) + len(got[r]) - 1, True) for r in (0, 1)),
                        decode_steps=steps)
        res = eng.step(plan)
        for r in (0, 1):
            got[r] += res.tokens[:, r].tolist()
            lps[r] += res.logprobs[:, r].tolist()
    for r in (0, 1):
        assert got[r] == want[r][0], f"request {r}"
        np.testing.assert_allclose(lps[r], want[r][1], rtol=0, atol=2e-5)


def test_fixed_page_plans_give_the_scheduled_paged_tokens():
    """A prompt prefilled in chunks on a fixed run of pages, then decoded in one plan (`prefill_and_decode`, what
    engine checks and benchmarks use without a scheduler) gives the plain forward's greedy tokens."""
    from raydeploy.engine.step import SamplingParams
    from raydeploy.testing.plans import prefill_and_decode

    eng = _paged_engine({"dp": 1}, {})
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, TINY.vocab_size, 11).tolist()  # longer than a step's 8 tokens: two chunks
    want, _ = _plain_greedy(eng, prompt, 5)
    toks, _ = prefill_and_decode(eng, [(2, prompt, SamplingParams())], 4)
    assert toks[:, 0].tolist() == want


def test_unknown_kernel_layout_is_named():
    from raydeploy.model.llama import abstract_model

    with pytest.raises(ValueError, match="kernel_layout must be one of in_out, out_in, got 'columns'"):
        abstract_model(TINY, kernel_layout="columns")


def test_auto_layout_is_out_in_only_for_bfloat16_on_cpu():
    from raydeploy.engine.programs import resolve_kernel_layout

    assert resolve_kernel_layout("auto", "bfloat16", "cpu") == "out_in"
    assert resolve_kernel_layout("auto", "float32", "cpu") == "in_out"
    assert resolve_kernel_layout("auto", "bfloat16", "tpu") == "in_out"
    assert resolve_kernel_layout("in_out", "bfloat16", "cpu") == "in_out"
    # where the native CPU kernel multiplies bfloat16 weights (AVX-512 build), it reads them in_out
    assert resolve_kernel_layout("auto", "bfloat16", "cpu", ("float32", "bfloat16")) == "in_out"
    assert resolve_kernel_layout("auto", "bfloat16", "cpu", ("float32",)) == "out_in"


@pytest.mark.parametrize("mesh_shape", [{"dp": 1}, {"dp": 2, "tp": 2}])
def test_the_step_updates_the_kv_pool_in_place(mesh_shape):
    """Every step program writes the layer's new K/V into the carried pool without copying the pool: a copy
    per layer costs the whole cache's bytes every layer (one decode row once made XLA copy it 3 times per
    layer; 40x slower steps on the demo model)."""
    from raydeploy.engine.programs import ProgramShape

    engine = _paged_engine(mesh_shape, {})
    ps = engine.programs_set
    pool_elems = int(np.prod(ps.pool_shapes[0])) // ps.mesh.size * (ps.mesh.size // ps.groups)
    for tokens in ps.token_buckets:
        text = ps.lower(ProgramShape("step", tokens, ps.page_buckets[-1])).compile().as_text()
        copies = []
        for line in text.splitlines():
            if "= f32[" not in line or " copy(" not in line:
                continue
            dims = line.split("= f32[", 1)[1].split("]", 1)[0]
            if int(np.prod([int(d) for d in dims.split(",") if d])) >= pool_elems // 2:
                copies.append(line.strip()[:160])
        assert not copies, f"step_{tokens}: the pool is copied:\n" + "\n".join(copies)
