"""Quantized weights (`raydeploy.model.quant`, docs/quantization.md): int8 / fp8 projection kernels per output
channel, in the model, in checkpoints (format version 5, `raydeploy convert --quantize`, compressed-tensors int8),
loaded by each host in its own slices, quantized while loading, and the refusals.

Tolerance of a quantized model against its dequantized-float reference (`_ref_tol`): both multiply the same
values, q * s, in float32; they differ only in where the scale is applied (after the dot, or folded into the
weight before it) and so in float32 rounding: one matmul's relative difference is a few ulps (2^-24 each) times
sqrt(K) for K-long sums, and L layers add theirs. With K <= 96, L <= 4 that is < 1e-5 of the logits' scale; the
bound is 1e-4 of it (a factor-10 margin), plus a few ulps for logits near 0. The float model against the
quantized one is looser (int8 rounds each weight by up to s/2, fp8 keeps 3 mantissa bits): on these random tiny
models, kernels scaled up 5x so that every layer matters, the largest logit difference measured 1.3-2.8% of the
logits' scale for int8 (8% for Gemma 3, whose soft cap at 3 shrinks the scale) and 8-19% for fp8 (26% Gemma 3);
bounded at 10% and 30%.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from raydeploy.checkpoint.convert import convert
from raydeploy.checkpoint.convert_compressed_tensors import pack_int8, unpack_int8
from raydeploy.checkpoint.format import INDEX_FILE, CheckpointError
from raydeploy.checkpoint.quantize import quantize_checkpoint
from raydeploy.checkpoint.reader import CheckpointReader
from raydeploy.config import ModelConfig
from raydeploy.loading import load_params
from raydeploy.model import quant
from raydeploy.model.registry import family_for, from_hf_config
from raydeploy.model.sharding import build_mesh, merge_rules
from raydeploy.model.state import state_to_params

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=128, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        sliding_window=4, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                        tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, tie_word_embeddings=False),
}
TOKENS = [[3, 17, 42, 5, 99, 7, 64, 1, 23, 11, 90, 2]]
FLOAT_VS_QUANT = {"int8": 0.1, "fp8": 0.3}


def _random_params(kind: str, seed: int = 0) -> tuple[Any, Any, dict[str, np.ndarray]]:
    """(family, config, stacked float params): the family's own random init, scaled up so the logits spread."""
    fam = family_for(kind)
    cfg = fam.config_from_hf(dict(TINY[kind]))
    module = fam.module(cfg, rngs=nnx.Rngs(seed))
    params = {n: np.asarray(v) * (5.0 if n.endswith("kernel") else 1.0)
              for n, v in state_to_params(nnx.state(module, nnx.Param)).items()}
    return fam, cfg, params


def _logits(fam: Any, cfg: Any, params: dict[str, np.ndarray]) -> np.ndarray:
    graphdef, state = fam.build_model(cfg, {n: jnp.asarray(a) for n, a in params.items()})
    return np.asarray(nnx.merge(graphdef, state)(jnp.asarray(TOKENS)))


def _ref_tol(ref: np.ndarray) -> float:
    return 1e-4 * float(np.abs(ref).max()) + 1e-6


# -- the values and the specs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_numpy_and_jax_quantize_alike_per_output_channel(mode):
    w = np.random.default_rng(0).normal(size=(3, 40, 2, 8)).astype(np.float32)
    w[:, :, 1, 3] = 0.0  # an all-zero channel: scale 1, values 0
    q, s = quant.quantize_np(w, mode, (1,))
    qj, sj = jax.jit(lambda x: quant.quantize_jax(x, mode, (1,)))(w)
    assert q.dtype == (np.int8 if mode == "int8" else ml_dtypes.float8_e4m3fn) and s.shape == (3, 2, 8)
    np.testing.assert_array_equal(np.asarray(qj).astype(np.float32), q.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(sj), s)
    assert s[0, 1, 3] == 1.0 and not np.any(q[:, :, 1, 3].astype(np.float32))
    np.testing.assert_allclose(s[0, 0], np.abs(w[0, :, 0]).max(axis=0) / quant.QMAX[mode], rtol=3e-7)
    assert float(np.abs(q.astype(np.float32)).max()) == quant.QMAX[mode]
    # int8 rounds to the nearest step: at most half a step off
    err = np.abs(quant.dequantize_np(q, s, (1,)) - w)
    if mode == "int8":
        assert np.all(err <= np.expand_dims(s, 1) / 2 * (1 + 1e-6))


