"""The quantized KV cache (`engine.kv_dtype: int8 | float8_e4m3fn`, `raydeploy.engine.attention.kv_quant`).

- quantize / dequantize: the round trip's error within its bound (int8: max|x| / 254 per element; float8 e4m3:
  2^-4 relative above the subnormals), zeros stay zeros, the packed write form unpacks exactly;
- a `QuantizedPool` written through the engine's own scatter holds what `quantize` gives, and reads back;
- every attention backend on the same quantized pool: the XLA path equals the definition over the dequantized
  pool, and the Pallas TPU and GPU kernels (interpret mode) equal the XLA path; unused cache memory holds NaN
  scales, so a leak shows;
- the demo engine with an int8 KV cache: a quarter of the float32 pool's bytes plus the scales, greedy tokens of
  the float32 cache's on the demo prompts' start, and the same tokens with prefix reuse and chunked prefill as
  the same requests alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import (
    DECODE,
    MIXED,
    SCALE,
    assert_matches,
    live_rows,
    make_step,
    tpu_interpreter,  # noqa: F401  (the fixture)
)
from test_engine_paged import NEW_TOKENS, PlanDriver, _alone, _build_engine

from raydeploy.engine.attention import kv_quant, pallas_gpu, pallas_tpu, work_follows_table, xla
from raydeploy.engine.attention.kv_quant import QuantizedPool
from raydeploy.engine.kv_cache import kv_bytes_per_token, resolve_kv_dtype, to_pool_dtype
from tests.jaxpr_walk import walk

QUANTIZED = ["int8", "float8_e4m3fn"]


def quantized_step(dtype: str, **kw) -> tuple:
    """`make_step`'s arguments with its pool quantized: pool rows that no live token may read keep NaN scales."""
    args = make_step(**kw)
    pool = np.asarray(args[1], np.float32)
    unused = np.isnan(pool).any(axis=-1, keepdims=True)
    values, scales = kv_quant.quantize(jnp.asarray(np.where(unused, 0.0, pool)), dtype)
    scales = jnp.where(jnp.asarray(unused), jnp.nan, scales)
    return (args[0], QuantizedPool(values, scales), *args[2:])


# -- quantize, pack, write ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_round_trip_error_within_its_bound(dtype):
    rng = np.random.default_rng(0)
    # rows of very different magnitudes (each has its own scale), one row of zeros
    x = rng.standard_normal((64, 6, 128)).astype(np.float32) * np.exp(rng.uniform(-6, 6, (64, 6, 1)))
    x[3, 2] = 0.0
    values, scales = kv_quant.quantize(jnp.asarray(x), dtype)
    assert values.dtype == jnp.dtype(dtype) and scales.shape == (64, 6, 1) and scales.dtype == jnp.float32
    back = np.asarray(kv_quant.dequantize(values, scales))
    amax = np.abs(x).max(axis=-1, keepdims=True)
    err = np.abs(back - x)
    if dtype == "int8":
        assert (np.abs(np.asarray(values, np.int32)) <= 127).all()
        assert (err <= amax / 254 * (1 + 1e-5)).all()
        assert (np.abs(np.asarray(values, np.int32)).max(axis=-1) == np.where(amax[..., 0] > 0, 127, 0)).all()
    else:  # 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 (the subnormals) a fixed step
        bound = np.maximum(np.abs(x) * 2.0 ** -4, amax / 448 * 2.0 ** -10)
        assert (err <= bound * (1 + 1e-5)).all()
    assert (back[3, 2] == 0).all() and float(scales[3, 2, 0]) == 0.0
    rel = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert rel < (0.01 if dtype == "int8" else 0.05), rel


