"""The native CPU attention of decode rows (`raydeploy.engine.matmul.cpu_native.decode_attention`): one query token per row
against the keys of its pages, read straight from the pool, equal to the XLA backend's decode path over shapes
that exercise every remainder (grouped query heads, a head dim past the 8-wide vectors, rows of 0, 1 and a page
plus one keys, page tables in any order, a sliding window, a soft cap), over float32, bfloat16 and float16 pools
(`engine.kv_dtype`); used by the XLA backend only when an engine hands it over (`decode_rows`); a row longer
than its page table is an error that says so, and so is a pool of another dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raydeploy.engine.attention import Attention, xla
from raydeploy.engine.matmul.cpu_native import decode_attention
from raydeploy.model import native


def _case(seed: int, lens: list[int], hq: int, hkv: int, d: int, page_size: int, pages_per_seq: int,
          kv_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    s = len(lens)
    num_pages = s * pages_per_seq + 3
    pool = rng.standard_normal((num_pages, page_size, 2 * hkv, d), dtype=np.float32)
    table = rng.permutation(num_pages)[: s * pages_per_seq].reshape(s, pages_per_seq).astype(np.int32)
    q = rng.standard_normal((s, hq, d), dtype=np.float32)
    return jnp.asarray(q), jnp.asarray(pool, kv_dtype), jnp.asarray(lens, jnp.int32), jnp.asarray(table)


def _native(fn, *args):
    """fn jitted and run."""
    return jax.jit(fn).lower(*args).compile()(*args)


def _xla_decode(q, pool, lens, table, **kw):
    """The XLA backend's decode path: every row one token (cu_q_lens 0, 1, ..., S)."""
    s = q.shape[0]
    live = lens > 0
    cu = jnp.arange(s + 1, dtype=jnp.int32)
    n = jnp.asarray([s], jnp.int32)
    out = xla.ragged_paged_attention(q, pool, jnp.where(live, lens, 1), table, cu, n, **kw)
    return jnp.where(live[:, None, None], out, 0.0)


@pytest.mark.parametrize("lens,hq,hkv,d,page_size,pps,window,cap", [
    ([1, 5, 16, 17, 40], 6, 2, 64, 16, 3, None, None),      # G = 3, a page plus one key
    ([0, 3, 33, 64], 9, 3, 64, 16, 4, None, None),          # a row without keys: zeros (the demo model's heads)
    ([7, 29, 2], 4, 4, 20, 4, 8, None, None),               # no grouping, a head dim past the 8-wide vectors
    ([50, 9, 1], 8, 2, 32, 8, 7, 7, None),                  # sliding window
    ([12, 31], 4, 1, 16, 4, 8, None, 30.0),                 # soft cap, one kv head for all
    ([70, 130, 3], 8, 2, 128, 16, 9, None, None),           # values summed 64 dims at a time, twice; many key blocks
    ([45, 8, 100], 6, 3, 80, 8, 13, 37, None),              # 64 + 16 dims, a window across pages of 8
    ([33, 17, 90], 10, 2, 48, 16, 6, None, None),           # G = 5: three query heads at once, then two; 48 dims
])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
def test_kernel_equals_the_xla_decode_path(native_library, lens, hq, hkv, d, page_size, pps, window, cap, kv_dtype):
    """The XLA path widens a 16-bit pool to float32 as it reads it, as the kernel does: the same values."""
    q, pool, lens_a, table = _case(sum(lens) + hq + d, lens, hq, hkv, d, page_size, pps, jnp.dtype(kv_dtype))
    kw = dict(sm_scale=1.0 / np.sqrt(d), sliding_window=window, soft_cap=cap)
    got = _native(lambda *a: decode_attention(*a, **kw), q, pool, lens_a, table)
    want = _xla_decode(q, pool, lens_a, table, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.asarray(got)[np.asarray(lens_a) == 0].any()


def test_the_xla_backend_uses_it_only_when_handed_the_kernel(native_library):
    """`decode_rows` (what an engine whose matmul backend is `cpu_native` hands its XLA attention, through
    `Attention.with_decode_rows`): the kernel serves the decode rows, with XLA's values; without it, no kernel."""
    q, pool, lens, table = _case(3, [4, 20, 9], 6, 2, 64, 16, 2)
    cu, n = jnp.arange(4, dtype=jnp.int32), jnp.asarray([3], jnp.int32)
    plain = jax.jit(lambda *a: xla.ragged_paged_attention(*a, sm_scale=0.125)).lower(q, pool, lens, table, cu, n)
    assert native.TARGET_ATTENTION not in plain.as_text()
    with_kernel = Attention(xla.ragged_paged_attention).with_decode_rows(decode_attention)
    attend = jax.jit(lambda *a: with_kernel.ragged(*a, sm_scale=0.125))
    lowered = attend.lower(q, pool, lens, table, cu, n)
    assert native.TARGET_ATTENTION in lowered.as_text()
    np.testing.assert_allclose(np.asarray(lowered.compile()(q, pool, lens, table, cu, n)),
                               np.asarray(plain.compile()(q, pool, lens, table, cu, n)), rtol=2e-5, atol=2e-5)
    assert Attention(xla.ragged_paged_attention).with_decode_rows(None).ragged is xla.ragged_paged_attention
    # a bfloat16 query (a bfloat16 model) stays with XLA; a bfloat16 pool beside a float32 query does not
    bf = attend.lower(q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16), lens, table, cu, n)
    half_pool = attend.lower(q, pool.astype(jnp.bfloat16), lens, table, cu, n)
    assert native.TARGET_ATTENTION not in bf.as_text()
    assert native.TARGET_ATTENTION in half_pool.as_text()


def test_a_row_longer_than_its_page_table_is_refused(native_library):
    q, pool, _, table = _case(5, [4, 4], 2, 1, 8, 4, 2)
    with pytest.raises(Exception, match="decode_attention: a row's length exceeds its page table"):
        np.asarray(_native(lambda *a: decode_attention(*a, sm_scale=1.0), q, pool,
                           jnp.asarray([4, 9], jnp.int32), table))


def test_a_pool_of_another_dtype_is_refused_by_the_kernel(native_library):
    """The Python side sends only the dtypes the kernel reads; the kernel itself names them if called otherwise."""
    q, pool, lens, table = _case(6, [4, 4], 2, 1, 8, 4, 2)
    call = jax.ffi.ffi_call(native.TARGET_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    with pytest.raises(Exception, match="the pool must be float32, bfloat16 or float16"):
        np.asarray(_native(lambda *a: call(*a, sm_scale=np.float32(1.0), soft_cap=np.float32(0.0),
                                           sliding_window=np.int64(0)), q, pool.astype(jnp.int8), lens, table))
    assert decode_attention(q, pool, lens, table, sm_scale=1.0) is not None
    assert decode_attention(q, pool.astype(jnp.int8), lens, table, sm_scale=1.0) is None
