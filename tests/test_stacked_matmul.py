"""The GPU's matmul of few rows by one layer of a stacked weight (`raydeploy.engine.matmul.pallas_gpu`), in Pallas
interpret mode: against numpy, with the layer index traced inside a scan as the engine's layer loop has it;
bfloat16 stacks, and int8 / float8_e4m3fn stacks with their per-column scales (`raydeploy.model.quant`) against
XLA's dot of the dequantized weight, alone, through the backend (`Quantized` layer slices, split over a mesh)
and in an engine that quantizes while loading. The compiled kernel runs in tests/test_gpu.py; the bfloat16
engine with it in tests/test_engine_families.py."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.config import EngineConfig, ModelConfig, load_config
from raydeploy.engine.attention import Attention, xla
from raydeploy.engine.matmul import pallas_gpu as stacked_matmul
from raydeploy.engine.matmul.pallas_gpu import PallasGpu, blocks_for, merged_spec
from raydeploy.loading import build_engine
from raydeploy.model.projection import LayerSlice, dot
from raydeploy.model.quant import Quantized
from raydeploy.model.sharding import build_mesh, merge_rules
from tests.jaxpr_walk import walk
from tests.test_engine_families import MAX_SEQ_LEN, _convert, _engine_greedy, _step_jaxpr
from tests.test_families import TINY


def _bf16(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape).astype(jnp.bfloat16)


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("k,n", [(256, 512), (1024, 128)])
def test_each_layer_of_the_stack(rows, k, n):
    """Every layer's product, the index traced (a scan over layers), K split over several programs (1024 x 128:
    8 steps of K in 8 splits) or not; rows padded to 16 and beyond it."""
    layers = 3
    w = _bf16((layers, k, n), 1)
    x = _bf16((rows, k), 2)
    _, _, splits = blocks_for(k, n)
    if k == 1024:
        assert splits > 1  # the split partial sums are exercised

    def body(_: None, i: jax.Array) -> tuple[None, jax.Array]:
        return None, stacked_matmul.stacked_matmul(x, w, i, interpret=True)

    _, got = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(layers, dtype=jnp.int32)))()
    want = np.einsum("mk,lkn->lmn", np.asarray(x, np.float32), np.asarray(w, np.float32))
    assert got.shape == (layers, rows, n) and got.dtype == jnp.bfloat16
    # bfloat16 output: within a rounding of the float32 sum
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    assert not np.allclose(np.asarray(got[0], np.float32), want[1], atol=1e-2 * np.abs(want).max())


def _quantize(w: np.ndarray, dtype: str) -> tuple[jax.Array, jax.Array]:
    """Symmetric per output column over K ([L, K, N] -> data [L, K, N], scales [L, N]), in numpy: the reference
    the kernel's in-kernel conversion is checked against."""
    top = {"int8": 127.0, "float8_e4m3fn": 448.0}[dtype]
    scale = np.maximum(np.abs(w).max(axis=1), 1e-8) / top
    q = w / scale[:, None, :]
    data = jnp.asarray(np.clip(np.round(q), -127, 127).astype(np.int8)) if dtype == "int8" else \
        jnp.asarray(q, jnp.float8_e4m3fn)
    return data, jnp.asarray(scale, jnp.float32)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows,k,n", [(1, 256, 512), (7, 1024, 128), (16, 128, 96), (40, 512, 256)])