@pytest.mark.parametrize("layout", ["rows", "tpu"])
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_packed_kv_unpacks_exactly_and_the_engines_scatter_writes_it(dtype, layout):
    """`to_pool_dtype` into a quantized pool gives the packed form [T, 2*Hkv, D + 4]; a pool's `.at[...].set`, as
    the step programs' write calls it (pages flattened with the layers, a dropped out-of-range index), stores the
    values and scales `quantize` gives, and a padding place writes nothing. In both layouts: the rows one, and
    the TPU one (values [pages, 1, 2*Hkv, page_size, D], scales 128 lanes a row: 32 pages of 4 tokens)."""
    rng = np.random.default_rng(1)
    kv = jnp.asarray(rng.standard_normal((3, 4, 32)) * 5, jnp.float32)
    packed = to_pool_dtype(kv, jnp.dtype(dtype))
    assert packed.shape == (3, 4, 36) and packed.dtype == jnp.int8
    values, scales = kv_quant.quantize(kv, dtype)
    got_v, got_s = kv_quant.unpack(packed, dtype)
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(values, np.float32))
    np.testing.assert_array_equal(np.asarray(got_s), np.asarray(scales))
    layers, pages, page_size = 2, 32, 4
    pool = kv_quant.zeros_pool((layers, pages, page_size, 4, 32), dtype)
    if layout == "tpu":
        pool = pool.in_layout(kv_quant.tpu_pages_per_row(page_size, pages))
        assert pool.pages_per_row == 32 and pool.stored_values.shape == (layers, pages, 1, 4, page_size, 32)
        assert pool.stored_scales.shape == (layers, 1, 1, 4, 1, 128) and pool.shape == (layers, pages, page_size, 4, 32)
    flat = pool.reshape(layers * pages, page_size, 4, 32)
    dest = jnp.asarray([1 * pages + 3, 0 * pages + 2, layers * pages])  # layer 1 page 3, layer 0 page 2, dropped
    offset = jnp.asarray([1, 3, 0])
    out = flat.at[dest, offset].set(packed, mode="drop").reshape(pool.shape)
    assert isinstance(out, QuantizedPool) and out.shape == pool.shape and out.scales.shape == (*pool.shape[:-1], 1)
    assert out.pages_per_row == pool.pages_per_row
    deq = np.asarray(out.dequantized())
    want = np.asarray(kv_quant.dequantize(values, scales))
    np.testing.assert_array_equal(deq[1, 3, 1], want[0])
    np.testing.assert_array_equal(deq[0, 2, 3], want[1])
    assert np.count_nonzero(np.abs(deq).sum(axis=(-1, -2))) == 2  # the third (padding) place wrote nothing
    with pytest.raises(ValueError, match="takes new K/V packed as int8"):
        flat.at[dest, offset].set(kv, mode="drop")


def test_bytes_per_token_and_the_dtypes_each_backend_takes():
    # Llama-3-8B's 8 kv heads x 128: 4096 bytes a token per layer in bfloat16, 2048 + 64 of scales in int8
    assert kv_bytes_per_token("bfloat16", 8, 128) == 4096
    assert kv_bytes_per_token("int8", 8, 128) == 2 * 8 * (128 + 4)
    assert kv_bytes_per_token("float8_e4m3fn", 8, 128) == kv_bytes_per_token("int8", 8, 128)
    for attention, platform in (("xla", "cpu"), ("pallas", "tpu"), ("pallas", "gpu"), ("auto", "tpu")):
        assert resolve_kv_dtype("int8", "bfloat16", attention, platform) == "int8"
    with pytest.raises(ValueError, match="float16 differs from model.dtype bfloat16.*pallas"):
        resolve_kv_dtype("float16", "bfloat16", "pallas", "tpu")
    # fp8 by the rule of fp8 weights: a chip with fp8 takes it, one without is named
    assert resolve_kv_dtype("float8_e4m3fn", "bfloat16", "pallas", "gpu", "NVIDIA H100 80GB HBM3", "9.0") \
        == "float8_e4m3fn"
    with pytest.raises(ValueError, match="engine.kv_dtype float8_e4m3fn needs fp8.*v5"):
        resolve_kv_dtype("float8_e4m3fn", "bfloat16", "pallas", "tpu", "TPU v5 lite")
    # the TPU kernel reads a compact dequantized copy of the table's pages: its work follows the table then
    assert work_follows_table("pallas", "tpu", "int8") and not work_follows_table("pallas", "tpu", "bfloat16")
    assert not work_follows_table("xla", "cpu", "int8")


