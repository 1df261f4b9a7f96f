"""The GPU's matmul of few rows by one layer of a stacked weight (`raydeploy.engine.matmul.pallas_gpu`), in Pallas
interpret mode: against numpy, with the layer index traced inside a scan as the engine's layer loop has it.
The compiled kernel runs in tests/test_gpu.py; the engine with it in tests/test_engine_families.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from raydeploy.engine.matmul import pallas_gpu as stacked_matmul
from raydeploy.engine.matmul.pallas_gpu import PallasGpu, blocks_for, merged_spec
from raydeploy.model.projection import LayerSlice, dot


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
    # bfloat16 out as the model's projections give it
    y = stacked_matmul.stacked_matmul(x, data, jnp.int32(2), scale, interpret=True)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), want[2], rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_quantized_stack_needs_its_scales():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    q = jnp.zeros((3, 64, 128), jnp.int8)
    with pytest.raises(ValueError, match="a int8 weight needs scales"):
        stacked_matmul.stacked_matmul(x, q, jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="a bfloat16 weight takes no scales"):
        stacked_matmul.stacked_matmul(x, q.astype(jnp.bfloat16), jnp.int32(0), jnp.ones((3, 128)), interpret=True)
    with pytest.raises(ValueError, match=r"scales \(128,\) for a stacked weight \(3, 64, 128\) \(expected \(3, 128\)"):
        stacked_matmul.stacked_matmul(x, q, jnp.int32(0), jnp.ones((128,)), interpret=True)


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
def test_quantized_lowers_for_cuda_without_a_gpu(dtype, k, n):
    """Llama-3.2-1B's gate/up and down projections, 16 layers of int8 or float8_e4m3fn with their scales: one
    Triton call, the stack passed as it lies (no convert of the whole weight outside the kernel)."""
    spec = jax.ShapeDtypeStruct
    args = (spec((8, k), jnp.bfloat16), spec((16, k, n), dtype), spec((), jnp.int32), spec((16, n), jnp.float32))
    lowered = jax.jit(stacked_matmul.stacked_matmul).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    name = jnp.dtype(dtype).name
    assert f"stacked_matmul_{name}_" in text
    wt = {"int8": "i8", "float8_e4m3fn": "f8E4M3FN"}[name]
    assert f"tensor<16x{k}x{n}x{wt}>" in text
    # the weight reaches the custom call in its own dtype: no float copy of it anywhere in the program
    assert f"tensor<16x{k}x{n}xbf16>" not in text and f"tensor<16x{k}x{n}xf32>" not in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="compiles the Triton kernel: needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rows,k,n", [(1, 2048, 8192), (8, 8192, 2048), (64, 2048, 512)])
def test_compiled_quantized_kernel_equals_dot(dtype, rows, k, n):
    """On a GPU: the compiled kernel at Llama-3.2-1B's shapes against XLA's dot by the dequantized weight."""
    w = np.random.default_rng(0).normal(size=(2, k, n)).astype(np.float32)
    data, scale = _quantize(w, dtype)
    x = _bf16((rows, k), 6)
    got = stacked_matmul.stacked_matmul(x, data, jnp.int32(1), scale, out_dtype=jnp.float32)
    deq = data[1].astype(jnp.float32) * scale[1]
    with jax.default_matmul_precision("highest"):
        want = np.asarray(dot(x.astype(jnp.float32), deq))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


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
