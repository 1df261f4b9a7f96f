"""Model families against transformers: each family built tiny with random weights by transformers itself
(`AutoModelForCausalLM.from_config`, fixed seed, no download), saved with `save_pretrained`, converted through
our safetensors converter, loaded through the checkpoint reader and compared in float32:
- last-position logits within 1e-3 of transformers;
- 32 greedy tokens identical (the family module's own forward over a fixed-length padded window, and the
  engine's ragged path `ragged` with the real xla attention backend over a paged cache);
- the same on a mesh with tp=2 (parameters placed by their logical axes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from raydeploy.checkpoint.convert import convert  # noqa: E402
from raydeploy.checkpoint.format import CheckpointError  # noqa: E402
from raydeploy.checkpoint.reader import CheckpointReader  # noqa: E402
from raydeploy.model.registry import Family, UnknownModelType, family_for, from_hf_config  # noqa: E402

STEPS = 32
PROMPT = [3, 17, 42, 5, 99, 7, 64, 1, 23, 11]

TINY: dict[str, dict[str, Any]] = {
    "qwen3": dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2),
    # local layers (window 4, far shorter than the 42 tokens decoded) alternate with global ones; local and
    # global RoPE differ; query_pre_attn_scalar != head_dim; final logits soft-capped.
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=128, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=256, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                        query_pre_attn_scalar=24, final_logit_softcapping=3.0, tie_word_embeddings=True,
                        initializer_range=0.2),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2),
    "mixtral": dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                    initializer_range=0.2),
}
MOE = ("qwen3_moe", "mixtral")


def _hf_model(kind: str, tmp: Path) -> tuple[Any, Path]:
    """A tiny transformers model of `kind` with seeded random weights, saved under tmp/hf-<kind>."""
    from hf_reference import tiny_hf_model

    src = tmp / f"hf-{kind}"
    return tiny_hf_model(TINY[kind], src), src


@pytest.fixture(scope="module", params=sorted(TINY))
def family_case(request, tmp_path_factory) -> dict[str, Any]:
    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    model, src = _hf_model(kind, tmp)
    dst = tmp / "ckpt"
    convert(src, dst, progress=False)
    reader = CheckpointReader(dst)
    fam, cfg = from_hf_config(reader.hf_config)
    params = {n: reader.read_tensor(n) for n in fam.param_specs(cfg)}
    return {"kind": kind, "hf": model, "family": fam, "cfg": cfg, "params": params, "src": src,
            "greedy": _hf_greedy(model, PROMPT, STEPS)}


def _hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _hf_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(_hf_logits(model, ids)[-1])))
    return ids[len(prompt):]


def _forward_fn(graphdef: Any) -> Any:
    import flax.nnx as nnx

    @jax.jit
    def fwd(state: Any, tokens: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(tokens)

    return fwd


def _greedy_window(fwd: Any, state: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by the module's causal forward over one fixed-length window (padding after the live
    tokens cannot reach them through causal attention): one compiled program for every step."""
    n = len(prompt) + steps
    ids = np.zeros((1, n), np.int32)
    ids[0, : len(prompt)] = prompt
    for t in range(len(prompt), n):
        logits = np.asarray(fwd(state, jnp.asarray(ids)))
        ids[0, t] = int(np.argmax(logits[0, t - 1]))
    return ids[0, len(prompt):].tolist()


def _place(fam: Family, cfg: Any, state: Any, mesh: Any) -> Any:
    """Put every parameter of `state` on `mesh` by its logical axes (default rules)."""
    import flax.nnx as nnx
    from jax.sharding import NamedSharding

    from raydeploy.model.sharding import merge_rules, partition_spec

    specs = fam.stacked_param_specs(cfg)
    rules, shape = {**merge_rules(None), **fam.rules}, dict(mesh.shape)
    fam.check_mesh(cfg, shape)
    items = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        sharding = NamedSharding(mesh, partition_spec(specs[name].logical_axes, rules, shape, name))
        items.append((path, var.replace(jax.device_put(var.get_value(), sharding))))
    return nnx.from_flat_state(items)


