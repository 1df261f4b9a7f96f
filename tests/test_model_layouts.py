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


@pytest.mark.parametrize("mesh_shape", [{"dp": 1}, {"dp": 2, "tp": 2}])
def test_decode_over_the_head_major_cache_equals_prefill(mesh_shape):
    """Prefill 7 tokens into a [layers, slots, kv_heads, seq, head_dim] cache, decode the 8th: its hidden state
    equals the 8-token prefill's last position (cache writes, window reads and decode attention agree)."""
    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from raydeploy.engine.kv_slots import kv_cache_sharding
    from raydeploy.model.llama import ActivationSharding, build_model
    from raydeploy.model.sharding import merge_rules

    mesh = _mesh(mesh_shape)
    rules = merge_rules({"q_heads": None, "kv_heads": None, "cache_kv_heads": None})
    shard = ActivationSharding.create(mesh, rules)
    graphdef, state = build_model(TINY, _placed(_random_params(TINY, 2), mesh, rules))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, TINY.vocab_size, (2, 8)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    seq = 16
    cache_sharding = kv_cache_sharding(TINY, 2, seq, mesh, rules)

    def run(st, t):
        model = nnx.merge(graphdef, st)
        full, _, _ = model.prefill(t, pos, shard)
        _, ks, vs = model.prefill(t[:, :7], pos[:, :7], shard)
        pad = ((0, 0), (0, 0), (0, 0), (0, seq - 7), (0, 0))
        kc = jax.lax.with_sharding_constraint(jnp.pad(ks, pad), cache_sharding)
        vc = jax.lax.with_sharding_constraint(jnp.pad(vs, pad), cache_sharding)
        h, kc, vc = model.decode(t[:, 7], jnp.full((2,), 7), kc, vc, seq, shard)
        return full[:, 7], h, kc

    full, h, k0 = jax.jit(run)(state, tokens)
    assert k0.shape == (TINY.num_layers, 2, TINY.num_kv_heads, seq, TINY.head_dim)
    assert isinstance(k0.sharding, NamedSharding)
    assert np.abs(np.asarray(k0)[:, :, :, 7]).max() > 0  # the decoded token's K was written at position 7
    np.testing.assert_allclose(np.asarray(h), np.asarray(full), rtol=0, atol=2e-5)


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
