"""Foreign parameter names -> ours, as tables of data: (source regex, our name, layout kind) per tensor.

Our names are `raydeploy.model.spec.param_specs`'s. The layout kind says how a source array is rearranged
into ours (`raydeploy.checkpoint.layout.to_ours` applies the common kinds, `raydeploy.checkpoint.convert_gguf`
the GGUF-only ones). Each family's `Family` (`raydeploy.model.registry`) carries its tables, so the model
package owns them and the checkpoint package reads them. Hugging Face PyTorch `nn.Linear` weights are
[out, in]; GGUF tensors, once dequantized (and Q/K un-permuted), have the same [out, in] layout;
EasyDeL/Flax kernels are already [in, out].
"""

from __future__ import annotations

from collections.abc import Sequence

# Layout kinds. "_oi" sources are [out, in] (PyTorch / GGUF), "_io" sources are [in, out] (Flax).
COPY = "copy"
LINEAR_OI = "linear_oi"        # [out, in] -> [in, out]
Q_OI = "q_oi"                  # [nh*hd, d] -> [d, nh, hd]
KV_OI = "kv_oi"                # [nkv*hd, d] -> [d, nkv, hd]
O_OI = "o_oi"                  # [d, nh*hd] -> [nh, hd, d]
Q_IO = "q_io"                  # [d, nh*hd] -> [d, nh, hd]
KV_IO = "kv_io"                # [d, nkv*hd] -> [d, nkv, hd]
O_IO = "o_io"                  # [nh*hd, d] -> [nh, hd, d]
Q_BIAS = "q_bias"              # [nh*hd] -> [nh, hd]
KV_BIAS = "kv_bias"            # [nkv*hd] -> [nkv, hd]

_L = r"(?P<layer>\d+)"

# Hugging Face transformers names (Llama, Mistral, Qwen2, SmolLM2 share them).
HF_NAMES: Sequence[tuple[str, str, str]] = (
    (r"model\.embed_tokens\.weight", "embed.embedding", COPY),
    (rf"model\.layers\.{_L}\.input_layernorm\.weight", "layers.{layer}.attn_norm.scale", COPY),
    (rf"model\.layers\.{_L}\.self_attn\.q_proj\.weight", "layers.{layer}.attn.q_proj.kernel", Q_OI),
    (rf"model\.layers\.{_L}\.self_attn\.k_proj\.weight", "layers.{layer}.attn.k_proj.kernel", KV_OI),
    (rf"model\.layers\.{_L}\.self_attn\.v_proj\.weight", "layers.{layer}.attn.v_proj.kernel", KV_OI),
    (rf"model\.layers\.{_L}\.self_attn\.q_proj\.bias", "layers.{layer}.attn.q_proj.bias", Q_BIAS),
    (rf"model\.layers\.{_L}\.self_attn\.k_proj\.bias", "layers.{layer}.attn.k_proj.bias", KV_BIAS),
    (rf"model\.layers\.{_L}\.self_attn\.v_proj\.bias", "layers.{layer}.attn.v_proj.bias", KV_BIAS),
    (rf"model\.layers\.{_L}\.self_attn\.o_proj\.weight", "layers.{layer}.attn.o_proj.kernel", O_OI),
    (rf"model\.layers\.{_L}\.post_attention_layernorm\.weight", "layers.{layer}.mlp_norm.scale", COPY),
    (rf"model\.layers\.{_L}\.mlp\.gate_proj\.weight", "layers.{layer}.mlp.gate_proj.kernel", LINEAR_OI),
    (rf"model\.layers\.{_L}\.mlp\.up_proj\.weight", "layers.{layer}.mlp.up_proj.kernel", LINEAR_OI),
    (rf"model\.layers\.{_L}\.mlp\.down_proj\.weight", "layers.{layer}.mlp.down_proj.kernel", LINEAR_OI),
    (r"model\.norm\.weight", "final_norm.scale", COPY),
    (r"lm_head\.weight", "lm_head.kernel", LINEAR_OI),
)
# Buffers some exports carry that are not parameters.
HF_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")

