"""Converters: Hugging Face safetensors (Llama; Qwen2 with qkv bias and tied embeddings), EasyDeL streaming
msgpack, the demo GGUF against transformers' own GGUF loader, and the `raydeploy convert` command.

Each comparison re-derives the expected layout here, independently of raydeploy.checkpoint.layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import numpy as np
import pytest

from raydeploy.checkpoint.convert import convert, detect_format
from raydeploy.checkpoint.format import CheckpointError
from raydeploy.checkpoint.reader import CheckpointReader
from raydeploy.model.registry import from_hf_config
from raydeploy.model.sharding import build_mesh, merge_rules
from raydeploy.model.spec import split_layer_name

torch = pytest.importorskip("torch")

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4, max_position_embeddings=64)


def _save_tiny(kind: str, dst: Path, dtype=None) -> dict[str, np.ndarray]:
    """A tiny random HF model saved as safetensors (sharded), plus a tokenizer file. Returns its weights."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    with torch.no_grad():  # norms are ones at init: make them distinguishable
        for n, p in model.named_parameters():
            if "norm" in n or "bias" in n:
                p.copy_(torch.randn_like(p))
    model.save_pretrained(dst, max_shard_size="20KB")
    (dst / "tokenizer.json").write_text('{"version": "1.0"}')
    (dst / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    return {n: t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
            for n, t in model.state_dict().items()}


def expected_ours(sd: dict[str, np.ndarray], nh: int = 4, nkv: int = 2, hd: int = 4, d: int = 16,
                  layers: int | tuple[int, ...] = 2, tied: bool = False) -> dict[str, np.ndarray]:
    out = {"embed.embedding": sd["model.embed_tokens.weight"], "final_norm.scale": sd["model.norm.weight"]}
    if not tied:
        out["lm_head.kernel"] = sd["lm_head.weight"].T
    for i in range(layers) if isinstance(layers, int) else layers:
        h, o = f"model.layers.{i}.", f"layers.{i}."
        out[o + "attn_norm.scale"] = sd[h + "input_layernorm.weight"]
        out[o + "mlp_norm.scale"] = sd[h + "post_attention_layernorm.weight"]
        out[o + "attn.q_proj.kernel"] = sd[h + "self_attn.q_proj.weight"].T.reshape(d, nh, hd)
        out[o + "attn.k_proj.kernel"] = sd[h + "self_attn.k_proj.weight"].T.reshape(d, nkv, hd)
        out[o + "attn.v_proj.kernel"] = sd[h + "self_attn.v_proj.weight"].T.reshape(d, nkv, hd)
        out[o + "attn.o_proj.kernel"] = sd[h + "self_attn.o_proj.weight"].T.reshape(nh, hd, d)
        if h + "self_attn.q_proj.bias" in sd:
            out[o + "attn.q_proj.bias"] = sd[h + "self_attn.q_proj.bias"].reshape(nh, hd)
            out[o + "attn.k_proj.bias"] = sd[h + "self_attn.k_proj.bias"].reshape(nkv, hd)
            out[o + "attn.v_proj.bias"] = sd[h + "self_attn.v_proj.bias"].reshape(nkv, hd)
        for m in ("gate_proj", "up_proj", "down_proj"):
            out[o + f"mlp.{m}.kernel"] = sd[h + f"mlp.{m}.weight"].T
    return out


def assert_checkpoint_equals(ckpt: Path, expected: dict[str, np.ndarray], stacked: bool = False) -> CheckpointReader:
    """The checkpoint holds exactly `expected` (per-layer names): one tensor per layer (a conversion for no
    mesh), or stacked over the layers as `layers.x` [L, ...] (for a mesh); it loads on a fsdp x tp mesh."""
    r = CheckpointReader(ckpt)
    family, cfg = from_hf_config(r.hf_config)
    assert set(family.param_specs(cfg)) == set(expected)
    per_layer = [n for n in r.index.tensors if split_layer_name(n)]
    if stacked:
        assert not per_layer and set(r.index.tensors) == set(family.stacked_param_specs(cfg))
        for n, e in r.index.tensors.items():
            if n.startswith("layers."):  # row i of a stacked tensor is layer i's, bit for bit
                want = np.stack([expected[f"layers.{i}.{n[len('layers.'):]}"] for i in range(cfg.num_layers)])
                assert e.shape == want.shape, n
                np.testing.assert_array_equal(r.read_tensor(n).astype(np.float32), want.astype(np.float32), n)
    else:
        assert set(r.index.tensors) == set(expected)
    for n, a in expected.items():
        got = r.read_tensor(n)
        assert got.shape == a.shape, n
        np.testing.assert_array_equal(got.astype(np.float32), a.astype(np.float32), err_msg=n)
    loaded, _ = r.load(r.param_specs(), build_mesh({"fsdp": 2, "tp": 2}), merge_rules({}), progress=False)
    np.testing.assert_array_equal(np.asarray(loaded["embed.embedding"]).astype(np.float32),
                                  expected["embed.embedding"].astype(np.float32))
    return r


# what the mesh of configs/cpu-fsdp.yaml cuts: embed over fsdp=2, mlp and vocab over tp=2
FSDP_TP_SPLITS = {"embed": 2, "mlp": 2, "vocab": 2}


def assert_split_for_fsdp_tp(r: CheckpointReader) -> None:
    """The converter stored the column-cut tensors split, and only those: the stacked MLP kernels [L, embed,
    mlp] / [L, mlp, embed] along both (format version 4), q/k/v [L, embed, heads, head_dim] along embed, o_proj
    [L, heads, head_dim, embed] along its last dim, the embedding [vocab, embed] and head [embed, vocab] along
    their second."""
    assert r.index.version == 4
    for n, e in r.index.tensors.items():
        if n.endswith("o_proj.kernel"):
            assert e.splits == ((3, 2),), n
        elif n.endswith(("gate_proj.kernel", "up_proj.kernel", "down_proj.kernel")):
            assert e.splits == ((1, 2), (2, 2)), n
        elif n.endswith(("q_proj.kernel", "k_proj.kernel", "v_proj.kernel")) or n in ("embed.embedding",
                                                                                   "lm_head.kernel"):
            assert e.splits == ((1, 2),), n
        else:
            assert not e.splits, n


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    src = tmp_path_factory.mktemp("hf") / "llama"
    return src, _save_tiny("llama", src)


def test_safetensors_llama_sharded_round_trip(tiny_llama, tmp_path):
    src, sd = tiny_llama
    assert (src / "model.safetensors.index.json").is_file()  # really sharded
    result = convert(src, tmp_path / "out", shard_size_bytes=8192, progress=False)
    assert result["format"] == "safetensors" and result["tensors"] == 2 * 9 + 3
    r = assert_checkpoint_equals(tmp_path / "out", expected_ours(sd))
    assert len(r.index.files) > 1
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"]
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert from_hf_config(r.hf_config)[1].num_kv_heads == 2 and not from_hf_config(r.hf_config)[1].tie_word_embeddings
    assert all(not e.splits for e in r.index.tensors.values()) and r.index.version == 3
    convert(src, tmp_path / "split", shard_size_bytes=8192, progress=False, splits=FSDP_TP_SPLITS)
    assert_split_for_fsdp_tp(assert_checkpoint_equals(tmp_path / "split", expected_ours(sd), stacked=True))


def test_safetensors_qwen2_bias_tied_bf16(tmp_path):
    src = tmp_path / "qwen"
    sd = _save_tiny("qwen2", src, dtype=torch.bfloat16)
    convert(src, tmp_path / "out", progress=False)
    r = assert_checkpoint_equals(tmp_path / "out", expected_ours(sd, tied=True))
    assert from_hf_config(r.hf_config)[1].attention_bias and from_hf_config(r.hf_config)[1].tie_word_embeddings
    assert r.index.tensors["layers.1.attn.k_proj.bias"].dtype == "bfloat16"
    assert "lm_head.kernel" not in r.index.tensors
    convert(src, tmp_path / "f32", dtype="float32", progress=False)
    assert CheckpointReader(tmp_path / "f32").index.tensors["layers.1.attn.k_proj.bias"].dtype == "float32"


def _easydel_params(sd: dict[str, np.ndarray]) -> dict:
    """The flax Llama parameter tree the EasyDeL/fjformer checkpointer saved (kernels [in, out])."""
    layers = {}
    for i in range(2):
        h = f"model.layers.{i}."
        layers[str(i)] = {
            "self_attn": {p: {"kernel": sd[h + f"self_attn.{p}.weight"].T} for p in
                          ("q_proj", "k_proj", "v_proj", "o_proj")},
            "mlp": {p: {"kernel": sd[h + f"mlp.{p}.weight"].T} for p in ("gate_proj", "up_proj", "down_proj")},
            "input_layernorm": {"kernel": sd[h + "input_layernorm.weight"]},
            "post_attention_layernorm": {"kernel": sd[h + "post_attention_layernorm.weight"]},
        }
    return {"model": {"embed_tokens": {"embedding": sd["model.embed_tokens.weight"]}, "layers": layers,
                      "norm": {"kernel": sd["model.norm.weight"]}},
            "lm_head": {"kernel": sd["lm_head.weight"].T}}


def write_easydel_stream(path: Path, tree: dict) -> None:
    """Exactly how the streaming checkpointer wrote: packer.pack((key, flax to_bytes(value))) per leaf."""
    from flax.serialization import to_bytes, to_state_dict
    from flax.traverse_util import flatten_dict

    packer = msgpack.Packer()
    with open(path, "wb") as f:
        for key, value in flatten_dict(to_state_dict(tree)).items():
            f.write(packer.pack((key, to_bytes(np.ascontiguousarray(value)))))


@pytest.mark.parametrize("wrapped", [True, False], ids=["params-prefix", "bare"])
def test_easydel_stream_converts_like_safetensors(tiny_llama, tmp_path, wrapped):
    src, sd = tiny_llama
    tree = _easydel_params(sd)
    stream = tmp_path / "streaming_params"
    write_easydel_stream(stream, {"params": tree} if wrapped else tree)
    assert detect_format(stream) == "easydel"
    convert(stream, tmp_path / "out", hf_config=str(src / "config.json"), progress=False)
    assert_checkpoint_equals(tmp_path / "out", expected_ours(sd))
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    convert(stream, tmp_path / "split", hf_config=str(src / "config.json"), progress=False, splits=FSDP_TP_SPLITS)
    assert_split_for_fsdp_tp(assert_checkpoint_equals(tmp_path / "split", expected_ours(sd), stacked=True))


def test_easydel_errors(tiny_llama, tmp_path):
    src, sd = tiny_llama
    stream = tmp_path / "streaming_params"
    write_easydel_stream(stream, {"params": _easydel_params(sd)})
    with pytest.raises(CheckpointError, match="pass --hf-config"):
        convert(stream, tmp_path / "a", src_format="easydel", progress=False)
    tree = _easydel_params(sd)
    tree["model"]["layers"]["0"]["self_attn"]["rotary"] = {"kernel": np.zeros(3, np.float32)}
    write_easydel_stream(stream, tree)
    with pytest.raises(CheckpointError, match="'model/layers/0/self_attn/rotary/kernel' is not a known"):
        convert(stream, tmp_path / "b", src_format="easydel", hf_config=str(src), progress=False)
    tree = _easydel_params(sd)
    del tree["model"]["layers"]["1"]["mlp"]["up_proj"]
    write_easydel_stream(stream, tree)
    with pytest.raises(CheckpointError, match=r"lacks tensors the model needs: layers\.1\.mlp\.up_proj\.kernel"):
        convert(stream, tmp_path / "c", src_format="easydel", hf_config=str(src), progress=False)
    assert not (tmp_path / "c" / "index.json").exists()  # never a half-written checkpoint


def test_safetensors_errors(tiny_llama, tmp_path):
    src, _ = tiny_llama
    import shutil

    bad = tmp_path / "nocfg"
    shutil.copytree(src, bad)
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        convert(bad, tmp_path / "o1", progress=False)
    wrong = tmp_path / "wrongcfg"
    shutil.copytree(src, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight: source shape "
                                              r"\[8, 16\] does not match the config \(expected \[16, 16\]\)"):
        convert(wrong, tmp_path / "o2", progress=False)
    with pytest.raises(CheckpointError, match="destination already holds a checkpoint"):
        convert(src, _done(tmp_path, src), progress=False)
    (tmp_path / "junk.xyz").write_bytes(b"\x00\x01")
    with pytest.raises(CheckpointError, match="cannot tell the source format"):
        detect_format(tmp_path / "junk.xyz")
    with pytest.raises(CheckpointError, match="GGUF file does not exist"):
        convert(tmp_path / "missing.gguf", tmp_path / "o3", src_format="gguf", progress=False)


def _done(tmp_path: Path, src: Path) -> Path:
    out = tmp_path / "done"
    convert(src, out, progress=False)
    return out


def test_convert_command(tiny_llama, tmp_path, capsys):
    from raydeploy.cli import main

    src, sd = tiny_llama
    assert main(["convert", str(src), str(tmp_path / "c"), "--shard-size", "10KB", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "converted safetensors" in out and "21 tensors," in out and "bytes" in out
    r = CheckpointReader(tmp_path / "c")
    assert r.index.tensors["embed.embedding"].dtype == "bfloat16" and len(r.index.files) > 1
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "raydeploy convert:" in err and "nothing" in err and "does not exist" in err
    assert main(["convert", str(src), str(tmp_path / "e"), "--shard-size", "huge"]) == 1
    assert "'huge' is not a number" in capsys.readouterr().err
    fsdp_yaml = Path(__file__).resolve().parents[1] / "configs" / "cpu-fsdp.yaml"
    assert main(["convert", str(src), str(tmp_path / "s"), "--split-for", str(fsdp_yaml)]) == 0
    assert "split for" in capsys.readouterr().out
    assert_split_for_fsdp_tp(assert_checkpoint_equals(tmp_path / "s", expected_ours(sd), stacked=True))
    assert main(["convert", str(src), str(tmp_path / "st"), "--layers", "stacked"]) == 0
    assert "21 tensors (stored as 12, stacked over the layers)" in capsys.readouterr().out
    assert_checkpoint_equals(tmp_path / "st", expected_ours(sd), stacked=True)
    assert main(["convert", str(src), str(tmp_path / "pl"), "--split-for", str(fsdp_yaml), "--layers", "per-layer"]) == 0
    capsys.readouterr()
    r = assert_checkpoint_equals(tmp_path / "pl", expected_ours(sd))
    assert r.index.tensors["layers.0.mlp.up_proj.kernel"].splits == ((1, 2),) and r.index.version == 3
    assert main(["convert", str(src), str(tmp_path / "f"), "--split-for", str(tmp_path / "no.yaml")]) == 1
    err = capsys.readouterr().err
    assert "raydeploy convert:" in err and "no.yaml" in err
    assert not (tmp_path / "f" / "index.json").exists()


@pytest.mark.model
def test_demo_gguf_matches_transformers(demo_checkpoint, demo_gguf):
    """Our GGUF conversion (dequantize + Q/K un-permute + layout) equals what transformers' GGUF loader makes
    of the same tensors (its LlamaTensorProcessor un-permutes), for a sample of tensors."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    r = CheckpointReader(demo_checkpoint)
    cfg = from_hf_config(r.hf_config)[1]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (9, 3, 64, 30)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    gguf_to_hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in (0, 29):
        for g, h in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                     ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                     ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                     ("ffn_norm", "post_attention_layernorm")):
            gguf_to_hf[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
    sd = {}
    for t in GGUFReader(str(demo_gguf)).tensors:
        if t.name in gguf_to_hf:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            sd[gguf_to_hf[t.name]] = processor.process(w, t.name).weights
    assert len(sd) == len(gguf_to_hf)
    exp = expected_ours(sd, nh=9, nkv=3, hd=64, d=576, layers=(0, 29), tied=True)
    for n, a in exp.items():
        np.testing.assert_array_equal(r.read_tensor(n), a, err_msg=n)
    tok_cfg = demo_checkpoint / "tokenizer_config.json"
    assert (demo_checkpoint / "tokenizer.json").is_file() and tok_cfg.is_file()
    template = (demo_checkpoint / "chat_template.jinja")
    assert "<|im_start|>" in (template.read_text() if template.is_file() else tok_cfg.read_text())



def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's rope permutation of Q/K rows (what GGUF files store)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_tiny_round_trip_unpermutes_and_dequantizes(tmp_path):
    """A tiny Llama GGUF written with gguf.GGUFWriter the way llama.cpp does (permuted Q/K, mixed F32/F16/Q8_0)
    converts back to the original [out, in] weights in our layout."""
    import gguf

    v, d, f, nh, nkv, hd = 96, 64, 128, 4, 2, 16
    rng = np.random.default_rng(3)
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32),
                                 "model.norm.weight": rng.standard_normal(d).astype(np.float32),
                                 "lm_head.weight": rng.standard_normal((v, d)).astype(np.float32)}
    for i in range(2):
        h = f"model.layers.{i}."
        for n, shape in (("self_attn.q_proj", (nh * hd, d)), ("self_attn.k_proj", (nkv * hd, d)),
                         ("self_attn.v_proj", (nkv * hd, d)), ("self_attn.o_proj", (d, nh * hd)),
                         ("mlp.gate_proj", (f, d)), ("mlp.up_proj", (f, d)), ("mlp.down_proj", (d, f)),
                         ("input_layernorm", (d,)), ("post_attention_layernorm", (d,))):
            hf[h + n + ".weight"] = rng.standard_normal(shape).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    # the embedding and K are stored Q8_0: expected values are what Q8_0 keeps
    hf["model.embed_tokens.weight"] = gguf.quants.dequantize(gguf.quants.quantize(hf["model.embed_tokens.weight"], q8), q8)

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(v)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(hf["model.embed_tokens.weight"], q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.add_tensor("output.weight", hf["lm_head.weight"])
    for i in range(2):
        h = f"model.layers.{i}."
        k_perm = _llamacpp_permute(hf[h + "self_attn.k_proj.weight"], nkv)
        k_q8 = gguf.quants.quantize(k_perm, q8)
        # the original K as Q8_0 keeps it (quantization commutes with the row permutation)
        hf[h + "self_attn.k_proj.weight"] = gguf.quants.dequantize(
            gguf.quants.quantize(hf[h + "self_attn.k_proj.weight"], q8), q8)
        w.add_tensor(f"blk.{i}.attn_q.weight", _llamacpp_permute(hf[h + "self_attn.q_proj.weight"], nh))
        w.add_tensor(f"blk.{i}.attn_k.weight", k_q8, raw_dtype=q8)
        w.add_tensor(f"blk.{i}.attn_v.weight", hf[h + "self_attn.v_proj.weight"].astype(np.float16))
        w.add_tensor(f"blk.{i}.attn_output.weight", hf[h + "self_attn.o_proj.weight"])
        for g, n in (("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
                     ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{g}.weight", hf[h + n + ".weight"])
        hf[h + "self_attn.v_proj.weight"] = hf[h + "self_attn.v_proj.weight"].astype(np.float16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    assert detect_format(path) == "gguf"
    convert(path, tmp_path / "out", dtype="float32", progress=False)
    r = assert_checkpoint_equals(tmp_path / "out", expected_ours(hf, nh=nh, nkv=nkv, hd=hd, d=d))
    cfg = from_hf_config(r.hf_config)[1]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps) == (4, 2, 16, 500000.0, 1e-6)
    assert not cfg.tie_word_embeddings
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # none embedded in this file
    convert(path, tmp_path / "split", dtype="float32", progress=False, splits=FSDP_TP_SPLITS)
    assert_split_for_fsdp_tp(assert_checkpoint_equals(tmp_path / "split", expected_ours(hf, nh=nh, nkv=nkv, hd=hd,
                                                                                         d=d), stacked=True))


def test_gguf_rejects_other_architectures(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported"):
        convert(path, tmp_path / "out", progress=False)
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + b"\x00" * 8)
    with pytest.raises(CheckpointError, match="fake.gguf: not a readable GGUF file"):
        convert(tmp_path / "fake.gguf", tmp_path / "out2", progress=False)
