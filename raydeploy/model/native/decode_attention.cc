// Paged attention of decode rows (one query token per sequence), summed in float32, as an XLA FFI handler: the part of
// raydeploy/engine/attention/xla.py that decode passes spend their attention time in, read straight from the
// page pool. Built and registered by raydeploy/model/native/__init__.py.
//
// Why: XLA gathers each block of every row's pages into a head-major copy before two small batched matmuls;
// on CPU the gathers and copies cost more than the arithmetic (8 rows of ~150 cached tokens, demo model: about
// 0.5 ms of a 2 ms layer). Here each (row, kv head) reads its keys and values once from the pool where they
// lie, scores its query heads against them, and writes the softmax-weighted sum.
//
// Inputs: q [S, Hq, D] float32 (each row's query token), pool [P, page_size, 2*Hkv, D] (K head h at 2h, V at 2h+1)
// in float32, bfloat16 or float16 (`engine.kv_dtype`: a 16-bit pool is half the bytes each pass reads, and the
// decode rows' attention waits on those reads; each key and value is widened to float32 as it is loaded),
// lens i32[S] (keys the row attends: positions [0, lens); 0 = no output, zeros), page_indices i32[S, pages];
// attributes sm_scale, soft_cap (0 = none), sliding_window (0 = none). Output [S, Hq, D].
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "split.h"