def test_logits_and_greedy_match_transformers(family_case):
    fam, cfg, hf = family_case["family"], family_case["cfg"], family_case["hf"]
    graphdef, state = fam.build_model(cfg, family_case["params"])
    fwd = _forward_fn(graphdef)
    ours = np.asarray(fwd(state, jnp.asarray([PROMPT], jnp.int32)))[0]
    ref = _hf_logits(hf, PROMPT)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours[-1], ref[-1], atol=1e-3, rtol=0)
    assert np.abs(ref[-1]).max() > 0.1  # the comparison is not between two near-zero vectors
    assert _greedy_window(fwd, state, PROMPT, STEPS) == family_case["greedy"]


def test_tp_mesh_matches_transformers(family_case):
    """tp=2 (and for the MoE families ep=2 x tp=2: experts split over ep, each expert's units over tp)."""
    import flax.nnx as nnx

    from raydeploy.model.sharding import build_mesh

    fam, cfg, hf = family_case["family"], family_case["cfg"], family_case["hf"]
    moe = family_case["kind"] in MOE
    mesh = (build_mesh({"ep": 2, "tp": 2}) if moe else build_mesh({"dp": 1, "fsdp": 1, "tp": 2, "sp": 1},
                                                                   jax.devices()[:2]))
    graphdef, state = fam.build_model(cfg, family_case["params"])
    state = _place(fam, cfg, state, mesh)
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    q = flat["layers.attn.q_proj.kernel"]  # [L, D, heads, head_dim]: heads really split over tp
    assert q.sharding.shard_shape(q.shape)[2] == cfg.num_heads // 2
    if moe:
        gate = flat["layers.mlp.experts.gate_proj.kernel"]  # [L, E, D, F]: E over ep, F over tp
        assert gate.sharding.shard_shape(gate.shape) == (cfg.num_layers, cfg.num_experts // 2, cfg.hidden_size,
                                                         cfg.moe_intermediate_size // 2)
    fwd = _forward_fn(graphdef)
    with jax.set_mesh(mesh):  # traced under the mesh: the MoE block takes its expert-parallel form
        if moe:  # experts computed per ep shard in shard_map, the parts added by a psum (no weight gathered)
            text = fwd.lower(state, jnp.asarray([PROMPT], jnp.int32)).as_text()
            assert "manual_computation" in text and '"ep"' in text
        ours = np.asarray(fwd(state, jnp.asarray([PROMPT], jnp.int32)))[0]
        np.testing.assert_allclose(ours[-1], _hf_logits(hf, PROMPT)[-1], atol=1e-3, rtol=0)
        assert _greedy_window(fwd, state, PROMPT, STEPS) == family_case["greedy"]


def _ragged_greedy(fam: Family, cfg: Any, graphdef: Any, state: Any, prompt: list[int], steps: int,
                   page_size: int = 4) -> list[int]:
    """Greedy decoding through the module's `ragged` path, as the engine runs it: a prefill of the whole
    prompt, then one token per step, K/V written into a paged pool [L, P, page_size, 2*Hkv, D] and attention
    by the engine's xla backend (`ragged_paged_attention`)."""
    import flax.nnx as nnx

    from raydeploy.engine.attention import get_backend

    attn = get_backend("xla", "cpu")
    total = len(prompt) + steps
    pages = -(-total // page_size)
    pool = jnp.zeros((cfg.num_layers, pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    page_indices = jnp.arange(pages, dtype=jnp.int32)[None]
    scale = getattr(cfg, "attn_scale", None) or cfg.head_dim ** -0.5

    @jax.jit
    def step(state: Any, pool: jax.Array, tokens: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)
        n = tokens.shape[0]
        positions = start + jnp.arange(n, dtype=jnp.int32)
        kv_lens = (start + n)[None].astype(jnp.int32)
        cu = jnp.asarray([0, n], jnp.int32)

        def attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, c: jax.Array, **kw: Any
                   ) -> tuple[jax.Array, jax.Array]:
            kv = jnp.stack([k, v], axis=2).reshape(n, 2 * k.shape[1], k.shape[2])  # k0, v0, k1, v1, ...
            flat = c[layer].reshape(pages * page_size, *kv.shape[1:])
            flat = flat.at[positions].set(kv.astype(flat.dtype))
            c = c.at[layer].set(flat.reshape(c.shape[1:]))
            local = kw.pop("local", None)
            args = (q, c[layer], kv_lens, page_indices, cu, jnp.asarray([1], jnp.int32))
            if local is None:
                return attn(*args, sm_scale=scale, **kw), c
            window = kw.pop("sliding_window")  # a traced layer kind: the window applies where `local` holds
            out = jax.lax.cond(local, lambda: attn(*args, sm_scale=scale, sliding_window=window, **kw),
                               lambda: attn(*args, sm_scale=scale, **kw))
            return out, c

        h, _, _, pool = model.ragged(tokens, positions, attend, cache=pool)
        return jnp.argmax(model.logits(h[-1:])[0]).astype(jnp.int32), pool

    out: list[int] = []
    tok, pool = step(state, pool, jnp.asarray(prompt, jnp.int32), jnp.int32(0))
    out.append(int(tok))
    for i in range(steps - 1):
        tok, pool = step(state, pool, tok[None], jnp.int32(len(prompt) + i))
        out.append(int(tok))
    return out


def test_ragged_paged_path_greedy_matches_transformers(family_case):
    fam, cfg = family_case["family"], family_case["cfg"]
    graphdef, state = fam.build_model(cfg, family_case["params"])
    assert _ragged_greedy(fam, cfg, graphdef, state, PROMPT, STEPS) == family_case["greedy"]


# -- registry and converter errors ----------------------------------------------------------------------------


def test_unknown_model_type_lists_supported(tmp_path):
    with pytest.raises(UnknownModelType, match=r"model_type 'mamba' is not supported \(supported: .*llama.*qwen3"):
        family_for("mamba")
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    (src / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model_type 'mamba' is not supported \(supported: .*qwen3"):
        convert(src, tmp_path / "out", progress=False)


def test_registry_specs_match_module_state():
    """Every family's stacked specs are exactly its module's NNX state (names and shapes)."""
    import flax.nnx as nnx

    for kind, raw in TINY.items():
        fam, cfg = from_hf_config(raw)
        model = nnx.eval_shape(lambda fam=fam, cfg=cfg: fam.module(cfg))
        got = {".".join(map(str, p)): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(model))}
        assert got == {n: s.shape for n, s in fam.stacked_param_specs(cfg).items()}, kind
        assert fam.param_count(cfg) == sum(int(np.prod(s)) for s in got.values())


def test_family_tensors_are_inserted_after_their_anchor_in_every_layer():
    """Families build on Llama's list: each added tensor sits right after its anchor, in every layer, and only there."""
    from raydeploy.model.spec import TensorSpec, with_layer_tensors

    base = {n: TensorSpec(n, (2,), ("norm",)) for n in
            ["embed.embedding", "layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b", "final_norm.scale"]}
    got = with_layer_tensors(base, {"a": [("x", (3,), ("norm",)), ("y", (4,), ("norm",))], "c": [("z", (1,), ("n",))]})
    assert list(got) == ["embed.embedding", "layers.0.a", "layers.0.x", "layers.0.y", "layers.0.b",
                         "layers.1.a", "layers.1.x", "layers.1.y", "layers.1.b", "final_norm.scale"]
    assert got["layers.1.y"] == TensorSpec("layers.1.y", (4,), ("norm",))


def test_missing_tensor_is_named(family_case, tmp_path):
    """A source checkpoint that lacks one of the family's tensors: the converter names it."""
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "cut"
    src.mkdir()
    for f in family_case["src"].iterdir():
        if f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(family_case["src"] / "model.safetensors")
    if family_case["kind"] in MOE:  # one expert's tensor: named in the source's own naming
        victim = next(n for n in sorted(tensors) if ".layers.1." in n and ".experts.2." in n)
        del tensors[victim]
        save_file(tensors, src / "model.safetensors")
        with pytest.raises(CheckpointError, match=r"source lacks expert tensor\(s\) of layers\.1\.mlp\.experts\."
                                                  r"\w+\.kernel: experts \[2\] of 4 are missing, e\.g\. "
                                                  + victim.replace(".", r"\.")):
            convert(src, tmp_path / "out", progress=False)
        return
    victim = next(n for n in sorted(tensors) if "layers.1.mlp" in n)
    del tensors[victim]
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"source lacks tensors the model needs: layers\.1\.mlp\."):
        convert(src, tmp_path / "out", progress=False)


@pytest.mark.parametrize("kind", MOE)
def test_ep_must_divide_experts(kind):
    fam, cfg = from_hf_config(TINY[kind])
    fam.check_mesh(cfg, {"ep": 2, "tp": 2})
    with pytest.raises(ValueError, match=r"mesh axis ep=3 does not divide the model's 4 experts"):
        fam.check_mesh(cfg, {"ep": 3})


def _expert_ffn_numpy(x, ids, w, gate, up, down) -> np.ndarray:
    x, gate, up, down = (np.asarray(v, np.float64) for v in (x, gate, up, down))
    ref = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g = int(ids[t, j])
            h = x[t] @ gate[g]
            ref[t] += float(w[t, j]) * ((h / (1 + np.exp(-h)) * (x[t] @ up[g])) @ down[g])
    return ref


def test_expert_ffn_methods_agree():
    """The CPU tiled grouped matmul and ragged_dot (the TPU/GPU kernels' form) compute the same experts as
    numpy, at batch sizes whose tiles hold 1 to 64 rows (an expert's rows spread over several tiles), alone
    and split over ep=2 x tp=2."""
    from raydeploy.model.moe import expert_ffn, expert_ffn_ep, route, tile_rows
    from raydeploy.model.sharding import build_mesh

    rng = np.random.default_rng(0)
    d, f, e, k = 16, 8, 6, 2
    gate, up = (jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)
    mesh = build_mesh({"ep": 2, "tp": 2})
    assert [tile_rows(n * k, e) for n in (1, 3, 12, 100)] == [1, 2, 8, 64]
    for n in (1, 3, 12, 100):
        x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
        w, ids = route(jnp.asarray(rng.normal(size=(n, e)), jnp.float32), k, True)
        ref = _expert_ffn_numpy(x, ids, w, gate, up, down)
        outs = {
            "tiled": jax.jit(lambda *a: expert_ffn(*a, method="tiled"))(x, ids, w, gate, up, down),
            "ragged_dot": expert_ffn(x, ids, w, gate, up, down, method="ragged_dot"),
            "ep tiled": jax.jit(lambda *a: expert_ffn_ep(*a, mesh=mesh))(x, ids, w, gate, up, down),
            "ep ragged_dot": jax.jit(lambda *a: expert_ffn_ep(*a, mesh=mesh, method="ragged_dot"))(
                x, ids, w, gate, up, down),
        }
        for name, y in outs.items():
            np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4, err_msg=f"{name}, {n} tokens")


def test_real_qwen3_30b_a3b_sizes():
    """The bundled config.json of Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (its published sizes);
    its 128 experts split over ep=16 (one per chip of a 16-chip slice), not over ep=12."""
    raw = json.loads((Path(__file__).resolve().parents[1] / "configs/models/qwen3-30b-a3b/config.json").read_text())
    fam, cfg = from_hf_config(raw)
    assert fam.name == "qwen3_moe" and cfg.num_experts == 128 and cfg.num_experts_per_tok == 8
    assert 30.4e9 < fam.param_count(cfg) < 30.6e9
    assert 3.2e9 < fam.active_param_count(cfg) < 3.4e9
    fam.check_mesh(cfg, {"ep": 16})
    with pytest.raises(ValueError, match=r"ep=12 does not divide the model's 128 experts"):
        fam.check_mesh(cfg, {"ep": 12})
    pool = fam.kv_pool_spec(cfg, total_pages=64, page_size=16)
    assert pool.shape == (48, 64, 16, 8, 128)


def test_gemma3_local_layers_use_their_window(family_case):
    """Past the window the local layers matter: the same weights with every layer global give other logits."""
    import dataclasses

    if family_case["kind"] != "gemma3_text":
        pytest.skip("gemma3 only")
    fam, cfg, hf = family_case["family"], family_case["cfg"], family_case["hf"]
    wide = dataclasses.replace(cfg, layer_types=("full_attention",) * cfg.num_layers)
    graphdef, state = fam.build_model(wide, family_case["params"])
    ours = np.asarray(_forward_fn(graphdef)(state, jnp.asarray([PROMPT], jnp.int32)))[0]
    assert np.abs(ours[-1] - _hf_logits(hf, PROMPT)[-1]).max() > 1e-2


def test_qwen3_30b_a3b_experts_compile_deviceless_for_tpu_with_ep():
    """The real Qwen3-30B-A3B MoE block (128 experts, 8 per token, bfloat16) with its experts over ep=4 on a
    v5e 2x2 slice compiles through libtpu, with no TPU: a grouped matmul, each chip holding a quarter of the
    experts, no expert weights gathered."""
    import os
    import subprocess
    import sys

    pytest.importorskip("libtpu")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("moe_tpu_compile.py")), "64"],
                       cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in rep, rep["error"]
    assert rep["device_kind"] == "TPU v5 lite"
    assert rep["has_ragged_dot"]
    assert not rep["all_gather"]
    experts_per_chip = 3 * (128 // 4) * 2048 * 768 * 2
    assert experts_per_chip <= rep["argument_bytes"] < experts_per_chip * 1.1


@pytest.mark.parametrize("kind,change,message", [
    ("qwen3", {"use_sliding_window": True}, r"qwen3: use_sliding_window=true .* is not supported"),
    ("gemma3_text", {"layer_types": ["sliding_attention", "local"]},
     r"gemma3_text: layer_types must be 4 entries of sliding_attention, full_attention, got 2 with \['local'\]"),
    ("gemma3_text", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=true .* not supported"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, r"qwen3_moe: dense layers between the MoE layers"),
    ("mixtral", {"num_experts_per_tok": 5}, r"mixtral: num_experts_per_tok=5 must be in \[1, num_experts=4\]"),
])
def test_config_errors_name_the_key(kind, change, message):
    raw = {k: v for k, v in TINY[kind].items() if k not in change}
    with pytest.raises(ValueError, match=message):
        from_hf_config({**raw, **change})


def test_gemma3_legacy_config_keys():
    """Configs written before layer_types / rope_parameters: sliding_window_pattern, rope_theta and
    rope_local_base_freq give the same layers and RoPE."""
    raw = {k: v for k, v in TINY["gemma3_text"].items() if k not in ("layer_types", "rope_parameters")}
    _, cfg = from_hf_config({**raw, "sliding_window_pattern": 2, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    _, new = from_hf_config(TINY["gemma3_text"])
    assert cfg.layer_types == new.layer_types
    assert (cfg.rope_theta, cfg.rope_local_theta) == (new.rope_theta, new.rope_local_theta) == (1e6, 1e4)


def test_moe_rejects_out_in_kernels_and_unknown_method():
    from raydeploy.model.moe import expert_ffn

    fam, cfg = from_hf_config(TINY["mixtral"])
    with pytest.raises(ValueError, match=r"mixtral: kernel_layout must be in_out for a mixture-of-experts model, "
                                         r"got 'out_in'"):
        fam.abstract_model(cfg, kernel_layout="out_in")
    z = jnp.zeros((2, 4, 4))
    with pytest.raises(ValueError, match=r"method must be one of auto, tiled, ragged_dot, got 'dense'"):
        expert_ffn(jnp.zeros((1, 4)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)), z, z, z, method="dense")