def test_quantized_specs_scale_like_the_output_dims():
    fam = family_for("qwen3_moe")
    cfg = fam.config_from_hf(dict(TINY["qwen3_moe"]))
    specs = fam.with_quantization("int8").stacked_param_specs(cfg)
    q, s = specs["layers.attn.q_proj.kernel"], specs["layers.attn.q_proj.kernel_scale"]
    assert q.dtype == "int8" and s.dtype == "float32"
    assert s.shape == (2, 4, 16) and s.logical_axes == ("layers", "q_heads", "head_dim")
    o = specs["layers.attn.o_proj.kernel_scale"]
    assert o.shape == (2, 64) and o.logical_axes == ("layers", "embed")
    e = specs["layers.mlp.experts.down_proj.kernel_scale"]
    assert e.shape == (2, 4, 64) and e.logical_axes == ("layers", "expert", "embed")
    # the embedding, a separate LM head, the router and the norms stay float
    for name in ("embed.embedding", "lm_head.kernel", "layers.mlp.router.kernel", "final_norm.scale"):
        assert specs[name].dtype is None and quant.scale_name(name) not in specs
    # bytes: int8 kernels and float32 scales against the float model's
    float_bytes = fam.weight_bytes(cfg, "bfloat16")
    int8_bytes = fam.with_quantization("int8").weight_bytes(cfg, "bfloat16")
    kernels = sum(sp.numel for n, sp in fam.stacked_param_specs(cfg).items() if quant.quantized_kernel(n))
    scales = sum(sp.numel for n, sp in specs.items() if quant.is_scale(n))
    assert float_bytes - int8_bytes == kernels - 4 * scales


# -- every family -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("kind", sorted(TINY))
def test_every_family_with_quantized_kernels_matches_its_dequantized_float_model(kind, mode):
    fam, cfg, params = _random_params(kind)
    specs = fam.stacked_param_specs(cfg)
    qparams = quant.quantize_params_np(params, specs, mode)
    qfam = fam.with_quantization(mode)
    graphdef, state = qfam.build_model(cfg, {n: jnp.asarray(a) for n, a in qparams.items()})
    held = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}
    assert held["layers.attn.q_proj.kernel"].dtype == quant.STORAGE_DTYPES[mode]
    assert held["layers.attn.q_proj.kernel_scale"].dtype == jnp.float32
    got = np.asarray(nnx.merge(graphdef, state)(jnp.asarray(TOKENS)))
    ref = _logits(fam, cfg, quant.dequantize_params_np(qparams, specs))
    np.testing.assert_allclose(got, ref, rtol=0, atol=_ref_tol(ref))
    full = _logits(fam, cfg, params)
    rel = float(np.abs(got - full).max() / np.abs(full).max())
    print(f"{kind} {mode}: max |quantized - float| = {rel:.4f} of the logits' scale")
    assert 0 < rel < FLOAT_VS_QUANT[mode]


def test_out_in_kernels_quantized_match_in_out():
    fam, cfg, params = _random_params("llama")
    specs = fam.stacked_param_specs(cfg)
    qparams = {n: jnp.asarray(a) for n, a in quant.quantize_params_np(params, specs, "int8").items()}
    qfam = fam.with_quantization("int8")
    outs = []
    for layout in ("in_out", "out_in"):
        stacked = qfam.stack_layers(cfg, qparams, layout)
        graphdef, state = qfam.build_model(cfg, stacked, kernel_layout=layout)
        outs.append(np.asarray(nnx.merge(graphdef, state)(jnp.asarray(TOKENS))))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=_ref_tol(outs[0]))


# -- checkpoints: quantize, write, read -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory) -> Path:
    """A tiny llama checkpoint from transformers' random weights, stacked and split for fsdp=2 x tp=2."""
    pytest.importorskip("transformers")
    from hf_reference import tiny_hf_model

    tmp = tmp_path_factory.mktemp("quant-ckpt")
    hf = dict(TINY["llama"], hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32,
              initializer_range=0.2)
    tiny_hf_model(hf, tmp / "hf")
    convert(tmp / "hf", tmp / "float", progress=False, splits={"mlp": 2, "q_heads": 2, "kv_heads": 2}, stacked=True)
    return tmp / "float"