namespace {

// e^x for x <= 0 (Cephes' single-precision polynomial, as the usual AVX ports of it): relative error ~1e-7.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The first `n` lanes set, for masked loads of a vector's last n < 8 floats.
inline __m256i FirstLanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The pool's element types: each reads eight consecutive elements of a K or V row as float32 (`Load`; 16-bit ones
// widened exactly) and one alone (`One`).
struct F32 {
  using Type = float;
  static __m256 Load(const float* p) { return _mm256_loadu_ps(p); }
  static float One(float x) { return x; }
};
struct BF16 {  // the high half of a float32
  using Type = uint16_t;
  static __m256 Load(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static float One(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};
struct F16 {  // F16C
  using Type = uint16_t;
  static __m256 Load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float One(uint16_t x) { return _cvtsh_ss(x); }
};

// The first n < 8 elements at p as float32, the rest zero (`lanes`: the first n set, for float32's masked load).
template <typename E>
inline __m256 LoadFirst(const typename E::Type* p, int64_t n, __m256i lanes) {
  if constexpr (std::is_same_v<E, F32>) {
    return _mm256_maskload_ps(p, lanes);
  } else {
    alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; ++i) tmp[i] = E::One(p[i]);
    return _mm256_load_ps(tmp);
  }
}

struct Shape {
  int64_t rows, heads, kv_heads, dim, num_pages, page_size, table_width;
  float scale, soft_cap;
  int64_t window;
};

// What one thread reuses from unit to unit: scores [G][n rounded up to 8], the keys' addresses.
struct Scratch {
  std::vector<float> scores;
  std::vector<const void*> keys;
};

// o[0:V*8] = sum_j p[j] * v_j[0:V*8] / total over the n tokens at `keys` (V at + D): the V*8 sums in registers.
template <typename E, int V>
inline void WeightedValues(const float* p, const typename E::Type* const* keys, int64_t n, int64_t D, int64_t d,
                           float inv, float* o) {
  __m256 acc[V];
  for (int c = 0; c < V; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pv = _mm256_broadcast_ss(p + j);
    const typename E::Type* v = keys[j] + D + d;
    for (int c = 0; c < V; ++c) acc[c] = _mm256_fmadd_ps(pv, E::Load(v + 8 * c), acc[c]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
  for (int c = 0; c < V; ++c) _mm256_storeu_ps(o + d + 8 * c, _mm256_mul_ps(acc[c], iv));
}

// Row s, kv head h: its G = heads / kv_heads query heads against keys [lo, len) of the row's pages. The keys'
// addresses are found once, page by page; each query head scores eight keys at a time (eight dot products in
// registers, reduced together), and sums the values a slice of up to 64 dims at a time in registers.
template <typename E>
void RowHead(const Shape& sh, const float* q, const typename E::Type* pool, const int32_t* lens,
             const int32_t* table, float* out, int64_t s, int64_t h, Scratch& sc) {
  using T = typename E::Type;
  const int64_t G = sh.heads / sh.kv_heads, D = sh.dim;
  float* o = out + (s * sh.heads + h * G) * D;
  const int64_t len = lens[s] < 0 ? 0 : lens[s];
  if (len == 0) {
    std::memset(o, 0, sizeof(float) * G * D);
    return;
  }
  const int64_t lo = sh.window > 0 && len > sh.window ? len - sh.window : 0;
  const int64_t n = len - lo, np = (n + 7) / 8 * 8;
  const int64_t stride = 2 * sh.kv_heads * D;  // one token's K and V of every head
  sc.keys.resize(np);
  sc.scores.resize(G * np);
  int64_t slot = lo / sh.page_size, off = lo % sh.page_size;
  auto page_base = [&](int64_t i) {
    int64_t page = table[s * sh.table_width + i];
    page = page < 0 ? 0 : page >= sh.num_pages ? sh.num_pages - 1 : page;
    return pool + page * sh.page_size * stride + 2 * h * D;  // K of the page's first token; V follows at + D
  };
  const T* base = page_base(slot);
  const T** keys = reinterpret_cast<const T**>(sc.keys.data());
  for (int64_t j = 0; j < n; ++j) {
    keys[j] = base + off * stride;
    if (++off == sh.page_size && j + 1 < n) {
      off = 0;
      base = page_base(++slot);
    }
  }
  for (int64_t j = n; j < np; ++j) keys[j] = keys[0];  // padding: scored, then weighted by zero
  const float* qs = q + (s * sh.heads + h * G) * D;
  const int64_t d8 = D / 8 * 8;
  const __m256i tail = FirstLanes(D - d8);
  const __m256 scale = _mm256_set1_ps(sh.scale);
  for (int64_t j0 = 0; j0 < np; j0 += 8) {  // eight keys at a time, every query head while they are in L1
    const T* const* k = keys + j0;
    if (j0 + 16 <= np)  // the next eight keys on their way while these are scored
      for (int t = 8; t < 16; ++t)
        for (int64_t d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(k[t] + d), _MM_HINT_T0);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < d8; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(E::Load(k[t] + d), qv, acc[t]);
      }
      if (d8 < D) {
        const __m256 qv = _mm256_maskload_ps(qg + d8, tail);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(LoadFirst<E>(k[t] + d8, D - d8, tail), qv, acc[t]);
      }
      const __m256 dots = Sum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
      _mm256_storeu_ps(sc.scores.data() + g * np + j0, _mm256_mul_ps(dots, scale));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* p = sc.scores.data() + g * np;
    float peak = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      if (sh.soft_cap > 0) p[j] = sh.soft_cap * std::tanh(p[j] / sh.soft_cap);
      if (p[j] > peak) peak = p[j];
    }
    const __m256 m = _mm256_set1_ps(peak);  // p = e^(x - max), zero past n
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < np; j += 8) {
      __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
      if (j + 8 > n) e = _mm256_and_ps(e, _mm256_castsi256_ps(FirstLanes(n - j)));
      _mm256_storeu_ps(p + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    const float inv = 1.0f / (lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7]);
    float* og = o + g * D;
    for (int64_t d = 0; d < d8; d += 64) {
      UpTo8((d8 - d) / 8, [&](auto v) {  // up to 64 dims a call
        WeightedValues<E, decltype(v)::value>(p, keys, n, D, d, inv, og);
      });
    }
    for (int64_t d = d8; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t j = 0; j < n; ++j) acc += p[j] * E::One(keys[j][D + d]);
      og[d] = acc * inv;
    }
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                               ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> table, float sm_scale,
                               float soft_cap, int64_t sliding_window, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = kv.dimensions(), ld = lens.dimensions(), td = table.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 3 || kd.size() != 4 || ld.size() != 1 || td.size() != 2 || od.size() != 3 || kd[2] % 2 ||
      kd[3] != qd[2] || ld[0] != qd[0] || td[0] != qd[0] || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2])
    return ffi::Error::InvalidArgument(
        "raydeploy decode_attention: expected q [S, Hq, D], pool [P, page_size, 2*Hkv, D], lens [S], "
        "page_indices [S, pages], out [S, Hq, D]");
  const ffi::DataType kv_type = kv.element_type();
  if (kv_type != ffi::DataType::F32 && kv_type != ffi::DataType::BF16 && kv_type != ffi::DataType::F16)
    return ffi::Error::InvalidArgument("raydeploy decode_attention: the pool must be float32, bfloat16 or float16");
  const int64_t kv_heads = kd[2] / 2;
  if (kv_heads == 0 || qd[1] % kv_heads)
    return ffi::Error::InvalidArgument("raydeploy decode_attention: query heads must be a multiple of kv heads");
  const Shape sh{qd[0], qd[1], kv_heads, qd[2], kd[0], kd[1], td[1], sm_scale, soft_cap, sliding_window};
  const int32_t* lp = lens.typed_data();
  for (int64_t s = 0; s < sh.rows; ++s)
    if (lp[s] > sh.page_size * sh.table_width)
      return ffi::Error::InvalidArgument("raydeploy decode_attention: a row's length exceeds its page table");
  const float* qp = q.typed_data();
  const void* kp = kv.untyped_data();
  const int32_t* tp = table.typed_data();
  float* op = out->typed_data();
  const int64_t units = sh.rows * sh.kv_heads;
  auto run = [&](auto elem) {
    using E = decltype(elem);
    const auto* pool_data = static_cast<const typename E::Type*>(kp);
    Split(pool, units, [&](int64_t u0, int64_t u1) {
      thread_local Scratch scratch;
      for (int64_t u = u0; u < u1; ++u)
        RowHead<E>(sh, qp, pool_data, lp, tp, op, u / sh.kv_heads, u % sh.kv_heads, scratch);
    });
  };
  if (kv_type == ffi::DataType::F32) run(F32{});
  else if (kv_type == ffi::DataType::BF16) run(BF16{});
  else run(F16{});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeployDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Ret<ffi::Buffer<ffi::F32>>());