def test_quantized_stack_equals_dot_on_the_dequantized_weight(dtype, rows, k, n):
    """An int8 / float8 stack read in place with its per-column scales equals XLA's `dot` of bfloat16 rows by
    that layer dequantized (data * scale, float32), for every layer with the index traced: the conversion is
    exact, so the only differences are the order of float32 sums (1024 x 128: K split over 8 programs)."""
    layers = 3
    rng = np.random.default_rng(k + n + rows)
    w = rng.normal(size=(layers, k, n)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(layers, 1, n))
    data, scale = _quantize(w, dtype)
    x = _bf16((rows, k), 5)

    def body(_: None, i: jax.Array) -> tuple[None, jax.Array]:
        return None, stacked_matmul.stacked_matmul(x, data, i, scale, interpret=True, out_dtype=jnp.float32)

    _, got = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(layers, dtype=jnp.int32)))()
    deq = np.asarray(data.astype(jnp.float32)) * np.asarray(scale)[:, None, :]
    want = np.stack([np.asarray(dot(x.astype(jnp.float32), jnp.asarray(deq[i]))) for i in range(layers)])
    assert got.shape == (layers, rows, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the scales were applied (not the raw integers), and each layer's own
    raw = np.asarray(x, np.float32) @ np.asarray(data[1].astype(jnp.float32))
    assert not np.allclose(np.asarray(got[1]), raw, rtol=1e-2)
    assert not np.allclose(np.asarray(got[0]), want[1], rtol=1e-2)
    # the layer's own scales [N], as a layer scan slices them, and bfloat16 out as the model's projections give it
    y = stacked_matmul.stacked_matmul(x, data, jnp.int32(2), scale[2], interpret=True)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), want[2], rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_quantized_stack_needs_its_scales():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    q = jnp.zeros((3, 64, 128), jnp.int8)
    with pytest.raises(ValueError, match="a int8 weight needs scales"):
        stacked_matmul.stacked_matmul(x, q, jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="a bfloat16 weight takes no scales"):
        stacked_matmul.stacked_matmul(x, q.astype(jnp.bfloat16), jnp.int32(0), jnp.ones((3, 128)), interpret=True)
    with pytest.raises(ValueError, match=r"scales \(64,\) for a stacked weight \(3, 64, 128\) \(expected the "
                                         r"layer's \(128,\) or every layer's \(3, 128\)\)"):
        stacked_matmul.stacked_matmul(x, q, jnp.int32(0), jnp.ones((64,)), interpret=True)


def test_blocks_and_their_limits():
    assert blocks_for(2048, 8192) == (128, 128, 4)        # Llama-3.2-1B gate/up: 64 x 4 = 256 programs
    assert blocks_for(8192, 2048) == (128, 128, 16)       # its down projection: K split 16 ways
    assert blocks_for(64, 96) == (32, 64, 1)
    with pytest.raises(ValueError, match=r"a \[100, 96\] weight has no power-of-two blocks of at least 16"):
        blocks_for(100, 96)


def test_applies_only_to_layer_slices_of_few_bfloat16_rows():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    stack = jnp.zeros((2, 64, 128), jnp.bfloat16)
    w = LayerSlice(stack, jnp.int32(1))
    x = jnp.zeros((8, 64), jnp.float32)
    mm = PallasGpu(mesh, ("dp",), interpret=True)
    assert mm.applies(x, w)
    assert not mm.applies(x, stack[1])  # a plain array: XLA reads it in place
    assert not mm.applies(x, w, out_first=True)
    assert not mm.applies(x, LayerSlice(stack.astype(jnp.float32), jnp.int32(1)))
    assert not mm.applies(jnp.zeros((stacked_matmul.MAX_ROWS + 1, 64)), w)
    # no power-of-two blocks of at least 16 in a 100-wide weight
    assert mm.kernel(x, LayerSlice(jnp.zeros((2, 64, 100), jnp.bfloat16), jnp.int32(0))) is None
    y = mm.kernel(x + 1, w)
    assert y is not None and y.shape == (8, 128) and y.dtype == jnp.float32
    wide = LayerSlice(jnp.ones((2, 64, 100), jnp.bfloat16), jnp.int32(0))  # `matmul` leaves it to XLA's dot
    np.testing.assert_allclose(np.asarray(mm.matmul(x + 1, wide)), np.full((8, 100), 64.0))


def test_wrong_shapes_are_named():
    with pytest.raises(ValueError, match=r"x \[2, 32\] against a stacked weight \(3, 64, 128\)"):
        stacked_matmul.stacked_matmul(jnp.zeros((2, 32), jnp.bfloat16), jnp.zeros((3, 64, 128), jnp.bfloat16),
                                      jnp.int32(0), interpret=True)


def test_merged_spec_carries_a_split_through_merged_dims():
    assert merged_spec((None, "tp", None), (64, 4, 16), (64, 64)) == (None, "tp")      # [embed, heads, hd]
    assert merged_spec(("tp", None, None), (4, 16, 64), (64, 64)) == ("tp", None)      # [heads, hd, embed]
    assert merged_spec((None, None), (64, 96), (64, 96)) == (None, None)
    assert merged_spec((None, None, "tp"), (64, 4, 16), (64, 64)) is None              # a split minor dim
    assert merged_spec((None, None), (64, 96), (96, 64)) is None                       # not a merge