@pytest.fixture(scope="module")
def int8_ckpt(float_ckpt) -> Path:
    dst = float_ckpt.parent / "int8"
    quantize_checkpoint(float_ckpt, dst, "int8", block_bytes=1024)
    return dst


def test_quantized_checkpoint_is_version_5_and_round_trips(float_ckpt, int8_ckpt):
    src, dst = CheckpointReader(float_ckpt), CheckpointReader(int8_ckpt)
    assert dst.index.version == 5 and dst.quantization == "int8" and src.quantization == "none"
    data = json.loads((int8_ckpt / INDEX_FILE).read_text())
    assert data["quantization"] == "int8" and data["version"] == 5
    fam, cfg = from_hf_config(src.hf_config)
    specs = fam.checkpoint_specs(cfg, src.index.tensors)
    for name, spec in specs.items():
        w = src.read_tensor(name)
        if quant.quantized_kernel(name):
            q, s = quant.quantize_np(w, "int8", quant.kernel_axes(spec))
            np.testing.assert_array_equal(dst.read_tensor(name), q)
            np.testing.assert_array_equal(dst.read_tensor(quant.scale_name(name)), s)
            # stored split like the float kernel (a host of the split-for mesh reads one contiguous range)
            assert dst.index.tensors[name].splits == src.index.tensors[name].splits
        else:
            np.testing.assert_array_equal(dst.read_tensor(name), w)
    assert dst.index.tensors["layers.mlp.up_proj.kernel_scale"].splits == ((1, 2),)


@pytest.mark.parametrize("mesh_shape", [{"dp": 1}, {"fsdp": 2, "tp": 2}])
def test_each_device_holds_its_int8_slice_and_scales_and_a_host_reads_only_its_part(int8_ckpt, float_ckpt,
                                                                                   mesh_shape):
    n = int(np.prod(list(mesh_shape.values())))
    mesh = build_mesh(mesh_shape, jax.devices()[:n])
    reader = CheckpointReader(int8_ckpt)
    fam, cfg = from_hf_config(reader.hf_config)
    qfam = fam.with_quantization(reader.quantization)
    specs = qfam.checkpoint_specs(cfg, reader.index.tensors)
    rules = {**merge_rules(None), **qfam.rules}
    params, _ = reader.load(specs, mesh, rules, "float32", progress=False)
    float_reader = CheckpointReader(float_ckpt)
    for name in ("layers.mlp.up_proj.kernel", "layers.mlp.down_proj.kernel", "layers.attn.q_proj.kernel",
                 "layers.attn.o_proj.kernel"):
        q, s = quant.quantize_np(float_reader.read_tensor(name), "int8", quant.kernel_axes(specs[name]))
        arr, sc = params[name], params[quant.scale_name(name)]
        assert arr.dtype == jnp.int8 and sc.dtype == jnp.float32
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), q[shard.index])
        for shard in sc.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), s[shard.index])
    if n > 1:  # one device's host reads only that device's part of the split kernels
        ranges = reader.byte_ranges(specs, mesh, rules, devices=[mesh.devices.flat[0]])
        for name in ("layers.mlp.up_proj.kernel", "layers.mlp.down_proj.kernel"):
            read = sum(b - a for a, b in ranges[name])
            assert read <= reader.index.tensors[name].length // 2, (name, read)


def test_load_time_quantization_over_fsdp_uses_each_channels_whole_max(float_ckpt):
    """fsdp splits the kernels' input dim (embed; tp o_proj's heads): the scale must still be the max over the whole
    channel."""
    mesh = build_mesh({"fsdp": 2, "tp": 2}, jax.devices()[:4])
    reader = CheckpointReader(float_ckpt)
    fam, cfg = from_hf_config(reader.hf_config)
    rules = {**merge_rules(None), **fam.rules}
    qfam, params, stats = load_params(reader, fam, cfg, mesh, rules, ModelConfig(quantization="int8"), 2)
    assert qfam.quantization == "int8" and stats.tensors == len(reader.index.tensors)
    specs = fam.checkpoint_specs(cfg, reader.index.tensors)
    for name in ("layers.mlp.gate_proj.kernel", "layers.attn.k_proj.kernel", "layers.attn.o_proj.kernel"):
        q, s = quant.quantize_np(reader.read_tensor(name), "int8", quant.kernel_axes(specs[name]))
        spec = params[name].sharding.spec  # an input dim is split: fsdp over embed, tp over o_proj's heads
        assert any(spec[d] for d in quant.kernel_axes(specs[name])), (name, spec)
        np.testing.assert_array_equal(np.asarray(params[name]), q)
        np.testing.assert_allclose(np.asarray(params[quant.scale_name(name)]), s, rtol=1e-7)
    assert params["embed.embedding"].dtype == jnp.float32


