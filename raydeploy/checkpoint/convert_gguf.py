"""GGUF (llama.cpp) -> raydeploy checkpoint, for every family llama.cpp names (see `GGUF_ARCHITECTURES`).

Reads tensors with `gguf.GGUFReader`, dequantizes them with `gguf.quants.dequantize` (quantized types
become float32; F16/BF16/F32 keep their type unless a dtype is asked for), resolves the model family from
`general.architecture` through the registry (`llama` with `expert_count` set is Mixtral, as llama.cpp writes
it), builds a Hugging Face `config.json` for that family from the GGUF metadata, maps names with the family's
GGUF table (`Family.gguf_names`) and undoes what llama.cpp's `convert_hf_to_gguf.py` did to the weights:
- `llama` (Llama, Mistral, Mixtral): Q and K rows rope-permuted (`unpermute_rope`);
- `gemma3`: every norm weight stored as (1 + w) (`GGUF_NORM_PLUS_ONE` rows: w = stored - 1);
- MoE: each layer's experts stacked as [E, out, in] (`GGUF_STACKED_EXPERTS_OI`: -> [E, in, out]).
`qwen3` and `qwen3moe` (NeoX rope) are stored as transformers has them. It saves the tokenizer (with its chat
template) through transformers, which can read a tokenizer out of a GGUF file.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from raydeploy.checkpoint.format import CheckpointError
from raydeploy.checkpoint.layout import (
    NameMap,
    TensorSink,
    cast,
    check_against_specs,
    to_ours,
)
from raydeploy.checkpoint.writer import CheckpointWriter
from raydeploy.model.names import GGUF_NORM_PLUS_ONE, GGUF_STACKED_EXPERTS_OI
from raydeploy.model.registry import Family, UnknownModelType, family_for

# GGUF general.architecture -> the Hugging Face model_type it is served as ("llama" with experts: "mixtral").
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "qwen3moe": "qwen3_moe",
}
# Architectures whose Q/K rows llama.cpp's converter permutes for its rope layout (LlamaModel.permute).
ROPE_PERMUTED = frozenset({"llama"})
# Gemma 3 as llama.cpp runs it: local RoPE base and the local/global pattern when the GGUF does not say.
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6


def _f32(v: float) -> float:
    """GGUF stores float32 metadata; print it back the way the original config had it (1e-05, not 9.99e-06)."""
    return float(f"{float(v):.7g}")


def gguf_metadata(reader: Any, path: str) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            continue
        try:
            meta[key] = field.contents()
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read GGUF metadata key {key!r}: {e}", path) from e
    return meta


def supported_architectures() -> tuple[str, ...]:
    return (*sorted(GGUF_ARCHITECTURES), "llama with experts (Mixtral)")


def gguf_model_type(meta: Mapping[str, Any], path: str) -> str:
    """The Hugging Face model_type of a GGUF; an architecture we do not serve names the supported ones."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(supported_architectures())})", path)
    if arch == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        return "mixtral"
    return GGUF_ARCHITECTURES[str(arch)]


