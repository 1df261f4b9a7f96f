"""The GGUF converter for every family llama.cpp names (Llama, Qwen3, Gemma 3, Qwen3-MoE, Mixtral).

Each family is built tiny with random weights by transformers itself (`AutoModelForCausalLM.from_config`, fixed
seed, no download) and written to a GGUF file the way llama.cpp's `convert_hf_to_gguf.py` writes it: the `gguf`
package's own name map (`gguf.get_tensor_name_map`) for the names, the metadata keys its converter writes,
float32 tensors, and its weight transforms (Llama/Mixtral Q and K rope-permuted, Gemma's norms stored as
(1 + w), each MoE layer's experts stacked [E, out, in]). That file goes through our converter, the checkpoint
is read back and loaded through the family's `build_model`, and its last-position logits must match the
transformers float32 forward within 1e-3. Then the bad-input paths and their messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from raydeploy.checkpoint.convert import convert  # noqa: E402
from raydeploy.checkpoint.convert_gguf import convert_gguf  # noqa: E402
from raydeploy.checkpoint.format import CheckpointError  # noqa: E402
from raydeploy.checkpoint.reader import CheckpointReader  # noqa: E402
from raydeploy.model.registry import from_hf_config  # noqa: E402

PROMPT = [3, 17, 42, 5, 99, 7, 64, 1, 23, 11]
_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, initializer_range=0.2)

# model_type -> (transformers config, GGUF architecture). Gemma 3 as llama.cpp runs it: every 6th layer global,
# local RoPE base 10000, queries scaled by head_dim**-0.5, no soft-caps (its converter writes none for Gemma 3);
# window 4 is shorter than the prompt, so the local layers are checked past their window.
TINY: dict[str, tuple[dict[str, Any], str]] = {
    "llama": (dict(model_type="llama", intermediate_size=96, num_hidden_layers=2, rope_theta=10000.0,
                   tie_word_embeddings=False, **_COMMON), "llama"),
    # Llama 3 rope scaling: llama.cpp drops the rope_scaling dict and stores per-frequency divisors as the
    # tensor rope_freqs.weight; the original context (64) puts the 8 frequencies in all three bands
    "llama3": (dict(model_type="llama", intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}, **_COMMON), "llama"),
    "qwen3": (dict(model_type="qwen3", intermediate_size=96, num_hidden_layers=2, rope_theta=10000.0,
                   tie_word_embeddings=False, **_COMMON), "qwen3"),
    "gemma3_text": (dict(model_type="gemma3_text", intermediate_size=96, num_hidden_layers=6, sliding_window=4,
                         layer_types=["sliding_attention"] * 5 + ["full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                         query_pre_attn_scalar=16, final_logit_softcapping=None, tie_word_embeddings=True,
                         **_COMMON), "gemma3"),
    "qwen3_moe": (dict(model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                       **_COMMON), "qwen3moe"),
    "mixtral": (dict(model_type="mixtral", intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                     num_experts_per_tok=2, tie_word_embeddings=False, **_COMMON), "llama"),
}


def _hf_model(kind: str, tmp: Path) -> tuple[Any, dict[str, np.ndarray]]:
    """A tiny transformers model of `kind` with seeded random weights, and its tensors as `save_pretrained`
    writes them (the names llama.cpp's converter reads)."""
    from hf_reference import tiny_hf_model
    from safetensors.numpy import load_file

    src = tmp / f"hf-{kind}"
    model = tiny_hf_model(TINY[kind][0], src)
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return model, tensors


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (Q and K rows into its rope layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(kind: str, hf_cfg: dict[str, Any], tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors -> llama.cpp's GGUF tensors for `kind` (names through gguf's own tensor name map)."""
    arch = TINY[kind][1]
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    layers = hf_cfg["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(arch_enum, layers)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
        w = np.asarray(w, np.float32)
        if kind == "mixtral" and ".block_sparse_moe.experts." in name:  # layers.L.feed_forward.experts.wN
            parts = name.split(".")
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = w
            continue
        if kind == "qwen3_moe" and ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            parts = name.split(".")
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = w
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _permute(w, hf_cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _permute(w, hf_cfg["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        new = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out[new] = w
    rope = hf_cfg.get("rope_parameters") or hf_cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = _llama3_rope_factors(hf_cfg, rope)
    for (layer, w_name), per_expert in experts.items():
        stacked = np.stack([per_expert[i] for i in range(len(per_expert))])
        merged = (f"layers.{layer}.feed_forward.experts.{w_name}.weight" if kind == "mixtral"
                  else f"model.layers.{layer}.mlp.experts.{w_name}.weight")
        new = name_map.get_name(merged, try_suffixes=(".weight",))
        assert new is not None, merged
        out[new] = stacked
    return out


def _llama3_rope_factors(hf_cfg: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: the divisor of each rope frequency under Llama 3 scaling."""
    import math

    dim = hf_cfg["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(path: Path, arch: str, meta: dict[str, Any], tensors: dict[str, np.ndarray],
               q8_0: tuple[str, ...] = ()) -> Path:
    """A GGUF file of float32 tensors (those named in `q8_0` quantized Q8_0) with `meta` (key suffix after
    "<arch>." -> value; ints as uint32)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_array(full, value)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, np.float32)
        if name in q8_0:
            w.add_tensor(name, gguf.quants.quantize(arr, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_meta(kind: str, c: dict[str, Any]) -> dict[str, Any]:
    """The metadata llama.cpp's converter writes for `kind` (from the full transformers config `c`)."""
    meta: dict[str, Any] = {
        "context_length": c["max_position_embeddings"], "embedding_length": c["hidden_size"],
        "block_count": c["num_hidden_layers"], "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": c["num_key_value_heads"],
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"],
    }
    rope = c.get("rope_parameters") or {}
    if kind == "gemma3_text":
        meta["rope.freq_base"] = float(rope["full_attention"]["rope_theta"])
        meta["attention.sliding_window"] = c["sliding_window"]
    else:
        meta["rope.freq_base"] = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "llama":
        meta["vocab_size"] = c["vocab_size"]
    if kind == "mixtral":
        meta.update(expert_count=c["num_local_experts"], expert_used_count=c["num_experts_per_tok"])
    if kind == "qwen3_moe":
        meta.update(expert_count=c.get("num_experts") or c["num_local_experts"], expert_used_count=c["num_experts_per_tok"],
                    expert_feed_forward_length=c["moe_intermediate_size"])
    return meta


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Per family: the transformers model, its GGUF file (as llama.cpp writes it) and the pieces."""
    tmp = tmp_path_factory.mktemp("gguf-families")
    out: dict[str, dict[str, Any]] = {}
    for kind, (_, arch) in TINY.items():
        model, tensors = _hf_model(kind, tmp)
        hf_cfg = model.config.to_dict()
        meta = _gguf_meta(kind, hf_cfg)
        gt = _gguf_tensors(kind, hf_cfg, tensors)
        path = write_gguf(tmp / f"{kind}.gguf", arch, meta, gt)
        out[kind] = {"hf": model, "path": path, "arch": arch, "meta": meta, "tensors": gt, "tmp": tmp}
    return out


def _hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("kind", sorted(TINY))
def test_gguf_logits_match_transformers(kind, built):
    import flax.nnx as nnx

    case = built[kind]
    dst = case["tmp"] / f"ckpt-{kind}"
    result = convert(case["path"], dst, progress=False)  # through the CLI's entry: the format is detected
    assert result["format"] == "gguf"
    reader = CheckpointReader(dst)
    hf_cfg = reader.hf_config
    assert hf_cfg["model_type"] == TINY[kind][0]["model_type"]
    if kind == "llama3":  # the divisors became the config's rope scaling
        assert hf_cfg["rope_scaling"]["rope_type"] == "freq_factors"
        np.testing.assert_allclose(hf_cfg["rope_scaling"]["factors"], case["tensors"]["rope_freqs.weight"])
    fam, cfg = from_hf_config(hf_cfg)
    assert cfg.vocab_size == 128 and cfg.head_dim == 16 and cfg.num_layers == TINY[kind][0]["num_hidden_layers"]
    params = {n: reader.read_tensor(n) for n in fam.param_specs(cfg)}
    graphdef, state = fam.build_model(cfg, params)
    ours = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray([PROMPT], jnp.int32)))[0]
    ref = _hf_logits(case["hf"], PROMPT)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours[-1], ref[-1], atol=1e-3, rtol=0)
    assert np.abs(ref[-1]).max() > 0.1  # the comparison is not between two near-zero vectors


def test_family_specific_config_from_metadata(built, tmp_path):
    """The settings that come from the GGUF's metadata (or llama.cpp's fixed choices) for each family."""
    got = {}
    for kind in ("gemma3_text", "qwen3_moe", "mixtral"):
        dst = tmp_path / kind
        convert_gguf(built[kind]["path"], dst, progress=False)
        got[kind] = json.loads((dst / "config.json").read_text())
    g = got["gemma3_text"]
    assert g["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (g["sliding_window"], g["rope_local_base_freq"], g["rope_theta"]) == (4, 10000.0, 1000000.0)
    assert g["query_pre_attn_scalar"] == 16 and g["tie_word_embeddings"] is True
    q = got["qwen3_moe"]
    assert (q["num_experts"], q["num_experts_per_tok"], q["moe_intermediate_size"], q["norm_topk_prob"]) == \
        (4, 2, 32, True)
    m = got["mixtral"]
    assert (m["num_local_experts"], m["num_experts_per_tok"], m["intermediate_size"]) == (4, 2, 32)
    # without expert_feed_forward_length the experts' width comes from the stacked gate [E, F, D]
    src = _rewrite(built["qwen3_moe"], tmp_path / "q.gguf", drop_meta=("expert_feed_forward_length",))
    convert_gguf(src, tmp_path / "q", progress=False)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["moe_intermediate_size"] == 32


def test_gemma3_norms_are_stored_plus_one(built, tmp_path):
    """The converter stores Gemma's raw norm weight w (its module scales by 1 + w); llama.cpp stored 1 + w."""
    case = built["gemma3_text"]
    dst = tmp_path / "g"
    convert_gguf(case["path"], dst, progress=False)
    stored = CheckpointReader(dst).read_tensor("layers.0.attn.q_norm.scale")
    hf = case["hf"].model.layers[0].self_attn.q_norm.weight.detach().numpy()
    np.testing.assert_allclose(np.asarray(stored), hf, atol=1e-6)
    np.testing.assert_allclose(case["tensors"]["blk.0.attn_q_norm.weight"], hf + 1.0, atol=1e-6)


def test_quantized_expert_stacks_dequantize_in_our_layout(built, tmp_path):
    """Real MoE GGUFs store the stacked experts quantized: Q8_0 [E, out, in] stacks come back as what Q8_0 keeps
    of each expert, transposed to [E, in, out]."""
    case = built["qwen3_moe"]
    stacks = ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight")
    src = write_gguf(tmp_path / "q8.gguf", case["arch"], case["meta"], case["tensors"], q8_0=stacks)
    convert_gguf(src, tmp_path / "out", progress=False)
    reader = CheckpointReader(tmp_path / "out")
    q8 = gguf.GGMLQuantizationType.Q8_0
    for gname, ours in zip(stacks, ("layers.0.mlp.experts.gate_proj.kernel", "layers.1.mlp.experts.down_proj.kernel"),
                           strict=True):
        orig = case["tensors"][gname]
        kept = gguf.quants.dequantize(gguf.quants.quantize(orig, q8), q8).reshape(orig.shape)
        got = np.asarray(reader.read_tensor(ours))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, kept.swapaxes(1, 2))
        assert not np.array_equal(kept, orig)  # Q8_0 really changed the values: the file really was quantized