# -- compressed-tensors int8 (W8A16) ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int-quantized", "pack-quantized"])
def test_compressed_tensors_int8_checkpoint_loads_as_int8_and_matches_its_dequantized_model(tmp_path, fmt):
    """A W8A16 checkpoint as llm-compressor writes it (written here: safetensors + config.json) converts without
    dequantizing (its int8 bytes land unchanged) and the model matches the same weights dequantized."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_reference import tiny_hf_model
    from safetensors.torch import load_file, save_file

    hf = dict(TINY["qwen2"], initializer_range=0.2)
    model = tiny_hf_model(hf, tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    out, deq, qs = {}, {}, {}
    for name, t in tensors.items():
        w = t.float().numpy()
        if name.endswith("_proj.weight") and "lm_head" not in name:
            q, s = quant.quantize_np(w, "int8", (1,))  # [out, in]: the channel is the row
            qs[name] = q
            scale = torch.from_numpy(s[:, None]).to(torch.bfloat16 if fmt == "int-quantized" else torch.float32)
            deq[name] = torch.from_numpy(q.astype(np.float32) * scale.float().numpy())
            if fmt == "int-quantized":
                out[name] = torch.from_numpy(q)
            else:
                out[name.replace(".weight", ".weight_packed")] = torch.from_numpy(pack_int8(q))
                out[name.replace(".weight", ".weight_shape")] = torch.tensor(q.shape, dtype=torch.int32)
            out[name + "_scale"] = scale
        else:
            out[name] = t
            deq[name] = t
    src = tmp_path / "ct"
    src.mkdir()
    save_file(out, str(src / "model.safetensors"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                  "strategy": "channel", "group_size": None, "dynamic": False}}},
        "ignore": ["lm_head"]}
    (src / "config.json").write_text(json.dumps(cfg))
    convert(src, tmp_path / "ours", progress=False)
    reader = CheckpointReader(tmp_path / "ours")
    assert reader.quantization == "int8"
    name = "layers.0.attn.q_proj.kernel"
    np.testing.assert_array_equal(reader.read_tensor(name), qs["model.layers.0.self_attn.q_proj.weight"].T
                                  .reshape(reader.read_tensor(name).shape))
    fam, mcfg = from_hf_config(reader.hf_config)
    qfam = fam.with_quantization("int8")
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    params, _ = reader.load(qfam.checkpoint_specs(mcfg, reader.index.tensors), mesh, {**merge_rules(None)},
                            progress=False)
    graphdef, state = qfam.build_model(mcfg, params)
    got = np.asarray(nnx.merge(graphdef, state)(jnp.asarray(TOKENS)))
    with torch.no_grad():
        model.load_state_dict(deq)
        ref = model(torch.tensor(TOKENS)).logits.float().numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=10 * _ref_tol(ref))  # torch's own float32 order: 10x


def test_pack_int8_round_trips_compressed_tensors_packing():
    q = np.random.default_rng(1).integers(-127, 128, size=(5, 12)).astype(np.int8)
    packed = pack_int8(q)
    assert packed.dtype == np.int32 and packed.shape == (5, 3)
    # compressed-tensors: value 4k + i in bits 8i.. of int32 k, offset by 128
    assert (int(packed.view(np.uint32)[0, 0]) >> 8) & 0xFF == int(q[0, 1]) + 128
    np.testing.assert_array_equal(unpack_int8(packed), q)


def test_compressed_tensors_schemes_we_do_not_read_are_refused_naming_the_key(tmp_path):
    from raydeploy.checkpoint.convert_compressed_tensors import compressed_config

    base = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": 128}}}}
    with pytest.raises(CheckpointError, match=r"config_groups\.g\.weights\.num_bits: 4"):
        compressed_config({"quantization_config": base}, "config.json")
    with pytest.raises(CheckpointError, match="quant_method: 'awq'"):
        compressed_config({"quantization_config": {"quant_method": "awq"}}, "config.json")
    assert compressed_config({}, "config.json") is None


# -- refusals ---------------------------------------------------------------------------------------------------

def test_a_newer_format_version_is_refused_saying_to_upgrade(int8_ckpt, tmp_path):
    import shutil

    d = tmp_path / "newer"
    shutil.copytree(int8_ckpt, d)
    data = json.loads((d / INDEX_FILE).read_text())
    data["version"] = 6
    (d / INDEX_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"version 6 is not supported.*newer raydeploy.*1, 2, 3, 4, 5.*upgrade"):
        CheckpointReader(d)
    data["version"] = 4  # a version-4 index cannot say it is quantized
    (d / INDEX_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="quantization 'int8' needs format version 5"):
        CheckpointReader(d)


def test_a_scale_of_the_wrong_shape_is_refused_before_any_byte_is_read(int8_ckpt, tmp_path):
    from raydeploy.checkpoint.writer import CheckpointWriter

    src = CheckpointReader(int8_ckpt)
    d = tmp_path / "bad-scale"
    with CheckpointWriter(d, quantization="int8") as w:
        for name in src.index.tensors:
            x = src.read_tensor(name)
            w.add(name, x[:, :-1] if name == "layers.mlp.up_proj.kernel_scale" else x)
        w.close(config=int8_ckpt / "config.json")
    reader = CheckpointReader(d)
    fam, cfg = from_hf_config(reader.hf_config)
    specs = fam.with_quantization("int8").checkpoint_specs(cfg, reader.index.tensors)
    mesh = build_mesh({"dp": 1}, jax.devices()[:1])
    with pytest.raises(CheckpointError, match=r"kernel_scale.*a quantized kernel's scale: shape \[2, 255\].*"
                                              r"expects \[2, 256\]"):
        reader.load(specs, mesh, merge_rules(None), progress=False)


def test_a_checkpoint_quantized_otherwise_than_asked_is_refused(int8_ckpt):
    from raydeploy.loading import weights_quantization

    reader = CheckpointReader(int8_ckpt)
    assert weights_quantization(reader, "none") == "int8" and weights_quantization(reader, "int8") == "int8"
    with pytest.raises(CheckpointError, match="stored int8, model.quantization asks for fp8.*--quantize fp8"):
        weights_quantization(reader, "fp8")


@pytest.mark.parametrize("platform, kind, cc, ok", [
    ("cpu", "cpu", None, True),
    ("tpu", "TPU v5 lite", None, False),
    ("tpu", "TPU v6 lite", None, False),
    ("tpu", "TPU7x", None, True),
    ("gpu", "NVIDIA A100-SXM4-80GB", "8.0", False),
    ("gpu", "NVIDIA L4", "8.9", True),
    ("gpu", "NVIDIA H200", "9.0", True),
])
def test_fp8_is_refused_on_chips_without_fp8_matmuls_naming_the_chip(platform, kind, cc, ok):
    why = quant.fp8_support(platform, kind, cc)
    assert (why is None) == ok
    if not ok:
        assert kind in why and "int8" in why


def test_the_engine_refuses_fp8_on_a_chip_without_it():
    from types import SimpleNamespace

    from raydeploy.engine.programs.kernels import check_fp8

    fam = family_for("llama").with_quantization("fp8")
    v5e = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")]))
    with pytest.raises(ValueError, match="TPU v5 lite.*TPU v7x"):
        check_fp8(fam, v5e)  # type: ignore[arg-type]
    check_fp8(fam, build_mesh({"dp": 1}, jax.devices()[:1]))  # CPU runs it (the reference)


def test_an_int8_engine_holds_int8_weights_and_multiplies_them_in_xla(int8_ckpt):
    """Built from a quantized checkpoint with `model.quantization: none` (read as stored): the step programs take
    the kernels as s8 parameters, and the engine says why XLA multiplies them (the native CPU kernels read float
    weights)."""
    from raydeploy.config import load_config
    from raydeploy.loading import build_engine

    cfg = load_config(None, ["engine.max_slots=2", "model.max_seq_len=64", "engine.prefill_chunk=16"])
    built = build_engine(cfg, build_mesh({"dp": 1}, jax.devices()[:1]), int8_ckpt)
    assert built.family.quantization == "int8"
    assert built.engine.matmul.startswith("xla") and "weights quantized int8" in built.engine.matmul
    hlo = built.engine.step_hlo(16, built.engine.max_pages_per_seq)
    entry = hlo[hlo.index("ENTRY"):].split("\n", 1)[0]
    assert "s8[2,128,4,32]" in entry and "s8[2,256,128]" in entry  # q_proj, down_proj held int8