def hf_config_from_gguf(meta: dict[str, Any], tensors: Mapping[str, tuple[int, ...]], path: str,
                        dtype: str = "keep") -> dict[str, Any]:
    """A Hugging Face config.json dict for the GGUF's family, built from its metadata (as transformers'
    GGUF loader maps it) and, where the metadata is silent, its tensor shapes (`tensors`: numpy order)."""
    model_type = gguf_model_type(meta, path)
    arch = str(meta["general.architecture"])

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if meta.get(full) is None and default is None:
            raise CheckpointError(f"GGUF metadata key {full!r} is missing", path)
        return meta.get(full, default) if meta.get(full) is not None else default

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:  # llama.cpp writes the vocabulary as tokens; the embedding's rows are its size
        if "token_embd.weight" not in tensors:
            raise CheckpointError(f"GGUF metadata key {arch}.vocab_size is missing (and there is no "
                                  "token_embd.weight to take it from)", path)
        vocab = tensors["token_embd.weight"][0]
    layers = int(get("block_count"))
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": _f32(get("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6 if arch == "gemma3" else 1e-5)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32" if dtype in ("keep", "float32") else dtype,
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if scaling != "linear" or factor is None:
            raise CheckpointError(f"GGUF rope scaling {scaling!r} (factor {factor}) is not supported (only "
                                  f"'linear' with {arch}.rope.scaling.factor)", path)
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(factor)}

    if model_type in ("llama", "qwen3"):
        cfg.update(architectures=["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
                   intermediate_size=int(get("feed_forward_length")), hidden_act="silu")
    elif model_type == "gemma3_text":
        cfg.update(_gemma3_fields(meta, arch, layers, hidden, heads, head_dim, path))
        cfg["intermediate_size"] = int(get("feed_forward_length"))
    else:  # qwen3_moe, mixtral
        cfg.update(_moe_fields(meta, arch, model_type, tensors, path))
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[ours] = int(v)
    return cfg


def _gemma3_fields(meta: Mapping[str, Any], arch: str, layers: int, hidden: int, heads: int, head_dim: int,
                   path: str) -> dict[str, Any]:
    """Gemma 3's own settings. llama.cpp writes the window, the global RoPE base and the final soft-cap; it
    runs the local layers with RoPE base 10000 and every 6th layer global unless the GGUF says otherwise, and
    scales the queries by head_dim**-0.5, except for the 62-layer 27B model (hidden / heads)."""
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None:
        raise CheckpointError(f"GGUF metadata key '{arch}.attention.sliding_window' is missing", path)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer, True = sliding
        if len(pattern) != layers:
            raise CheckpointError(f"GGUF metadata {arch}.attention.sliding_window_pattern has {len(pattern)} "
                                  f"entries for {layers} layers", path)
        types = ["sliding_attention" if bool(p) else "full_attention" for p in pattern]
    else:
        n = int(pattern or GEMMA3_SLIDING_WINDOW_PATTERN)
        types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    out: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window),
        "layer_types": types,
        "rope_local_base_freq": _f32(meta.get(f"{arch}.rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_THETA),
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        v = meta.get(f"{arch}.{key}")
        if v is not None:
            out[key] = _f32(v)
    return out


def _moe_fields(meta: Mapping[str, Any], arch: str, model_type: str, tensors: Mapping[str, tuple[int, ...]],
                path: str) -> dict[str, Any]:
    experts, used = meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count")
    if not experts or not used:
        raise CheckpointError(f"GGUF metadata keys '{arch}.expert_count' and '{arch}.expert_used_count' are "
                              f"needed for {model_type} (got {experts} and {used})", path)
    # each expert's hidden units: the metadata (Mixtral: llama's feed_forward_length), else the stacked gate
    # [E, F, D]
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    ffn_key = f"{arch}.feed_forward_length" if model_type == "mixtral" else f"{arch}.expert_feed_forward_length"
    ffn: Any = meta.get(ffn_key)
    if ffn is None:
        if gate is None or len(gate) != 3:
            raise CheckpointError(f"GGUF metadata key {ffn_key!r} is missing (and there is no 3-d "
                                  "blk.0.ffn_gate_exps.weight to take it from)", path)
        ffn = gate[1]
    moe_ffn = int(ffn)
    if model_type == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "num_local_experts": int(experts),
                "num_experts_per_tok": int(used), "intermediate_size": moe_ffn, "hidden_act": "silu",
                "sliding_window": None}
    # llama.cpp's qwen3moe always renormalises the top-k weights (transformers' GGUF loader sets the same)
    norm = meta.get(f"{arch}.expert_weights_norm")
    return {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": int(experts), "num_experts_per_tok": int(used),
            "moe_intermediate_size": moe_ffn, "intermediate_size": int(meta.get(f"{arch}.feed_forward_length")
                                                                      or moe_ffn),
            "norm_topk_prob": True if norm is None else bool(norm), "hidden_act": "silu",
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def rope_freq_factors(factors: np.ndarray, hf_cfg: Mapping[str, Any], path: str) -> dict[str, Any]:
    """`rope_freqs.weight`: the per-frequency divisors llama.cpp stores for Llama 3 style rope scaling (its
    converter computes them from the Hugging Face `llama3` rope_scaling, which the GGUF does not keep). They
    become `rope_scaling: {rope_type: freq_factors, factors: [...]}`: the inverse frequencies divided by them,
    as llama.cpp applies them."""
    half = int(hf_cfg["head_dim"]) // 2
    if factors.shape != (half,) or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise CheckpointError(f"GGUF tensor rope_freqs.weight must hold {half} positive factors (head_dim / 2), "
                              f"got shape {factors.shape}", path)
    if hf_cfg.get("rope_scaling"):
        raise CheckpointError(f"GGUF has both rope_freqs.weight and rope scaling {hf_cfg['rope_scaling']}; "
                              f"only one is supported", path)
    return {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}


def unpermute_rope(w_oi: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf `permute`): per head, rows were reordered
    from [first half, second half] to interleaved pairs."""
    rows = w_oi.shape[0]
    w = w_oi.reshape(n_head, rows // n_head // 2, 2, *w_oi.shape[1:])
    return w.swapaxes(1, 2).reshape(w_oi.shape)


def gguf_to_ours(kind: str, w: np.ndarray, cfg: Any, name: str) -> np.ndarray:
    """`layout.to_ours` plus the GGUF-only kinds of the registry."""
    if kind == GGUF_NORM_PLUS_ONE:
        if w.ndim != 1:
            raise CheckpointError(f"expected a 1-d norm weight, found shape {list(w.shape)}", tensor=name)
        return (w.astype(np.float32) - np.float32(1.0)).astype(w.dtype)
    if kind == GGUF_STACKED_EXPERTS_OI:
        if w.ndim != 3:
            raise CheckpointError(f"expected stacked experts [experts, out, in], found shape {list(w.shape)}",
                                  tensor=name)
        return w.swapaxes(1, 2)
    return to_ours(kind, w, cfg, name=name)


def source_name(table: Sequence[tuple[str, str, str]], ours: str) -> str:
    """The GGUF name a table maps to our tensor `ours` (for messages): the inverse of the table's row."""
    for pattern, target, _ in table:
        rx = re.escape(target).replace(r"\{layer\}", r"(?P<layer>\d+)")
        m = re.fullmatch(rx, ours)
        if m:
            name = pattern.replace(r"(?P<layer>\d+)", m.groupdict().get("layer", ""))
            return name.replace("\\", "")
    return ours


def family_of(meta: Mapping[str, Any], path: str) -> Family:
    model_type = gguf_model_type(meta, path)
    try:
        family = family_for(model_type)
    except UnknownModelType as e:  # pragma: no cover - GGUF_ARCHITECTURES only names registered types
        raise CheckpointError(str(e), path) from e
    if family.gguf_names is None:
        raise CheckpointError(f"the {family.name} family has no GGUF name table", path)
    return family


def convert_gguf(src: str | Path, dst: str | Path, dtype: str = "keep", shard_size_bytes: int = 1 << 30,
                 progress: bool = True, save_tokenizer: bool = True,
                 splits: Mapping[str, int] | None = None, stacked: bool = True) -> dict[str, Any]:
    """Convert one GGUF file into a checkpoint directory (storing tensors split for `splits` and, with
    `stacked`, stacked over the layers: see layout.TensorSink). Returns {'bytes': ..., 'tensors': ...}."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader
    from tqdm import tqdm

    src = Path(src)
    if not src.is_file():
        raise CheckpointError("GGUF file does not exist", str(src))
    try:
        reader = GGUFReader(str(src))
    except (ValueError, OSError) as e:
        raise CheckpointError(f"not a readable GGUF file: {e}", str(src)) from e
    # numpy order of each tensor's shape (GGUF lists dims innermost first)
    tensor_shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    meta = gguf_metadata(reader, str(src))
    family = family_of(meta, str(src))
    permuted = meta.get("general.architecture") in ROPE_PERMUTED
    hf_cfg = hf_config_from_gguf(meta, tensor_shapes, str(src), dtype)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        hf_cfg["rope_scaling"] = rope_freq_factors(np.asarray(freqs.data, np.float32), hf_cfg, str(src))
    # a GGUF without an embedded tokenizer (tests, some exports) converts weights and config only
    save_tokenizer = save_tokenizer and "tokenizer.ggml.model" in meta
    try:
        cfg = family.config_from_hf(dict(hf_cfg))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"GGUF metadata does not make a usable {family.name} config: {e}", str(src)) from e
    specs = family.param_specs(cfg)
    table = family.gguf_names or ()
    name_map = NameMap(table, family.gguf_ignored, source="GGUF")
    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}

    shapes: dict[str, tuple[int, ...]] = {}
    writer = CheckpointWriter(dst, shard_size_bytes=shard_size_bytes)
    sink = TensorSink(writer, family, cfg, splits, stacked)
    try:
        for t in tqdm(reader.tensors, desc="convert gguf", unit="tensor", disable=not progress):
            mapped = name_map.lookup(t.name)
            if mapped is None:
                continue
            ours, kind = mapped
            if ours in shapes:
                raise CheckpointError(f"tensor {t.name} appears twice (as {ours})", str(src), tensor=t.name)
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            if t.tensor_type not in plain:
                w = w.astype(np.float32, copy=False)
            if t.tensor_type == GGMLQuantizationType.BF16:
                import ml_dtypes

                w = w.view(ml_dtypes.bfloat16) if w.dtype == np.uint16 else w
            w = w.reshape(tensor_shapes[t.name])
            if permuted and ".attn_q." in t.name:
                w = unpermute_rope(w, cfg.num_heads)
            elif permuted and ".attn_k." in t.name:
                w = unpermute_rope(w, cfg.num_kv_heads)
            out = cast(gguf_to_ours(kind, w, cfg, t.name), dtype)
            shapes[ours] = tuple(out.shape)
            sink.add(ours, out)
        missing = [n for n in specs if n not in shapes]
        if missing:
            named = [source_name(table, n) for n in missing]
            more = f" (and {len(named) - 5} more)" if len(named) > 5 else ""
            raise CheckpointError(f"GGUF lacks tensors the {family.name} model needs: {', '.join(named[:5])}{more}",
                                  str(src), tensor=named[0])
        check_against_specs(shapes, cfg, str(src), specs)
    except BaseException:
        writer.abort()
        raise
    with tempfile.TemporaryDirectory(prefix="raydeploy-gguf-tok-") as tok_dir:
        if save_tokenizer:
            save_gguf_tokenizer(src, Path(tok_dir))
        writer.close(config=hf_cfg, tokenizer_dir=tok_dir if save_tokenizer else None)
    return {"bytes": writer.bytes_written, "tensors": len(shapes)}


def save_gguf_tokenizer(src: Path, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json, chat template and special tokens, read from the GGUF."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except (ValueError, KeyError, OSError, ImportError) as e:
        raise CheckpointError(f"cannot build the tokenizer from the GGUF metadata: {e!r}", str(src)) from e
    tok.save_pretrained(str(out_dir))