# -- the backends on one quantized pool ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("window,cap", [(None, None), (4, None), (None, 3.0)])
def test_xla_reads_the_quantized_pool_as_the_definition_over_its_dequantized_values(dtype, window, cap):
    args = quantized_step(dtype, **MIXED, seed=3)
    pool = args[1]
    dense = (args[0], jnp.nan_to_num(pool.dequantized()), *args[2:5])
    ref = xla.dense_reference(*dense, int(args[5][0]), sm_scale=SCALE, sliding_window=window, soft_cap=cap)
    out = xla.ragged_paged_attention(*args, sm_scale=SCALE, sliding_window=window, soft_cap=cap)
    assert_matches(out, ref, args)
    small = xla.ragged_paged_attention(*args, sm_scale=SCALE, sliding_window=window, soft_cap=cap, block_q=2,
                                       kv_block_pages=1)
    assert_matches(small, ref, args)


def test_int8_pool_reads_close_to_the_float_pool():
    """The same step over the float pool and its int8 quantization: outputs within the quantization's error
    (each key and value element off by at most max|x| / 254, which moves a score of 32 standard normal products
    by ~0.05 at this scale)."""
    float_args = make_step(**MIXED, seed=3)
    pool = np.asarray(float_args[1])
    unused = np.isnan(pool).any(axis=-1, keepdims=True)
    q_args = quantized_step("int8", **MIXED, seed=3)
    ref = xla.ragged_paged_attention(float_args[0], jnp.asarray(np.where(unused, 0.0, pool)), *float_args[2:],
                                     sm_scale=SCALE)
    out = xla.ragged_paged_attention(*q_args, sm_scale=SCALE)
    n = live_rows(q_args)
    err = np.abs(np.asarray(out)[:n] - np.asarray(ref)[:n])
    assert err.max() < 0.05 and err.mean() < 0.01, (err.max(), err.mean())


@pytest.mark.parametrize("layout", ["rows", "tpu"])
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_pallas_tpu_interpret_reads_the_quantized_pool_as_xla(tpu_interpreter, dtype, layout):  # noqa: F811
    """The TPU wrapper's dequantized copy of the table's pages, from a pool in either layout, read by jax's kernel
    (interpret mode), equals the XLA path over the rows layout; the XLA path reads the TPU layout alike."""
    args = quantized_step(dtype, **MIXED, q_heads=8, head_dim=128, seed=1)
    ref = xla.ragged_paged_attention(*args, sm_scale=SCALE, soft_cap=2.0)
    if layout == "tpu":
        pool = args[1].in_layout(kv_quant.tpu_pages_per_row(args[1].shape[1], args[1].shape[0]))
        assert pool.pages_per_row == 32  # 32 pages of 4 tokens: one 128-lane row of scales per head
        args = (args[0], pool, *args[2:])
        assert_matches(xla.ragged_paged_attention(*args, sm_scale=SCALE, soft_cap=2.0), ref, args)
    out = pallas_tpu.ragged_paged_attention(*args, sm_scale=SCALE, soft_cap=2.0, num_queries_per_block=4,
                                            num_kv_pages_per_block=2, interpret=True)
    assert_matches(out, ref, args)
    assert not np.asarray(out[live_rows(args):]).any()