@pytest.mark.parametrize("split", ["columns", "rows", "both", "replicated"])
def test_each_device_multiplies_its_shard(split):
    """Over a dp=2 x tp=2 mesh (rows over dp): a weight split by columns over tp keeps the split in the output; one
    split by rows (K) sums the devices' parts over tp; both at once; and replicated weights (no specs). All
    equal numpy."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    entry = {"columns": (None, None, "tp"), "rows": (None, "tp", None), "both": (None, "tp", "dp"),
             "replicated": (None, None, None)}[split]
    layers, k, n = 2, 128, 256
    stack = _bf16((layers, k, n), 3)
    x = _bf16((8, k), 4).astype(jnp.float32)
    specs = None if split == "replicated" else {"mlp.up_proj.kernel": PartitionSpec(*entry)}

    @jax.jit
    def run(x: jax.Array, stack: jax.Array) -> jax.Array | None:
        mm = PallasGpu(mesh, ("dp",), interpret=True, specs=specs)
        return mm.kernel(x, LayerSlice(stack, jnp.int32(1), name="mlp.up_proj.kernel"))

    stack = jax.device_put(stack, NamedSharding(mesh, PartitionSpec(*entry)))
    if split == "both":  # the rows are split over dp already: the kernel cannot also split the weight over it
        assert run(x, stack) is None
        return
    got = run(x, stack)
    want = np.asarray(x.astype(jnp.bfloat16), np.float32) @ np.asarray(stack[1], np.float32)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("split", ["columns", "rows", "replicated", "one device"])
def test_backend_multiplies_a_quantized_layer_slice(dtype, split):
    """The backend takes a layer's `Quantized` kernel as the model hands it (the stacked int8 / float8 kernel as a
    `LayerSlice` of [embed, heads, head_dim] reshaped to [embed, heads * head_dim], the layer's scales [heads,
    head_dim] reshaped with it), on one device or over dp=2 x tp=2 with the kernel split by columns (its scales
    split with them) or by rows (partial sums over tp), and equals XLA's `dot` of the same `Quantized` and
    numpy's product by the dequantized weight."""
    layers, d, heads, hd = 2, 128, 4, 64
    w = np.random.default_rng(7).normal(size=(layers, d, heads * hd)).astype(np.float32)
    data, scale = _quantize(w, dtype)
    data, scale = data.reshape(layers, d, heads, hd), scale.reshape(layers, heads, hd)
    x = _bf16((8, d), 8)
    if split == "one device":
        mesh, specs = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",)), None
        entry: tuple = (None, None, None, None)
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
        entry = {"columns": (None, None, "tp", None), "rows": (None, "tp", None, None),
                 "replicated": (None, None, None, None)}[split]
        specs = None if split == "replicated" else {"attn.q_proj.kernel": PartitionSpec(*entry)}
        data = jax.device_put(data, NamedSharding(mesh, PartitionSpec(*entry)))
        scale = jax.device_put(scale, NamedSharding(mesh, PartitionSpec(entry[0], *entry[2:])))

    def weight(data: jax.Array, scale: jax.Array, layer: jax.Array) -> Quantized:
        stacked = LayerSlice(data, layer, name="attn.q_proj.kernel")
        return Quantized(stacked, scale[layer], 1).reshape((d, heads * hd))

    @jax.jit
    def run(x: jax.Array, data: jax.Array, scale: jax.Array) -> tuple[jax.Array | None, jax.Array]:
        mm = PallasGpu(mesh, ("dp",), interpret=True, specs=specs)
        q = weight(data, scale, jnp.int32(1))
        return mm.kernel(x, q), dot(x, q)

    got, xla = run(x, data, scale)
    assert got is not None and got.shape == (8, heads * hd) and got.dtype == jnp.bfloat16
    deq = np.asarray(data[1].astype(jnp.float32)).reshape(d, -1) * np.asarray(scale[1]).reshape(-1)
    want = np.asarray(x, np.float32) @ deq
    tol = 1e-2 * np.abs(want).max()  # bfloat16 outputs
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32), rtol=1e-2, atol=tol)


