"""GGUF (llama.cpp) -> raydeploy checkpoint, for Llama-architecture files.

Reads tensors with `gguf.GGUFReader`, dequantizes them with `gguf.quants.dequantize` (quantized types
become float32; F16/BF16/F32 keep their type unless a dtype is asked for), undoes llama.cpp's rope
permutation of the Q and K weights, maps names with `layout.GGUF_NAMES`, builds a Hugging Face
`config.json` from the GGUF metadata, and saves the tokenizer (with its chat template) through
transformers, which can read a tokenizer out of a GGUF file.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from raydeploy.checkpoint.format import CheckpointError
from raydeploy.checkpoint.layout import (
    GGUF_IGNORED,
    GGUF_NAMES,
    NameMap,
    SplitPlan,
    cast,
    check_against_specs,
    to_ours,
)
from raydeploy.checkpoint.writer import CheckpointWriter
from raydeploy.model.spec import LlamaConfig


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


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], path: str, dtype: str = "keep"
                        ) -> dict[str, Any]:
    """A Hugging Face LlamaForCausalLM config.json built from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only 'llama')", path)

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full not in meta and default is None:
            raise CheckpointError(f"GGUF metadata key {full!r} is missing", path)
        return meta.get(full, default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        raise CheckpointError(f"GGUF metadata key {arch}.vocab_size is missing", path)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32" if dtype in ("keep", "float32") else dtype,
    }
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[ours] = int(v)
    return cfg


def unpermute_rope(w_oi: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf `permute`): per head, rows were reordered
    from [first half, second half] to interleaved pairs."""
    rows = w_oi.shape[0]
    w = w_oi.reshape(n_head, rows // n_head // 2, 2, *w_oi.shape[1:])
    return w.swapaxes(1, 2).reshape(w_oi.shape)


def convert_gguf(src: str | Path, dst: str | Path, dtype: str = "keep", shard_size_bytes: int = 1 << 30,
                 progress: bool = True, save_tokenizer: bool = True,
                 splits: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Convert one GGUF file into a checkpoint directory (storing tensors split for `splits`, see
    layout.SplitPlan). Returns {'bytes': ..., 'tensors': ...}."""
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
    names = {t.name for t in reader.tensors}
    meta = gguf_metadata(reader, str(src))
    hf_cfg = hf_config_from_gguf(meta, names, str(src), dtype)
    # a GGUF without an embedded tokenizer (tests, some exports) converts weights and config only
    save_tokenizer = save_tokenizer and "tokenizer.ggml.model" in meta
    cfg = LlamaConfig.from_hf_dict(hf_cfg)
    name_map = NameMap(GGUF_NAMES, GGUF_IGNORED, source="GGUF")
    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}

    shapes: dict[str, tuple[int, ...]] = {}
    plan = SplitPlan.build(cfg, splits)
    writer = CheckpointWriter(dst, shard_size_bytes=shard_size_bytes)
    try:
        for t in tqdm(reader.tensors, desc="convert gguf", unit="tensor", disable=not progress):
            mapped = name_map.lookup(t.name)
            if mapped is None:
                continue
            ours, kind = mapped
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            if t.tensor_type not in plain:
                w = w.astype(np.float32, copy=False)
            if t.tensor_type == GGMLQuantizationType.BF16:
                import ml_dtypes

                w = w.view(ml_dtypes.bfloat16) if w.dtype == np.uint16 else w
            # numpy shape of a GGUF tensor is [out, in] (GGUF lists dims innermost first)
            w = w.reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
            if ".attn_q." in t.name:
                w = unpermute_rope(w, cfg.num_heads)
            elif ".attn_k." in t.name:
                w = unpermute_rope(w, cfg.num_kv_heads)
            out = cast(to_ours(kind, w, cfg, name=ours), dtype)
            shapes[ours] = tuple(out.shape)
            writer.add(ours, out, split=plan.for_tensor(ours, out))
        check_against_specs(shapes, cfg, str(src))
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