# llama.cpp GGUF names (after dequantization: [out, in] like PyTorch; Q/K still rope-permuted).
GGUF_NAMES: Sequence[tuple[str, str, str]] = (
    (r"token_embd\.weight", "embed.embedding", COPY),
    (rf"blk\.{_L}\.attn_norm\.weight", "layers.{layer}.attn_norm.scale", COPY),
    (rf"blk\.{_L}\.attn_q\.weight", "layers.{layer}.attn.q_proj.kernel", Q_OI),
    (rf"blk\.{_L}\.attn_k\.weight", "layers.{layer}.attn.k_proj.kernel", KV_OI),
    (rf"blk\.{_L}\.attn_v\.weight", "layers.{layer}.attn.v_proj.kernel", KV_OI),
    (rf"blk\.{_L}\.attn_q\.bias", "layers.{layer}.attn.q_proj.bias", Q_BIAS),
    (rf"blk\.{_L}\.attn_k\.bias", "layers.{layer}.attn.k_proj.bias", KV_BIAS),
    (rf"blk\.{_L}\.attn_v\.bias", "layers.{layer}.attn.v_proj.bias", KV_BIAS),
    (rf"blk\.{_L}\.attn_output\.weight", "layers.{layer}.attn.o_proj.kernel", O_OI),
    (rf"blk\.{_L}\.ffn_norm\.weight", "layers.{layer}.mlp_norm.scale", COPY),
    (rf"blk\.{_L}\.ffn_gate\.weight", "layers.{layer}.mlp.gate_proj.kernel", LINEAR_OI),
    (rf"blk\.{_L}\.ffn_up\.weight", "layers.{layer}.mlp.up_proj.kernel", LINEAR_OI),
    (rf"blk\.{_L}\.ffn_down\.weight", "layers.{layer}.mlp.down_proj.kernel", LINEAR_OI),
    (r"output_norm\.weight", "final_norm.scale", COPY),
    (r"output\.weight", "lm_head.kernel", LINEAR_OI),
)
GGUF_IGNORED = (r"rope_freqs\.weight",)

# EasyDeL / flax Llama parameter paths joined with "/" (a leading "params/" is stripped first).
EASYDEL_NAMES: Sequence[tuple[str, str, str]] = (
    (r"model/embed_tokens/embedding", "embed.embedding", COPY),
    (rf"model/layers/{_L}/input_layernorm/(kernel|weight|scale)", "layers.{layer}.attn_norm.scale", COPY),
    (rf"model/layers/{_L}/self_attn/q_proj/kernel", "layers.{layer}.attn.q_proj.kernel", Q_IO),
    (rf"model/layers/{_L}/self_attn/k_proj/kernel", "layers.{layer}.attn.k_proj.kernel", KV_IO),
    (rf"model/layers/{_L}/self_attn/v_proj/kernel", "layers.{layer}.attn.v_proj.kernel", KV_IO),
    (rf"model/layers/{_L}/self_attn/q_proj/bias", "layers.{layer}.attn.q_proj.bias", Q_BIAS),
    (rf"model/layers/{_L}/self_attn/k_proj/bias", "layers.{layer}.attn.k_proj.bias", KV_BIAS),
    (rf"model/layers/{_L}/self_attn/v_proj/bias", "layers.{layer}.attn.v_proj.bias", KV_BIAS),
    (rf"model/layers/{_L}/self_attn/o_proj/kernel", "layers.{layer}.attn.o_proj.kernel", O_IO),
    (rf"model/layers/{_L}/post_attention_layernorm/(kernel|weight|scale)", "layers.{layer}.mlp_norm.scale", COPY),
    (rf"model/layers/{_L}/mlp/gate_proj/kernel", "layers.{layer}.mlp.gate_proj.kernel", COPY),
    (rf"model/layers/{_L}/mlp/up_proj/kernel", "layers.{layer}.mlp.up_proj.kernel", COPY),
    (rf"model/layers/{_L}/mlp/down_proj/kernel", "layers.{layer}.mlp.down_proj.kernel", COPY),
    (r"model/norm/(kernel|weight|scale)", "final_norm.scale", COPY),
    (r"lm_head/kernel", "lm_head.kernel", COPY),
)


# GGUF-only layout kinds (raydeploy.checkpoint.convert_gguf applies them):
GGUF_NORM_PLUS_ONE = "gguf_norm_plus_one"  # llama.cpp stores Gemma's (1 + w) norm weights; we keep w
GGUF_STACKED_EXPERTS_OI = "gguf_stacked_experts_oi"  # llama.cpp's stacked experts [E, out, in] -> [E, in, out]