# ---- bad input ----

def _rewrite(case: dict[str, Any], path: Path, arch: str | None = None, drop_meta: tuple[str, ...] = (),
             drop: tuple[str, ...] = (), add: dict[str, np.ndarray] | None = None) -> Path:
    meta = {k: v for k, v in case["meta"].items() if k not in drop_meta}
    tensors = {k: v for k, v in case["tensors"].items() if k not in drop}
    tensors.update(add or {})
    return write_gguf(path, arch or case["arch"], meta, tensors)


def test_unsupported_architecture_names_the_supported_ones(built, tmp_path):
    src = _rewrite(built["qwen3"], tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(CheckpointError) as e:
        convert_gguf(src, tmp_path / "out", progress=False)
    msg = str(e.value)
    assert "GGUF architecture 'phi3' is not supported" in msg and str(src) in msg
    for arch in ("gemma3", "llama", "qwen3", "qwen3moe", "Mixtral"):
        assert arch in msg
    assert not (tmp_path / "out" / "index.json").exists()


def test_missing_expert_tensor_is_named(built, tmp_path):
    for kind in ("qwen3_moe", "mixtral"):
        src = _rewrite(built[kind], tmp_path / f"{kind}.gguf", drop=("blk.1.ffn_down_exps.weight",))
        with pytest.raises(CheckpointError) as e:
            convert_gguf(src, tmp_path / f"out-{kind}", progress=False)
        assert "GGUF lacks tensors the" in str(e.value)
        assert e.value.tensor == "blk.1.ffn_down_exps.weight"
        assert "blk.1.ffn_down_exps.weight" in str(e.value) and str(src) in str(e.value)


def test_missing_dense_tensor_is_named(built, tmp_path):
    src = _rewrite(built["gemma3_text"], tmp_path / "g.gguf", drop=("blk.5.post_ffw_norm.weight",))
    with pytest.raises(CheckpointError) as e:
        convert_gguf(src, tmp_path / "out", progress=False)
    assert e.value.tensor == "blk.5.post_ffw_norm.weight" and "gemma3" in str(e.value)


def test_bad_rope_freqs_are_refused_with_the_numbers(built, tmp_path):
    src = _rewrite(built["llama3"], tmp_path / "l.gguf", add={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(CheckpointError, match=r"rope_freqs.weight must hold 8 positive factors \(head_dim / 2\), "
                                              r"got shape \(5,\)"):
        convert_gguf(src, tmp_path / "out", progress=False)
    src = _rewrite(built["llama3"], tmp_path / "z.gguf", add={"rope_freqs.weight": np.zeros(8, np.float32)})
    with pytest.raises(CheckpointError, match="8 positive factors"):
        convert_gguf(src, tmp_path / "out2", progress=False)


def test_missing_expert_metadata_is_named(built, tmp_path):
    src = _rewrite(built["qwen3_moe"], tmp_path / "q.gguf", drop_meta=("expert_count",))
    with pytest.raises(CheckpointError, match=r"'qwen3moe\.expert_count' and 'qwen3moe\.expert_used_count' are "
                                              r"needed for qwen3_moe"):
        convert_gguf(src, tmp_path / "out", progress=False)


def test_wrong_expert_stack_shape_is_named(built, tmp_path):
    case = built["mixtral"]
    bad = case["tensors"]["blk.0.ffn_up_exps.weight"][:3]  # 3 experts stacked where the metadata says 4
    src = _rewrite(case, tmp_path / "m.gguf", add={"blk.0.ffn_up_exps.weight": bad})
    with pytest.raises(CheckpointError) as e:
        convert_gguf(src, tmp_path / "out", progress=False)
    assert e.value.tensor == "layers.0.mlp.experts.up_proj.kernel" and "[3, 64, 32]" in str(e.value)


def test_unknown_tensor_for_the_family_is_named(built, tmp_path):
    case = built["qwen3"]
    src = _rewrite(case, tmp_path / "x.gguf", add={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4, 4), np.float32)})
    with pytest.raises(CheckpointError) as e:
        convert_gguf(src, tmp_path / "out", progress=False)
    assert "GGUF tensor 'blk.0.ffn_gate_exps.weight' is not a known parameter" in str(e.value)
