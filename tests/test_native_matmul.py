"""The native CPU matmul for few rows (`raydeploy.model.native`): built with the machine's compiler, run through
`jax.ffi` inside jitted programs, against numpy in float64 over shapes that exercise every remainder (rows past
one block of 16, K not a multiple of 8, N not a multiple of the 512-column block), on a stacked weight with a
layer index; an index out of range and a failed build are errors that say what failed."""

from __future__ import annotations

import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raydeploy.engine.matmul import cpu_native
from raydeploy.engine.matmul.cpu_native import CpuNative
from raydeploy.engine.matmul.xla import XLA
from raydeploy.model import native
from raydeploy.model.projection import LayerSlice


@pytest.fixture(scope="module")
def kernel(native_library):
    return jax.jit(cpu_native._call)


@pytest.mark.parametrize("m,k,n", [(2, 576, 1536), (3, 7, 8), (5, 100, 520), (8, 576, 49152 // 16),
                                   (16, 1536, 576), (17, 64, 24), (33, 9, 1032)])
def test_kernel_equals_numpy(kernel, m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    stack = rng.standard_normal((3, k, n), dtype=np.float32)
    for layer in (0, 2):
        y = np.asarray(kernel(jnp.asarray(x), jnp.asarray(stack), jnp.int32(layer)))
        want = x.astype(np.float64) @ stack[layer].astype(np.float64)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m,k,n", [(2, 576, 49152 // 8), (3, 13, 9), (8, 576, 1030), (17, 64, 256), (32, 100, 7)])
def test_output_first_kernel_equals_numpy(kernel, m, k, n):
    """w [N, K], as a tied embedding table used as the LM head: rows and columns past the 2 x 4 blocks, K past
    the 8-wide vectors."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    stack = rng.standard_normal((2, n, k), dtype=np.float32)
    y = np.asarray(jax.jit(cpu_native._call_out_first)(jnp.asarray(x), jnp.asarray(stack), jnp.int32(1)))
    want = x.astype(np.float64) @ stack[1].astype(np.float64).T
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.fixture(scope="module")
def bf16_kernel(native_library):
    if "bfloat16" not in native.weight_dtypes():
        pytest.skip(f"bfloat16 weights need the AVX-512 build; this CPU's is {native.isa()}")
    return jax.jit(cpu_native._call), jax.jit(cpu_native._call_out_first)


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (2, 7, 8), (8, 576, 192), (9, 100, 520), (17, 64, 24),
                                   (33, 9, 1032)])
def test_bfloat16_weights_multiply_float32_rows_exactly(bf16_kernel, m, k, n):
    """bfloat16 weights widened in the kernel: the result is float32 x times the weights' exact values (no
    rounding of x to bfloat16, as XLA's mixed dot does), from one row up; both layouts, remainders of every block."""
    call, out_first = bf16_kernel
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    stack = jnp.asarray(rng.standard_normal((2, k, n), dtype=np.float32)).astype(jnp.bfloat16)
    exact = np.asarray(stack.astype(jnp.float32)).astype(np.float64)
    y = np.asarray(call(jnp.asarray(x), stack, jnp.int32(1)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ exact[1], rtol=1e-5, atol=1e-5 * np.sqrt(k))
    table = jnp.asarray(rng.standard_normal((2, n, k), dtype=np.float32)).astype(jnp.bfloat16)
    exact = np.asarray(table.astype(jnp.float32)).astype(np.float64)
    y = np.asarray(out_first(jnp.asarray(x), table, jnp.int32(0)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ exact[0].T, rtol=1e-5, atol=1e-5 * np.sqrt(k))


AVX2_BUILD = r"""
import jax, jax.numpy as jnp, numpy as np
from raydeploy.engine.matmul import cpu_native
from raydeploy.engine.matmul.cpu_native import CpuNative
from raydeploy.model import native
from raydeploy.model.projection import LayerSlice
assert native.isa() == "avx2" and "-mavx512f" not in native.flags() and native.weight_dtypes() == ("float32",)
assert native.unavailable() is None
rng = np.random.default_rng(1)
for m, k, n in [(2, 576, 1536), (3, 7, 8), (8, 576, 192), (17, 64, 24), (33, 9, 1032)]:
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((2, k, n), dtype=np.float32)
    y = np.asarray(jax.jit(cpu_native._call)(jnp.asarray(x), jnp.asarray(w), jnp.int32(1)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w[1], rtol=1e-4, atol=1e-4 * np.sqrt(k))
    y = np.asarray(jax.jit(cpu_native._call_out_first)(jnp.asarray(x), jnp.asarray(w.transpose(0, 2, 1)), jnp.int32(1)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ w[1], rtol=1e-4, atol=1e-4 * np.sqrt(k))
# packed 4-bit layer weights: one row converts as it goes, more rows pass in groups of 3 over a converted tile
assert native.packs_weights() is None
d = rng.uniform(1e-3, 3e-2, (2, 576 // 32, 1536)).astype(np.float16).astype(np.float32)
mq = (-rng.uniform(1, 8, d.shape) * d).astype(np.float16).astype(np.float32)
q = rng.integers(0, 16, (2, 576 // 32, 32, 1536)).astype(np.float32)
q[:, :, 3, :], q[:, :, 17, :] = 0, 15  # each block's min and max, as the quantizer gives them
w = (q * d[:, :, None] + mq[:, :, None]).reshape(2, 576, 1536)
wa, wb = w[:, :, :192], w[:, :, 192:]
packed = [jnp.asarray(native.packing.pack_q4(np.ascontiguousarray(v))) for v in (wa, wb)]
for m in (1, 2, 3, 4, 7, 8, 9, 72):
    x = rng.standard_normal((m, 576), dtype=np.float32)
    ya, yb = jax.jit(cpu_native._call_q4)(jnp.asarray(x), jnp.int32(1), *packed)
    for y, v in ((ya, wa), (yb, wb)):
        want = x.astype(np.float64) @ v[1]
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
# a packed 8-bit table (per row: 32-weight blocks d * q) read as the LM head, its tiles always converted first
d = rng.uniform(1e-3, 3e-2, (1024, 576 // 32)).astype(np.float16).astype(np.float32)
q = rng.integers(-127, 128, (1024, 576 // 32, 32)).astype(np.float32)
q[:, :, 9] = 127  # each block's largest |q|, as the quantizer gives it
table = (q * d[:, :, None]).reshape(1024, 576)
q8 = jnp.asarray(native.packing.pack_q8(table))
for m in (1, 2, 5, 8):
    x = rng.standard_normal((m, 576), dtype=np.float32)
    want = x.astype(np.float64) @ table.astype(np.float64).T
    y = jax.jit(cpu_native._call_q8)(jnp.asarray(x), q8, jnp.int32(0))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
print("ok")
"""


def test_the_avx2_build_runs_beside_the_avx512_one(native_library, tmp_path):
    """On an AVX-512 CPU the kernels build with AVX-512 (register-blocked strips, bfloat16 weights, an 8-bit LM
    head); the AVX2 build the machines without it run (`RAYDEPLOY_NATIVE_ISA=avx2`) is a library of its own, checked
    here against numpy in a process of its own (a process registers one library): float32 weights, packed 4-bit
    layer weights at one row and in row groups, and a packed 8-bit table as the LM head."""
    import subprocess
    import sys

    if native.isa() != "avx512":
        pytest.skip("this CPU runs the AVX2 build: every other test here checks it")
    assert "-mavx512f" in native.flags() and native.weight_dtypes() == ("float32", "bfloat16")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAYDEPLOY_NATIVE_ISA": "avx2",
           "RAYDEPLOY_NATIVE_CACHE": str(native.cache_dir())}
    done = subprocess.run([sys.executable, "-c", AVX2_BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
    assert len(list(native.cache_dir().glob("kernels-*.so"))) >= 2  # each build under its own key


AVX512_WITHOUT_VNNI = r"""
import jax, jax.numpy as jnp, numpy as np
from raydeploy.engine.matmul import cpu_native
from raydeploy.engine.matmul.cpu_native import CpuNative
from raydeploy.model import native
from raydeploy.model.projection import LayerSlice
from raydeploy.model.native import packing
assert native.isa() == "avx512" and "-mavx512bw" in native.flags() and "-mavx512vnni" not in native.flags()
assert native.unavailable() is None
rng = np.random.default_rng(3)
d = rng.uniform(1e-3, 3e-2, (2, 576 // 32, 192)).astype(np.float16).astype(np.float32)
mq = (-rng.uniform(1, 8, d.shape) * d).astype(np.float16).astype(np.float32)
q = rng.integers(0, 16, (2, 576 // 32, 32, 192)).astype(np.float32)
q[:, :, 3, :], q[:, :, 17, :] = 0, 15
w = (q * d[:, :, None] + mq[:, :, None]).reshape(2, 576, 192)
p4 = jnp.asarray(packing.pack_q4(w))
dt = rng.uniform(1e-3, 3e-2, (1024, 576 // 32)).astype(np.float16).astype(np.float32)
qt = rng.integers(-127, 128, (1024, 576 // 32, 32)).astype(np.float32)
qt[:, :, 9] = 127
table = (qt * dt[:, :, None]).reshape(1024, 576)
p8 = jnp.asarray(packing.pack_q8(table))
for m in (1, 3, 8, 9, 72):
    x = rng.standard_normal((m, 576), dtype=np.float32)
    (y,) = jax.jit(cpu_native._call_q4)(jnp.asarray(x), jnp.int32(1), p4)
    want = packing.packed_product(x, w[1], True)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    y = jax.jit(cpu_native._call_q8)(jnp.asarray(x), p8, jnp.int32(0))
    want = packing.packed_product(x, table.T, True, q4=False)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
print("ok")
"""


def test_the_avx512_build_without_vnni_sums_the_same(native_library):
    """A CPU with AVX-512 but no VNNI (`RAYDEPLOY_NATIVE_ISA=avx512` builds that on this one) sums the packed weights'
    16-bit products with `vpmaddwd` and `vpaddd` instead of `vpdpwssd`: what `packing.packed_product` says, for the
    4-bit layer kernel and the 8-bit head, in one and several row groups and over converted tiles."""
    import subprocess
    import sys

    if native.isa() != "avx512":
        pytest.skip("this CPU runs the AVX2 build")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAYDEPLOY_NATIVE_ISA": "avx512",
           "RAYDEPLOY_NATIVE_CACHE": str(native.cache_dir())}
    done = subprocess.run([sys.executable, "-c", AVX512_WITHOUT_VNNI], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_joined_matmuls_equal_separate_ones(native_library, dtype):
    """`matmuls`: several weights by the same rows in one call (a layer's q, k, v), each result as its own matmul
    gives it, from stacked weights with a layer index and from plain arrays; weights of mixed dtypes or layers,
    and rows outside the kernel's range, are left to the caller."""
    if dtype not in native.weight_dtypes():
        pytest.skip(f"{dtype} weights need the AVX-512 build; this CPU's is {native.isa()}")
    mesh = jax.make_mesh((1,), ("dp",))
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((5, 40), dtype=np.float32))
    stacks = [jnp.asarray(rng.standard_normal((3, 40, n), dtype=np.float32)).astype(dtype) for n in (48, 16, 24)]
    mm = CpuNative(mesh, ("dp",))
    layer = jnp.int32(2)  # one layer index for every weight, as in a layer's scan body
    joined = jax.jit(lambda x, *sts: mm.matmuls(x, [LayerSlice(st, layer) for st in sts]))(x, *stacks)
    plain = mm.matmuls(x, [st[1] for st in stacks])
    assert mm.matmuls(x, [stacks[0][0], stacks[1][0].astype(jnp.float32 if dtype == "bfloat16" else
                                                                  jnp.bfloat16)]) is None
    assert mm.matmuls(x, [LayerSlice(stacks[0], jnp.int32(0)),
                              LayerSlice(stacks[1], jnp.int32(0))]) is None  # two layer indices
    assert mm.matmuls(jnp.ones((native.max_rows(dtype) + 1, 40)), [st[0] for st in stacks]) is None
    many = jnp.ones((native.max_rows(dtype), 40))  # as many rows as the kernel takes for this dtype
    np.testing.assert_allclose(np.asarray(mm.matmuls(many, [st[0] for st in stacks])[0]),
                               np.ones((native.max_rows(dtype), 40)) @ np.asarray(stacks[0][0].astype(jnp.float32)),
                               rtol=1e-5, atol=1e-4)
    wide = [np.asarray(st.astype(jnp.float32)).astype(np.float64) for st in stacks]
    for got, layer_got, w in zip(joined, plain, wide, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(x, np.float64) @ w[2], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(layer_got), np.asarray(x, np.float64) @ w[1], rtol=1e-5, atol=1e-4)


def test_a_layer_index_out_of_range_is_refused(kernel):
    x, stack = jnp.ones((2, 8)), jnp.ones((3, 8, 8))
    with pytest.raises(Exception, match="small_matmul: layer index out of range"):
        np.asarray(kernel(x, stack, jnp.int32(3)))


def test_the_joined_call_refuses_a_layer_out_of_range_and_too_many_weights(kernel):
    """The joined handler checks what the single one does, and its own limit of 8 weights, naming them."""
    x, stack = jnp.ones((2, 8)), jnp.ones((3, 8, 8))
    with pytest.raises(Exception, match="small_matmul: layer index out of range"):
        np.asarray(jax.jit(cpu_native._call_multi)(x, jnp.int32(3), stack, stack)[0])
    with pytest.raises(Exception, match="small_matmul_multi: expected 1 to 8 weights and one result each"):
        np.asarray(jax.jit(cpu_native._call_multi)(x, jnp.int32(0), *[stack] * 9)[0])


def test_the_backend_takes_few_float32_rows_and_leaves_the_rest_to_xla(kernel):
    """`CpuNative.kernel` runs the kernel where it applies and is None elsewhere; `matmul` then multiplies in
    XLA (the same product); the XLA backend never calls the kernel."""
    mesh = jax.make_mesh((1,), ("dp",))
    x, w = jnp.ones((4, 16)), jnp.ones((16, 8))
    assert "raydeploy_small_matmul" not in jax.jit(XLA.matmul).lower(x, w).as_text()  # XLA's dot
    mm = CpuNative(mesh, ("dp",))
    np.testing.assert_allclose(np.asarray(mm.kernel(x, w)), np.full((4, 8), 16.0))
    one_row = mm.kernel(jnp.ones((1, 16)), w)
    if native.isa() == "avx2":
        assert one_row is None  # one float32 row: XLA's matrix-vector product
    else:
        np.testing.assert_allclose(np.asarray(one_row), np.full((1, 8), 16.0))
    assert mm.kernel(jnp.ones((native.max_rows(jnp.float32) + 1, 16)), w) is None
    assert native.max_rows(jnp.float32) == 32 and native.max_rows(jnp.bfloat16) == 128
    assert mm.kernel(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)) is None  # bfloat16 rows: XLA
    one_row_bf16 = mm.kernel(jnp.ones((1, 16)), w.astype(jnp.bfloat16))  # bfloat16 weights: from one row
    if "bfloat16" in native.weight_dtypes():
        np.testing.assert_allclose(np.asarray(one_row_bf16), np.full((1, 8), 16.0))
    else:
        assert one_row_bf16 is None
    assert mm.kernel(x, jnp.ones((16, 12))) is None  # N not a multiple of 8
    np.testing.assert_allclose(np.asarray(mm.kernel(x, jnp.ones((12, 16)), out_first=True)),
                               np.full((4, 12), 16.0))
    stack = jnp.arange(3 * 16 * 8, dtype=jnp.float32).reshape(3, 16, 8)
    sl = LayerSlice(stack, jnp.int32(1))
    np.testing.assert_allclose(np.asarray(mm.kernel(x, sl)), np.asarray(x @ stack[1]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(sl.reshape(4, -1).materialize()), np.asarray(stack[1]).reshape(4, 32))
    np.testing.assert_allclose(np.asarray(mm.matmul(x, jnp.ones((16, 12)))), np.full((4, 12), 16.0))  # XLA


def test_a_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    if native._cpu_problem() is not None:
        pytest.skip(native._cpu_problem())
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler found \(\$CXX, c\+\+, g\+\+ or clang\+\+\)"):
        native.build(tmp_path / "out")


def test_a_failed_build_shows_the_compiler_output(tmp_path, monkeypatch):
    if native._cpu_problem() is not None:
        pytest.skip(native._cpu_problem())
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'small_matmul.cc:1: error: boom' >&2\nexit 3\n")
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\): small_matmul.cc:1: error: boom"):
        native.build(tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []  # no half-written library left behind


CONCURRENT = r"""
import jax, jax.numpy as jnp, numpy as np
from raydeploy.engine.matmul import cpu_native
from raydeploy.engine.matmul.cpu_native import CpuNative
from raydeploy.model import native
from raydeploy.model.projection import LayerSlice
assert native.unavailable() is None
rng = np.random.default_rng(0)
xs = [jnp.asarray(rng.standard_normal((8, 64), dtype=np.float32)) for _ in range(24)]
ws = [jnp.asarray(rng.standard_normal((1, 64, 2048), dtype=np.float32)) for _ in range(24)]
heads = [jnp.asarray(rng.standard_normal((1, 1024, 64), dtype=np.float32)) for _ in range(24)]
f = jax.jit(lambda xs, ws, hs: [(cpu_native._call(x, w, jnp.int32(0)), cpu_native._call_out_first(x, h, jnp.int32(0)))
                                for x, w, h in zip(xs, ws, hs)])
for _ in range(5):
    out = f(xs, ws, heads)
for (y, z), x, w, h in zip(out, xs, ws, heads):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(w[0]), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(z), np.asarray(x) @ np.asarray(h[0]).T, rtol=1e-4, atol=1e-3)
print("ok")
"""


def test_many_concurrent_calls_on_two_threads_finish(kernel):
    """With two CPU client threads XLA runs independent kernel calls at once on its pool, and each call splits its
    columns over that same pool: a call must never wait for a piece no thread has started (that deadlocked)."""
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PJRT_NPROC": "2"}
    done = subprocess.run([sys.executable, "-c", CONCURRENT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# -- packed 4-bit weights (`raydeploy.model.native.packing`) ------------------------------------------------------


def _q4_weight(rng, layers: int, k: int, n: int) -> np.ndarray:
    """A float32 weight made as a Q4_1 checkpoint's dequantization makes it: per 32 weights down a column,
    float16 d and m, q in 0..15 with 0 and 15 present (as the quantizer's min and max give them)."""
    d = rng.uniform(1e-3, 3e-2, (layers, k // 32, n)).astype(np.float16).astype(np.float32)
    m = (-rng.uniform(1, 8, (layers, k // 32, n)) * d).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (layers, k // 32, 32, n))
    q[:, :, 3, :], q[:, :, 17, :] = 0, 15
    return (q.astype(np.float32) * d[:, :, None] + m[:, :, None]).reshape(layers, k, n)


def test_q4_pack_keeps_every_weight_bit_for_bit():
    from raydeploy.model.native import packing

    rng = np.random.default_rng(4)
    w = _q4_weight(rng, 2, 96, 64)
    w[1, 32:64, 5] = np.float32(0.25)  # a constant block: d = 0
    packed = packing.pack_q4(w)
    assert packed is not None and packed.shape == (2, 3, 2, packing.TILE) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packing.unpack_q4(packed).view(np.uint32), w.view(np.uint32))


def test_q4_pack_refuses_weights_that_are_not_exact_blocks():
    """Packing never approximates: one weight an ulp off, float32 noise, a NaN, K or N not a multiple of 32, or
    another dtype leave the weight unpacked (None)."""
    from raydeploy.model.native import packing

    rng = np.random.default_rng(5)
    w = _q4_weight(rng, 1, 64, 32)
    off = w.copy()
    off[0, 40, 7] = np.nextafter(off[0, 40, 7], np.float32(1))
    assert packing.pack_q4(off) is None
    assert packing.pack_q4(rng.standard_normal((1, 64, 32), dtype=np.float32)) is None
    nan = w.copy()
    nan[0, 0, 0] = np.nan
    assert packing.pack_q4(nan) is None
    assert packing.pack_q4(_q4_weight(rng, 1, 64, 48)[:, :, :40]) is None
    assert packing.pack_q4(w[:, :48]) is None
    assert packing.pack_q4(w.astype(np.float64)) is None
    assert packing.pack_q4(w) is not None


@pytest.fixture(scope="module")
def q4_kernel(native_library):
    if native.packs_weights() is not None:
        pytest.skip(native.packs_weights())
    return native


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 32, 64, 72, 136, 256])
def test_q4_kernel_equals_numpy_through_matmul_and_matmuls(q4_kernel, m, monkeypatch):
    """`CpuNative.kernel` / `matmuls` with packed copies (`CpuNative(..., packed)`) read a `LayerSlice`'s packed copy (one kernel
    call for several weights of a layer): the float32 weight's products, within float32 rounding, for row counts
    in one and several register groups, with tiles converted once for many rows, in row chunks and (from 128 rows
    on the suite's two threads) rows split over the threads, at a traced layer index inside a scan. (The AVX2
    build's limit is raised here so that its kernel is checked at every row count too.)"""
    monkeypatch.setattr(native, "PACKED_MAX_ROWS_AVX2", native.PACKED_MAX_ROWS)
    rng = np.random.default_rng(m)
    ws = {"a": _q4_weight(rng, 3, 576, 192), "b": _q4_weight(rng, 3, 576, 1536)}
    packed = {k: jnp.asarray(native.packing.pack_q4(v)) for k, v in ws.items()}
    x = rng.standard_normal((m, 576), dtype=np.float32)
    mesh = jax.make_mesh((1,), ("dp",))

    def run(x, wa, wb, packed):
        def body(c, layer):
            a, b = LayerSlice(wa, layer, name="a"), LayerSlice(wb, layer, name="b")
            joined = mm.matmuls(x, [a, b])
            return c, (mm.kernel(x, a), mm.kernel(x, b), *joined)
        mm = CpuNative(mesh, ("dp",), packed)
        return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

    fn = jax.jit(run)
    text = fn.lower(x, ws["a"], ws["b"], packed).as_text()
    assert text.count("raydeploy_small_matmul_q4") == 3 and "raydeploy_small_matmul\"" not in text
    ya, yb, ja, jb = (np.asarray(y) for y in fn(x, ws["a"], ws["b"], packed))
    rounded = native.isa() == "avx512"
    for layer in range(3):
        for got, name in ((ya, "a"), (ja, "a"), (yb, "b"), (jb, "b")):
            want = native.packing.packed_product(x, ws[name][layer], rounded)
            np.testing.assert_allclose(got[layer], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            exact = x.astype(np.float64) @ ws[name][layer].astype(np.float64)
            np.testing.assert_allclose(got[layer], exact, rtol=0, atol=1e-4 * np.abs(exact).max())


Q4_ROW_SPLIT = r"""
import jax, jax.numpy as jnp, numpy as np
from raydeploy.engine.matmul import cpu_native
from raydeploy.engine.matmul.cpu_native import CpuNative
from raydeploy.model import native
from raydeploy.model.projection import LayerSlice
assert native.unavailable() is None  # built and registered in this process
rng = np.random.default_rng(0)
layers, k, n = 2, 576, 1536
d = rng.uniform(1e-3, 3e-2, (layers, k // 32, n)).astype(np.float16).astype(np.float32)
m = (-rng.uniform(1, 8, (layers, k // 32, n)) * d).astype(np.float16).astype(np.float32)
q = rng.integers(0, 16, (layers, k // 32, 32, n)).astype(np.float32)
q[:, :, 3, :], q[:, :, 17, :] = 0, 15  # as a quantizer's min and max give them (else not exact blocks)
w = (q * d[:, :, None] + m[:, :, None]).reshape(layers, k, n)
p = jnp.asarray(native.packing.pack_q4(w))
for rows in (128, 136, 256):
    x = rng.standard_normal((rows, k), dtype=np.float32)
    (y,) = cpu_native._call_q4(jnp.asarray(x), jnp.int32(1), p)
    want = native.packing.packed_product(x, w[1], native.isa() == "avx512")
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
print("ok")
"""


def test_q4_kernel_splits_many_rows_over_two_threads(q4_kernel):
    """With two CPU client threads and at least 64 rows a thread (a prompt step on one host of a two-core machine),
    each thread multiplies its own rows by the whole packed weight: the products stay the float32 weight's."""
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PJRT_NPROC": "2"}
    done = subprocess.run([sys.executable, "-c", Q4_ROW_SPLIT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_more_rows_than_the_packed_kernel_takes_go_to_xla(q4_kernel):
    """Past `packed_max_rows()` rows per device (`PACKED_MAX_ROWS`, `PACKED_MAX_ROWS_AVX2` in the AVX2 build; and
    past the float32 kernel's own limit) `matmul` returns None: the model multiplies in XLA over the float32 weight."""
    w = _q4_weight(np.random.default_rng(1), 1, 64, 32)
    mesh = jax.make_mesh((1,), ("dp",))
    seen = {}

    def run(x, w, p):
        mm = CpuNative(mesh, ("dp",), {"w": p})
        seen[x.shape[0]] = mm.kernel(x, LayerSlice(w, jnp.int32(0), name="w"))
        return x

    top = native.packed_max_rows()
    assert top == (native.PACKED_MAX_ROWS if native.isa() == "avx512" else native.PACKED_MAX_ROWS_AVX2)
    for m in (top, top + 1):
        jax.jit(run).lower(np.zeros((m, 64), np.float32), w, native.packing.pack_q4(w))
    assert seen[top] is not None and seen[top + 1] is None


def test_q4_kernel_names_wrong_shapes(q4_kernel):
    """A packed weight whose K does not match x's is refused by the handler with what it expected."""
    w = q4_kernel.packing.pack_q4(_q4_weight(np.random.default_rng(0), 1, 64, 32))
    with pytest.raises(Exception, match=r"expected w_i \[L, K/32, N_i/32, 768\]"):
        y = jax.ffi.ffi_call(native.TARGET_Q4, [jax.ShapeDtypeStruct((2, 32), jnp.float32)])(
            jnp.zeros((2, 96), jnp.float32), jnp.int32(0), jnp.asarray(w))
        jax.block_until_ready(y)


def _q8_table(rng, n: int, k: int) -> np.ndarray:
    """A float32 table made as a Q8_0 checkpoint's dequantization makes it: per 32 weights along a row, a float16
    d and q in -127..127 with |q| = 127 present."""
    d = rng.uniform(1e-3, 3e-2, (n, k // 32)).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (n, k // 32, 32))
    q[:, :, 9] = np.where(rng.random((n, k // 32)) < 0.5, -127, 127)
    return (q.astype(np.float32) * d[:, :, None]).reshape(n, k)


def test_q8_pack_keeps_every_weight_bit_for_bit_and_refuses_the_rest():
    from raydeploy.model.native import packing

    rng = np.random.default_rng(8)
    w = _q8_table(rng, 64, 96)
    w[3, 32:64] = 0.0  # an all-zero block: d = 0
    packed = packing.pack_q8(w)
    assert packed is not None and packed.shape == (1, 3, 2, packing.Q8_TILE) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packing.unpack_q8(packed).view(np.uint32), w.view(np.uint32))
    off = w.copy()
    off[7, 50] = np.nextafter(off[7, 50], np.float32(1))
    assert packing.pack_q8(off) is None
    assert packing.pack_q8(rng.standard_normal((8, 64), dtype=np.float32)) is None
    assert packing.pack_q8(w[:, :80]) is None
    assert packing.pack_q8(w[:40]) is None  # N (the vocabulary) not a multiple of 32


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 32, 72])
def test_q8_table_as_lm_head_equals_numpy(q4_kernel, m, monkeypatch):
    """A tied table's 8-bit tiles read as the LM head (`LayerSlice` named in `CpuNative`'s packed copies, out_first):
    what `packing.packed_product` says this build computes, within float32 rounding, for rows in one and several
    register groups, tiles converted once for many rows, and row chunks (the AVX2 build's limit raised as above)."""
    monkeypatch.setattr(native, "PACKED_MAX_ROWS_AVX2", native.PACKED_MAX_ROWS)
    rng = np.random.default_rng(m)
    table = _q8_table(rng, 1024, 576)
    x = rng.standard_normal((m, 576), dtype=np.float32)
    mesh = jax.make_mesh((1,), ("dp",))

    def run(x, table, packed):
        mm = CpuNative(mesh, ("dp",), {"embed.embedding": packed})
        return mm.kernel(x, LayerSlice(table[None], jnp.int32(0), name="embed.embedding"), True)

    fn = jax.jit(run)
    args = (x, table, jnp.asarray(native.packing.pack_q8(table)))
    assert "raydeploy_small_matmul_q8" in fn.lower(*args).as_text()
    want = native.packing.packed_product(x, table.T, native.isa() == "avx512", q4=False)
    np.testing.assert_allclose(np.asarray(fn(*args)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