def test_quantized_weights_the_kernel_leaves_to_xla():
    """float32 rows by a quantized weight (XLA multiplies them in float32), a plain quantized array (not a layer
    slice), a 3-D view, and more rows than `MAX_ROWS`: XLA's dot, through `matmul` too."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    mm = PallasGpu(mesh, ("dp",), interpret=True)
    data, scale = _quantize(np.random.default_rng(1).normal(size=(2, 64, 128)).astype(np.float32), "int8")
    q = Quantized(LayerSlice(data, jnp.int32(0)), scale[0], 1)
    x = _bf16((4, 64), 9)
    assert mm.applies(x, q)
    assert not mm.applies(x.astype(jnp.float32), q)
    assert not mm.applies(x, Quantized(data[0], scale[0], 1))
    assert not mm.applies(x, Quantized(LayerSlice(data, jnp.int32(0)), scale[0], 1).reshape((64, 2, 64)))
    assert not mm.applies(jnp.zeros((stacked_matmul.MAX_ROWS + 1, 64), jnp.bfloat16), q)
    y = mm.matmul(x.astype(jnp.float32), q)
    want = np.asarray(x, np.float32) @ (np.asarray(data[0], np.float32) * np.asarray(scale[0]))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             tie_word_embeddings=False, initializer_range=0.2)


def _quantized_engine(ckpt: Any, mesh_shape: dict[str, int], quantization: str, gpu_matmul: str) -> Any:
    """An engine over a float checkpoint that quantizes it while loading (`model.quantization`), built as a host
    builds it (`build_engine`), bfloat16 activations, XLA attention; `gpu_matmul` pallas runs the kernel in
    interpret mode here."""
    n = int(np.prod(list(mesh_shape.values())))
    mesh = build_mesh(mesh_shape, jax.devices()[:n])
    engine_cfg = EngineConfig(max_slots=2, page_size=8, prefill_chunk=16, decode_steps=4, compilation_cache_dir=None,
                              warmup=False, gpu_matmul=gpu_matmul, kernel_layout="in_out", cpu_matmul="xla",
                              unroll_layers="off")
    model_cfg = ModelConfig(max_seq_len=MAX_SEQ_LEN, dtype="bfloat16", param_dtype="bfloat16",
                            quantization=quantization)
    cfg = load_config(None, ["mesh.axes.dp=1", "cluster.num_hosts=1"])
    return build_engine(cfg, mesh, ckpt, engine_cfg=engine_cfg, model_cfg=model_cfg, rules=merge_rules(None),
                        attention=Attention(xla.ragged_paged_attention)).engine


@pytest.mark.parametrize("kind,mesh_shape,quantization", [("llama", {"tp": 1}, "int8"), ("qwen3", {"tp": 2}, "int8"),
                                                          ("qwen3", {"tp": 1}, "fp8")])
def test_engine_reads_quantized_layers_in_place(kind, mesh_shape, quantization, tmp_path):
    """An engine with int8 / fp8 weights and `engine.gpu_matmul: pallas` (what auto is on a GPU; interpret mode
    here) multiplies every projection of its step programs in the kernel (`stacked_matmul_int8_...`: q, k, v, o,
    gate, up, down), reading each layer of the quantized stack in place, and gives the greedy tokens and logprobs
    of the same engine with XLA's dot over the same quantized weights; over tp=2 too (the scales split with the
    columns, row-split kernels summed over tp)."""
    case = _convert(kind, tmp_path, LLAMA if kind == "llama" else None)
    ours = _quantized_engine(case["ckpt"], mesh_shape, quantization, "pallas")
    peer = _quantized_engine(case["ckpt"], mesh_shape, quantization, "xla")
    assert ours.programs_set.stacked_matmul is None and ours.matmul == "pallas"
    tokens, logprobs = _engine_greedy(ours)
    want_tokens, want_logprobs = _engine_greedy(peer)
    assert tokens == want_tokens
    np.testing.assert_allclose(logprobs, want_logprobs, atol=2e-3, rtol=0)
    names = [str(e.params.get("name", "")) for e, _ in walk(_step_jaxpr(ours, False))
             if e.primitive.name == "pallas_call"]
    stored = {"int8": "int8", "fp8": "float8_e4m3fn"}[quantization]
    assert len(names) == 7 and all(n.startswith(f"stacked_matmul_{stored}_") for n in names), names
    assert not any(e.primitive.name == "pallas_call" for e, _ in walk(_step_jaxpr(peer, False)))


def test_quantized_choice_says_why_not():
    """Quantized weights take the kernel with bfloat16 activations; float32 activations keep XLA's dot (which
    multiplies them in float32), and the engine says so."""
    from raydeploy.engine.programs import ProgramSet
    from raydeploy.model.registry import from_hf_config

    family, cfg = from_hf_config(TINY["qwen3"])

    def why(quantization: str, dtype: str, **kw: Any) -> str | None:
        engine_cfg = EngineConfig(max_slots=2, page_size=8, prefill_chunk=16, compilation_cache_dir=None,
                                  warmup=False, **{"gpu_matmul": "pallas", "kernel_layout": "in_out", **kw})
        model_cfg = ModelConfig(max_seq_len=MAX_SEQ_LEN, dtype=dtype, param_dtype="bfloat16",
                                quantization=quantization)
        return ProgramSet(family.with_quantization(quantization), cfg, build_mesh({"tp": 1}, jax.devices()[:1]),
                          merge_rules(None), model_cfg, engine_cfg).stacked_matmul

    assert why("int8", "bfloat16") is None and why("fp8", "bfloat16") is None
    assert why("int8", "float32") == ("dtype float32 with weights quantized int8 (the kernel multiplies them by "
                                      "bfloat16 activations)")
    assert why("int8", "bfloat16", gpu_matmul="xla") == "engine.gpu_matmul is xla on cpu"


def test_unknown_weight_stays_with_xla():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    w = LayerSlice(jnp.zeros((2, 64, 128), jnp.bfloat16), jnp.int32(0), name="attn.q_proj.kernel")
    mm = PallasGpu(mesh, ("dp",), interpret=True, specs={"mlp.up_proj.kernel": PartitionSpec()})
    assert mm.kernel(jnp.ones((4, 64)), w) is None


@pytest.mark.parametrize("k,n", [(8192, 3584), (3584, 8192), (8192, 1024), (8192, 128)])
@pytest.mark.parametrize("rows", [1, 64])
def test_lowers_for_cuda_without_a_gpu(k, n, rows):
    """Each device's shard of Llama-3-70B's projections over tp=8 (`configs/gpu-2x8-h100.yaml`: gate/up, down,
    q, k), 80 layers stacked, lowered for CUDA from shapes alone: one Triton call each (compiling it to PTX
    needs a GPU; tests/test_gpu.py runs it there)."""
    spec = jax.ShapeDtypeStruct
    args = (spec((rows, k), jnp.bfloat16), spec((80, k, n), jnp.bfloat16), spec((), jnp.int32))
    text = jax.jit(stacked_matmul.stacked_matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("k,n", [(2048, 8192), (8192, 2048)])
@pytest.mark.parametrize("scales", ["layer", "stacked"])
def test_quantized_lowers_for_cuda_without_a_gpu(dtype, k, n, scales):
    """Llama-3.2-1B's gate/up and down projections, 16 layers of int8 or float8_e4m3fn with the layer's scales
    [N] (as the engine passes them) or every layer's [16, N]: one Triton call, the stack passed as it lies (no
    convert of the whole weight outside the kernel)."""
    spec = jax.ShapeDtypeStruct
    scale = spec((n,) if scales == "layer" else (16, n), jnp.float32)
    args = (spec((8, k), jnp.bfloat16), spec((16, k, n), dtype), spec((), jnp.int32), scale)
    lowered = jax.jit(stacked_matmul.stacked_matmul).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    name = jnp.dtype(dtype).name
    assert f"stacked_matmul_{name}_" in text
    wt = {"int8": "i8", "float8_e4m3fn": "f8E4M3FN"}[name]
    assert f"tensor<16x{k}x{n}x{wt}>" in text
    # the weight reaches the custom call in its own dtype: no float copy of it anywhere in the program
    assert f"tensor<16x{k}x{n}xbf16>" not in text and f"tensor<16x{k}x{n}xf32>" not in text


def test_older_gpus_keep_xla():
    """Triton's bfloat16 dot needs sm_80: a T4 (7.5) or V100 (7.0) is named, an A100 / H100 takes the kernel."""

    class Gpu:
        platform = "gpu"

        def __init__(self, cc: str | None) -> None:
            if cc is not None:
                self.compute_capability = cc

    assert stacked_matmul.device_problem(Gpu("7.5")) == (
        "the GPU's compute capability is 7.5 (the kernel's bfloat16 dot needs 8.0, Ampere or newer)")
    assert "7.0" in (stacked_matmul.device_problem(Gpu("7.0")) or "")
    assert stacked_matmul.device_problem(Gpu("8.0")) is None and stacked_matmul.device_problem(Gpu("9.0")) is None
    assert stacked_matmul.device_problem(Gpu(None)) is None

    # jax's Pallas GPU attention multiplies bfloat16 with the same dot: `auto` takes the XLA path there
    from raydeploy.engine.attention import for_device

    for cc, want in (("7.5", "xla"), ("8.0", "auto"), ("9.0", "auto")):
        assert for_device("auto", Gpu(cc)) == want
    assert for_device("pallas", Gpu("7.5")) == "pallas"  # an explicit choice stays
    assert for_device("auto", jax.devices()[0]) == "auto"  # CPU: resolved later, as before