def test_the_tpu_layout_is_chosen_on_tpu_only_and_where_pages_fill_its_rows():
    assert kv_quant.tpu_pages_per_row(16, 18432) == 8 and kv_quant.tpu_pages_per_row(256, 10) == 1
    assert kv_quant.tpu_pages_per_row(16, 18436) == 0 and kv_quant.tpu_pages_per_row(48, 64) == 0
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    assert kv_quant.layout_for((2, 64, 16, 4, 128), cpu) == 0
    pool = kv_quant.abstract_pool((2, 64, 16, 4, 128), "int8", cpu)
    assert pool.pages_per_row == 0 and pool.stored_values.shape == (2, 64, 16, 4, 128)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_pallas_gpu_interpret_reads_the_quantized_pool_as_xla(dtype):
    """The decode kernel with per-token scales (jax's `k_scales_pages` / `v_scales_pages`, multiplied inside the
    kernel), through the engine's single-token entry point and the cond of the general one."""
    args = quantized_step(dtype, **DECODE, q_heads=8, seed=4)
    ref = xla.ragged_paged_attention(*args, sm_scale=SCALE, soft_cap=4.0)
    out = pallas_gpu.single_token_attention(*args, sm_scale=SCALE, soft_cap=4.0, interpret=True)
    assert_matches(out, ref, args, atol=1e-4)
    jaxpr = jax.make_jaxpr(lambda *a: pallas_gpu.decode_attention(*a, sm_scale=SCALE, interpret=True))(*args)
    kernels = [eqn for eqn, _ in walk(jaxpr.jaxpr) if eqn.primitive.name == "pallas_call"]
    assert len(kernels) == 1  # the kernel reads the quantized pages and their scales, not a dequantized copy
    assert [str(v.aval.dtype) for v in kernels[0].invars[:5]] == ["float32", dtype, "float32", dtype, "float32"]
    out2 = pallas_gpu.ragged_paged_attention(*args, sm_scale=SCALE, soft_cap=4.0, interpret=True)
    assert_matches(out2, ref, args, atol=1e-4)


# -- the demo engine with an int8 KV cache ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def int8_engine(demo_checkpoint):
    return _build_engine(demo_checkpoint, {"dp": 1}, kv_dtype="int8")


@pytest.fixture(scope="module")
def float_engine(demo_checkpoint):
    """The same engine with the model's float32 cache."""
    return _build_engine(demo_checkpoint, {"dp": 1})


@pytest.mark.model
def test_an_int8_kv_engine_holds_a_quarter_of_the_float32_pool_and_reads_it_as_int8(int8_engine, float_engine):
    pool, ref = int8_engine.pool[0], float_engine.pool[0]
    assert isinstance(pool, QuantizedPool) and pool.dtype == jnp.int8 and int8_engine.kv_dtype == "int8"
    assert pool.shape == ref.shape and pool.scales.shape == (*ref.shape[:-1], 1)
    head_dim = ref.shape[-1]
    assert pool.values.nbytes * 4 == ref.nbytes and pool.scales.nbytes * head_dim == pool.values.nbytes * 4
    assert pool.nbytes == ref.nbytes * (head_dim + 4) // (4 * head_dim)
    ps = int8_engine.programs_set
    hlo = int8_engine.step_hlo(min(t for t in ps.token_buckets if t > 1), ps.page_buckets[0])
    pool_shape = ",".join(map(str, pool.shape))
    assert f"s8[{pool_shape}]" in hlo  # the programs take the int8 pool
    assert f"f32[{pool_shape}]" not in hlo  # and make no float copy of it


@pytest.mark.model
def test_int8_kv_greedy_tokens_and_logprobs_near_the_float32_caches(int8_engine, float_engine, prompt_ids):
    """The parity prompts' greedy tokens with an int8 cache follow the float32 cache's for at least 8 tokens (measured:
    48, 48 and 12 of 48: the third then takes the other side of a near tie), and over the tokens both drew the
    logprobs stay near: measured mean |difference| 0.014, 0.018 and 0.031, largest 0.18 (a first token drawn at
    p ~ 0.15, where every prompt key counts); bounds 0.05 and 0.25. The perplexity and KL bounds against the float
    model are in tests/test_quant_accuracy.py."""
    got = _alone(int8_engine, prompt_ids)
    for g, want in zip(got, _alone(float_engine, prompt_ids), strict=True):
        same = next((i for i, (a, b) in enumerate(zip(g["out"], want["out"], strict=True)) if a != b), len(g["out"]))
        assert same >= 8, (same, g["out"], want["out"])
        diff = np.abs(np.asarray(g["logprobs"][:same]) - np.asarray(want["logprobs"][:same]))
        assert diff.max() < 0.25 and diff.mean() < 0.05, (diff.max(), diff.mean())


@pytest.mark.model
def test_int8_kv_prefix_reuse_and_chunked_prefill_give_the_tokens_of_a_request_alone(int8_engine, prompt_ids):
    """A request that starts from another's int8 pages, and prompts prefilled in chunks of 16 beside running
    decode rows, get the tokens the same requests get alone on the same int8 engine (a token's key and value are
    quantized on their own: a page holds the same bytes whoever wrote it, whichever step)."""
    system = prompt_ids[1][:-3]
    first = system + prompt_ids[1][-3:]
    second = system + [int(t) for t in prompt_ids[0][-5:]]
    whole = _alone(int8_engine, [second])[0]["out"]
    d = PlanDriver(int8_engine)
    a = d.add("a", first, 60)
    d.on_result(p := d.plan(), int8_engine.step(p))
    d.add("b", second, NEW_TOKENS, share_from=a)
    assert d.live[a]["pages"][:2] == d.live[next(s for s in d.live if s != a)]["pages"][:2]
    got = {}
    while d.live:
        plan = d.plan()
        got.update(d.on_result(plan, int8_engine.step(plan)))
    assert got["b"]["out"] == whole
    by_itself = _alone(int8_engine, prompt_ids[:2])
    chunked = PlanDriver(int8_engine, chunk=16).run(
        [("a", prompt_ids[0], NEW_TOKENS, None), ("b", prompt_ids[1], NEW_TOKENS, None)], stagger=[0, 5])
    assert chunked["a"]["out"] == by_itself[0]["out"] and chunked["b"]["out"] == by_itself[1]["out"]


@pytest.mark.model
def test_the_tpu_layout_through_the_engines_programs_gives_the_rows_layouts_tokens(demo_checkpoint, int8_engine,
                                                                                     prompt_ids, monkeypatch):
    """The engine's own write (pages flattened with the layers, one-token steps, chunks) and reads over a pool in
    the TPU layout (`kv_quant.stored_shapes`), here forced on CPU where the XLA path reads it through its views:
    the greedy tokens of the rows layout's engine, alone and in chunks beside decode rows."""
    want = _alone(int8_engine, prompt_ids)  # before the patch: that engine's programs keep the rows layout
    chosen = []

    def tpu_everywhere(shape, sharding):
        r = kv_quant.tpu_pages_per_row(shape[-3], shape[-4]) if len(shape) >= 4 else 0
        chosen.append(r)
        return r

    monkeypatch.setattr(kv_quant, "layout_for", tpu_everywhere)
    engine = _build_engine(demo_checkpoint, {"dp": 1}, kv_dtype="int8")
    pool = engine.pool[0]
    assert pool.pages_per_row > 0 and pool.stored_values.shape[2:4] == (1, pool.shape[3])
    assert pool.shape == int8_engine.pool[0].shape
    got = _alone(engine, prompt_ids)
    assert [g["out"] for g in got] == [w["out"] for w in want]
    chunked = PlanDriver(engine, chunk=16).run(
        [("a", prompt_ids[0], NEW_TOKENS, None), ("b", prompt_ids[1], NEW_TOKENS, None)], stagger=[0, 5])
    assert chunked["a"]["out"] == want[0]["out"] and chunked["b"]["out"] == want[1]["out"]
    assert all(r == pool.pages_per_row for r in chosen if r)
