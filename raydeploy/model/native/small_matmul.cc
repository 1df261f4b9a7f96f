// y[M, N] = x[M, K] @ w[layer][K, N] in float32 for few rows M (CPU decode passes and small prompt steps), as an
// XLA FFI handler. Built and registered by raydeploy/model/native/__init__.py; see there for when the engine
// uses it.
//
// Why: XLA CPU multiplies 2-32 rows by a weight through a general matrix product whose register tiles are made
// for many rows; on one thread its dots take 1.3-2.2x the time of these loops (benchmarks/small_matmul.py).
// Up to 16 rows, each weight row is streamed once from memory while the rows' partial sums stay in L1
// (`Block`); beyond, 4 x 16 tiles of y stay in registers over k-blocks of the weight (`ManyRows`). The weight
// is the whole stacked layer tensor [L, K, N] and the layer an operand: a layer scan then passes the stacked
// weights through untouched, where a slice of them would be copied before every matmul. Where the CPU has AVX-512
// the library is built with it (`raydeploy.model.native.isa`): register-blocked strips instead of `Block`, and the
// handlers for bfloat16 weights.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "split.h"

namespace {

#if !defined(__AVX512F__)
// AVX2 (the build for CPUs without AVX-512).
constexpr int64_t kCols = 512;  // output columns per block: the rows' partial sums [kRows, kCols] fit in L1
constexpr int64_t kRows = 16;

// y[:, n0 : n0 + nb] for at most kRows rows; nb a multiple of 8, at most kCols.
void Block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t Kr, int64_t N, int64_t n0,
           int64_t nb) {
  alignas(32) float acc[kRows * kCols];
  std::memset(acc, 0, sizeof(float) * M * kCols);
  const int64_t nv = nb / 8;
  int64_t k = 0;
  for (; k + 8 <= Kr; k += 8) {
    const float* w0 = w + k * N + n0;
    if (k + 16 <= Kr) {  // the next eight weight rows of this block: each starts on another page
      const float* p = w0 + 8 * N;
      for (int r = 0; r < 8; ++r)
        for (int64_t j = 0; j < nb; j += 16) _mm_prefetch(reinterpret_cast<const char*>(p + r * N + j), _MM_HINT_T0);
    }
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + k;
      __m256 b[8];
      for (int r = 0; r < 8; ++r) b[r] = _mm256_broadcast_ss(xm + r);
      float* am = acc + m * kCols;
      for (int64_t v = 0; v < nv; ++v) {
        const float* wv = w0 + 8 * v;
        __m256 a = _mm256_load_ps(am + 8 * v);
        __m256 c = _mm256_mul_ps(b[4], _mm256_loadu_ps(wv + 4 * N));
        a = _mm256_fmadd_ps(b[0], _mm256_loadu_ps(wv), a);
        c = _mm256_fmadd_ps(b[5], _mm256_loadu_ps(wv + 5 * N), c);
        a = _mm256_fmadd_ps(b[1], _mm256_loadu_ps(wv + N), a);
        c = _mm256_fmadd_ps(b[6], _mm256_loadu_ps(wv + 6 * N), c);
        a = _mm256_fmadd_ps(b[2], _mm256_loadu_ps(wv + 2 * N), a);
        c = _mm256_fmadd_ps(b[7], _mm256_loadu_ps(wv + 7 * N), c);
        a = _mm256_fmadd_ps(b[3], _mm256_loadu_ps(wv + 3 * N), a);
        _mm256_store_ps(am + 8 * v, _mm256_add_ps(a, c));
      }
    }
  }
  for (; k < Kr; ++k) {
    const float* w0 = w + k * N + n0;
    for (int64_t m = 0; m < M; ++m) {
      const __m256 b0 = _mm256_broadcast_ss(x + m * K + k);
      float* am = acc + m * kCols;
      for (int64_t v = 0; v < nv; ++v)
        _mm256_store_ps(am + 8 * v, _mm256_fmadd_ps(b0, _mm256_loadu_ps(w0 + 8 * v), _mm256_load_ps(am + 8 * v)));
    }
  }
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, acc + m * kCols, sizeof(float) * nb);
}

// Many rows (a prompt chunk): y's columns [n0, n0 + nb) for all M rows, computed over k-blocks of the weight
// that stay in cache while every 4-row block of x passes over them; each 4 x 16 tile of y in registers.
constexpr int64_t kTileK = 128;

template <int NV>
inline void Tile4(const float* x, int64_t mr, const float* w, float* y, int64_t K, int64_t N, int64_t k0, int64_t kb,
                  bool first) {
  __m256 a[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j)
      a[i][j] = (first || i >= mr) ? _mm256_setzero_ps() : _mm256_loadu_ps(y + i * N + 8 * j);
  const float* xr[4];
  for (int i = 0; i < 4; ++i) xr[i] = x + (i < mr ? i : 0) * K + k0;
  const float* wk = w + k0 * N;
  for (int64_t k = 0; k < kb; ++k, wk += N) {
    __m256 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = _mm256_loadu_ps(wk + 8 * j);
    for (int i = 0; i < 4; ++i) {
      const __m256 b = _mm256_broadcast_ss(xr[i] + k);
      for (int j = 0; j < NV; ++j) a[i][j] = _mm256_fmadd_ps(b, wv[j], a[i][j]);
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(y + i * N + 8 * j, a[i][j]);
}

void ManyRows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t Kr, int64_t N, int64_t n0,
              int64_t nb) {
  for (int64_t k0 = 0; k0 < Kr; k0 += kTileK) {
    const int64_t kb = Kr - k0 < kTileK ? Kr - k0 : kTileK;
    for (int64_t c = 0; c < nb; c += 16) {
      const float* wc = w + n0 + c;
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t mr = M - m < 4 ? M - m : 4;
        if (nb - c >= 16)
          Tile4<2>(x + m * K, mr, wc, y + m * N + n0 + c, K, N, k0, kb, k0 == 0);
        else
          Tile4<1>(x + m * K, mr, wc, y + m * N + n0 + c, K, N, k0, kb, k0 == 0);
      }
    }
  }
}

// Columns [c0, c1) of y (multiples of 8) for every row, in blocks of at most kCols columns (float32 weights), from
// weight rows [0, Kr): x's rows are K apart.
template <typename W>
void Columns(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t Kr, int64_t N, int64_t c0,
             int64_t c1) {
  for (int64_t n0 = c0; n0 < c1; n0 += kCols) {
    const int64_t nb = c1 - n0 < kCols ? c1 - n0 : kCols;
    if (M > kRows) {
      ManyRows(x, w, y, M, K, Kr, N, n0, nb);
      continue;
    }
    Block(x, w, y, M, K, Kr, N, n0, nb);
  }
}
#else
// AVX-512 (built so where the CPU has it): register-blocked. The weight is read in blocks of kDepth rows; within a
// block, strips of 48 columns (3 vectors of 16) pass every group of up to 8 rows over the strip, the group's
// 8 x 48 outputs in 24 registers (added to y after the first block). A block's rows are read left to right, a few
// sequential streams the prefetchers follow; on a Xeon with AVX-512 this streams a weight from memory ~2x faster
// than whole-K strips (one 48-column strip down all rows) or the AVX2 accumulator blocks in L1.
constexpr int kStrip = 3;      // vectors of 16 columns per strip
constexpr int kGroup = 8;      // rows per register block
constexpr int64_t kDepth = 8;  // weight rows per block
// With more than one row group every block's output tiles are loaded and stored once per group: deeper blocks do
// so less often while a block (32 x 48 weights) stays in L1 for the groups. 211 matmuls of 32 rows, 2 threads:
// 77.4 ms at depth 8, 53.7 at 32 (XLA's dot 63.9); 16: 62.2, 128: 68.6.
constexpr int64_t kDeepDepth = 32;  // weight rows per block for more than one row group

// Sixteen weights as float32: float32 as they are, bfloat16 (stored as uint16_t) widened by a shift, so a
// bfloat16 weight streams half the bytes and multiplies float32 rows of x exactly.
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// The lanes of `m` (the rest zero).
inline __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load16(const uint16_t* p, __mmask16 m) {
  if (m == 0xFFFF) return Load16(p);
  alignas(32) uint16_t t[16] = {};
  for (int i = 0; i < 16; ++i)
    if ((m >> i) & 1) t[i] = p[i];
  return Load16(t);
}

template <int MR, int C, typename W, bool Ahead>
inline void Strip512(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n, int64_t k0,
                     int64_t kb, __mmask16 last) {
  __m512 a[MR][C];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < C - 1; ++j) a[i][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * N + n + 16 * j);
    a[i][C - 1] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(last, y + i * N + n + 16 * (C - 1));
  }
  const W* wk = w + k0 * N + n;
  for (int64_t k = k0; k < k0 + kb; ++k, wk += N) {
    if (Ahead)  // the same columns of the next block's rows (one row group only: more rows are compute-bound)
      for (int j = 0; j < C; j += 64 / (16 * static_cast<int>(sizeof(W))))
        _mm_prefetch(reinterpret_cast<const char*>(wk + kDepth * N + 16 * j), _MM_HINT_T0);
    __m512 wv[C];
    for (int j = 0; j < C - 1; ++j) wv[j] = Load16(wk + 16 * j);
    wv[C - 1] = Load16(wk + 16 * (C - 1), last);
    for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(x[i * K + k]);
      for (int j = 0; j < C; ++j) a[i][j] = _mm512_fmadd_ps(b, wv[j], a[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < C - 1; ++j) _mm512_storeu_ps(y + i * N + n + 16 * j, a[i][j]);
    _mm512_mask_storeu_ps(y + i * N + n + 16 * (C - 1), last, a[i][C - 1]);
  }
}

template <int C, typename W, bool Ahead>
inline void Group512(const float* x, const W* w, float* y, int64_t mr, int64_t K, int64_t N, int64_t n,
                     int64_t k0, int64_t kb, __mmask16 last) {
  UpTo8(mr, [&](auto r) { Strip512<decltype(r)::value, C, W, Ahead>(x, w, y, K, N, n, k0, kb, last); });
}

// A strip of 1 to 3 vectors.
template <typename W, bool Ahead>
inline void Strips(int vecs, const float* x, const W* w, float* y, int64_t mr, int64_t K, int64_t N, int64_t n,
                   int64_t k0, int64_t kb, __mmask16 last) {
  if (vecs == 3)
    Group512<3, W, Ahead>(x, w, y, mr, K, N, n, k0, kb, last);
  else if (vecs == 2)
    Group512<2, W, Ahead>(x, w, y, mr, K, N, n, k0, kb, last);
  else
    Group512<1, W, Ahead>(x, w, y, mr, K, N, n, k0, kb, last);
}

// Columns [c0, c1) of y (multiples of 8) for every row, from weight rows [0, Kr): x's rows are K apart.
template <typename W>
void Columns(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t Kr, int64_t N, int64_t c0,
             int64_t c1) {
  const int64_t depth = M <= kGroup ? kDepth : kDeepDepth;
  for (int64_t k0 = 0; k0 < Kr; k0 += depth) {
    const int64_t kb = Kr - k0 < depth ? Kr - k0 : depth;
    for (int64_t n = c0; n < c1; n += 16 * kStrip) {
      const int64_t width = c1 - n < 16 * kStrip ? c1 - n : 16 * kStrip;
      const int vecs = static_cast<int>((width + 15) / 16);
      const int tail = static_cast<int>(width - 16 * (vecs - 1));
      const __mmask16 last = static_cast<__mmask16>(tail == 16 ? 0xFFFF : (1u << tail) - 1);
      for (int64_t m = 0; m < M; m += kGroup) {
        const int64_t mr = M - m < kGroup ? M - m : kGroup;
        const float* xm = x + m * K;
        float* ym = y + m * N;
        if (M <= kGroup && k0 + kDepth < Kr)  // one row group streams the weight: prefetch the next block
          Strips<W, true>(vecs, xm, w, ym, mr, K, N, n, k0, kb, last);
        else
          Strips<W, false>(vecs, xm, w, ym, mr, K, N, n, k0, kb, last);
      }
    }
  }
}

#endif

constexpr int64_t kRowAlign = 8;  // pieces start on a multiple of 8 weight rows

// The weight's rows split over the threads, each streaming one contiguous block of rows into partial
// sums of all of y, added at the end. Splitting the columns instead had each thread read part of every weight
// row (a 576-wide weight: 1152-byte runs a row apart), which the prefetchers follow far worse: 211 chained
// 8-row matmuls of the demo's shapes took 38.7 ms so, 32.0 split by rows (2 threads, AVX-512 build).
// `part(k0, k1, scratch)` multiplies weight rows [k0, k1) into y (scratch null) or into scratch (`outs` floats,
// each written by the multiply, none read first), and `add(scratch)` adds a scratch into y. The scratch is the
// calling thread's own, kept between calls (a call returns only once every piece is done).
inline void AddInto(float* y, const float* q, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(q + i)));
  for (; i < n; ++i) y[i] += q[i];
}

template <int64_t Align = kRowAlign, typename F, typename A>
void SplitRows(ffi::ThreadPool& pool, int64_t K, int64_t outs, F part, A add) {
  int64_t parts = pool.num_threads();
  if (parts > K / (4 * Align)) parts = K / (4 * Align);
  if (parts <= 1) {
    part(0, K, nullptr);
    return;
  }
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>((parts - 1) * outs)) scratch.resize(static_cast<size_t>((parts - 1) * outs));
  float* base = scratch.data();
  auto rows = [&](int64_t p) { return p == parts ? K : K * p / parts / Align * Align; };
  Split(pool, parts, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) part(rows(p), rows(p + 1), p == 0 ? nullptr : base + (p - 1) * outs);
  });
  for (int64_t p = 1; p < parts; ++p) add(base + (p - 1) * outs);
}

template <typename W>
void Matmul(ffi::ThreadPool& pool, const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  SplitRows(
      pool, K, M * N,
      [&](int64_t k0, int64_t k1, float* scratch) {
        Columns(x + k0, w + k0 * N, scratch ? scratch : y, M, K, k1 - k0, N, 0, N);
      },
      [&](const float* scratch) { AddInto(y, scratch, M * N); });
}

// A weight's rows as the output-first kernel reads them: row(n).load(k) is the row's weights from k as float32, a
// vector of the build's width (16 or 8; the AVX2 build: float32 weights only).
template <typename W>
struct PlainRows {
  const W* w;
  int64_t K;
  struct Row {
    const W* p;
#if defined(__AVX512F__)
    __m512 load(int64_t k) const { return Load16(p + k); }
    __m512 load(int64_t k, __mmask16 m) const { return Load16(p + k, m); }
    const char* at(int64_t k) const { return reinterpret_cast<const char*>(p + k); }
#else
    __m256 load(int64_t k) const { return _mm256_loadu_ps(p + k); }
    float value(int64_t k) const { return p[k]; }
#endif
  };
  Row row(int64_t n) const { return Row{w + n * K}; }
};

// Output-first weights (w [N, K], as a tied embedding table used as the LM head): y[m, n] = x[m] . w[n], four
// weight rows at a time streamed once, two rows of x against them, eight dot products reduced at the end (`Sum8`).
#if defined(__AVX512F__)
// AVX-512: dot products of rows of x with weight rows in registers, K in vectors of 16 (the last masked); a group
// of weight rows stays in L1 while every group of rows of x passes over it.
inline __m256 Half(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// MR rows of x against NR weight rows at a time (MR * NR = 8 or 16 dot products in registers).
template <int MR, int NR, typename Rows>
void OutFirstBlocks(const float* x, const Rows& w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                    int64_t n1) {
  static_assert(MR * NR == 8 || MR * NR == 16, "the dot products reduce eight at a time");
  const int64_t kfull = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - kfull)) - 1);
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = n1 - n < NR ? n1 - n : NR;
    typename Rows::Row wr[NR], ahead[NR];
    for (int j = 0; j < NR; ++j) {
      wr[j] = w.row(n + (j < nr ? j : 0));
      ahead[j] = w.row(n + NR + j);
    }
    for (int64_t m = 0; m < M; m += MR) {
      const int64_t mr = M - m < MR ? M - m : MR;
      const float* xr[MR];
      for (int i = 0; i < MR; ++i) xr[i] = x + (m + (i < mr ? i : 0)) * K;
      __m512 a[MR * NR];
      for (int i = 0; i < MR * NR; ++i) a[i] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NR], xv[MR];
        if (m == 0 && n + 2 * NR <= n1)  // fetch the next weight rows while these are multiplied
          for (int j = 0; j < NR; ++j) _mm_prefetch(ahead[j].at(k), _MM_HINT_T0);
        if (k < kfull) {
          for (int j = 0; j < NR; ++j) wv[j] = wr[j].load(k);
          for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_ps(xr[i] + k);
        } else {
          for (int j = 0; j < NR; ++j) wv[j] = wr[j].load(k, tail);
          for (int i = 0; i < MR; ++i) xv[i] = _mm512_maskz_loadu_ps(tail, xr[i] + k);
        }
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) a[i * NR + j] = _mm512_fmadd_ps(xv[i], wv[j], a[i * NR + j]);
      }
      alignas(32) float out[MR * NR];  // out[i * NR + j]: x row i . weight row j
      for (int g = 0; g < MR * NR; g += 8)
        _mm256_store_ps(out + g, Sum8(Half(a[g]), Half(a[g + 1]), Half(a[g + 2]), Half(a[g + 3]), Half(a[g + 4]),
                                      Half(a[g + 5]), Half(a[g + 6]), Half(a[g + 7])));
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) y[(m + i) * N + n + j] = out[i * NR + j];
    }
  }
}

// One row: eight weight rows at a time; two: four; more: four rows of x against four weight rows.
template <typename Rows>
void OutFirstFrom(const float* x, const Rows& w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if (M == 1)
    OutFirstBlocks<1, 8>(x, w, y, M, K, N, n0, n1);
  else if (M == 2)
    OutFirstBlocks<2, 4>(x, w, y, M, K, N, n0, n1);
  else
    OutFirstBlocks<4, 4>(x, w, y, M, K, N, n0, n1);
}

template <typename W>
void OutFirstRows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  OutFirstFrom(x, PlainRows<W>{w, K}, y, M, K, N, n0, n1);
}

#else
// AVX2: two rows of x against four weight rows at a time (eight dot products in registers); value(k) of a row
// accessor is one weight, for the last K % 8.
template <typename Rows>
void OutFirstFrom(const float* x, const Rows& w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t kv = K / 8 * 8;
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t nr = n1 - n < 4 ? n1 - n : 4;
    typename Rows::Row wr[4];
    for (int j = 0; j < 4; ++j) wr[j] = w.row(n + (j < nr ? j : 0));
    for (int64_t m = 0; m < M; m += 2) {
      const float* x0 = x + m * K;
      const float* x1 = x + (m + 1 < M ? m + 1 : m) * K;
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t k = 0; k < kv; k += 8) {
        const __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
        for (int j = 0; j < 4; ++j) {
          const __m256 wv = wr[j].load(k);
          a[j] = _mm256_fmadd_ps(xa, wv, a[j]);
          a[4 + j] = _mm256_fmadd_ps(xb, wv, a[4 + j]);
        }
      }
      alignas(32) float out[8];  // x0 . w[n..n+3], then x1 . w[n..n+3]
      _mm256_store_ps(out, Sum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
      for (int64_t k = kv; k < K; ++k)
        for (int j = 0; j < 4; ++j) {
          out[j] += x0[k] * wr[j].value(k);
          out[4 + j] += x1[k] * wr[j].value(k);
        }
      for (int j = 0; j < nr; ++j) {
        y[m * N + n + j] = out[j];
        if (m + 1 < M) y[(m + 1) * N + n + j] = out[4 + j];
      }
    }
  }
}

template <typename W>
void OutFirstRows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  OutFirstFrom(x, PlainRows<W>{w, K}, y, M, K, N, n0, n1);
}

#endif

// x [M, K] float32, w [L, K, N] (or out-first [L, N, K]) float32 or bfloat16, the layer index; y [M, N] float32.
template <ffi::DataType WT>
ffi::Error OutFirstImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w, ffi::Buffer<ffi::S32> layer,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] != wd[2] || wd[1] != yd[1] || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("raydeploy small_matmul_out_first: expected x [M, K], w [L, N, K], y [M, N]");
  const int64_t L = wd[0], N = wd[1], K = wd[2], M = xd[0];
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("raydeploy small_matmul: layer index out of range");
  const auto* wl = w.typed_data() + static_cast<int64_t>(l) * K * N;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t groups = (N + 255) / 256;  // 256 weight rows per unit of work
  Split(pool, groups, [&](int64_t g0, int64_t g1) {
    OutFirstRows(xp, wl, yp, M, K, N, g0 * 256, g1 * 256 < N ? g1 * 256 : N);
  });
  return ffi::Error::Success();
}

template <ffi::DataType WT>
ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || xd[1] != wd[1] || wd[2] != yd[1] || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("raydeploy small_matmul: expected x [M, K], w [L, K, N], y [M, N]");
  const int64_t L = wd[0], K = wd[1], N = wd[2];
  if (N % 8 != 0) return ffi::Error::InvalidArgument("raydeploy small_matmul: N must be a multiple of 8");
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("raydeploy small_matmul: layer index out of range");
  Matmul(pool, x.typed_data(), w.typed_data() + static_cast<int64_t>(l) * K * N, y->typed_data(), xd[0], K, N);
  return ffi::Error::Success();
}

// Several weights by the same rows (a layer's q, k, v or gate, up projections) in one call: y_i = x @ w_i[layer],
// each thread taking the same block of rows of every weight. A decode pass is a chain of such calls, each
// waiting for the last; fewer, larger calls pay the split and the start of a weight stream fewer times
// (211 chained 8-row matmuls of the demo's shapes: 32.0 ms; as 121 calls with q/k/v and gate/up joined: 27.8).
constexpr size_t kMaxWeights = 8;

template <ffi::DataType WT>
ffi::Error MultiImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                     ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  using W = ffi::NativeType<WT>;
  const size_t n = ws.size();
  if (n == 0 || n > kMaxWeights || ys.size() != n)
    return ffi::Error::InvalidArgument("raydeploy small_matmul_multi: expected 1 to 8 weights and one result each");
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("raydeploy small_matmul_multi: expected x [M, K]");
  const int64_t M = xd[0], K = xd[1];
  const int32_t l = *layer.typed_data();
  const W* wp[kMaxWeights];
  float* yp[kMaxWeights];
  int64_t cols[kMaxWeights + 1] = {0};  // cols[i]: the first unit of 8 columns of weight i
  for (size_t i = 0; i < n; ++i) {
    auto w = ws.get<ffi::Buffer<WT>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("raydeploy small_matmul_multi: a weight or result of the wrong type");
    const auto wd = w->dimensions();
    const auto yd = (*y)->dimensions();
    if (wd.size() != 3 || yd.size() != 2 || wd[1] != K || yd[0] != M || yd[1] != wd[2])
      return ffi::Error::InvalidArgument("raydeploy small_matmul_multi: expected w_i [L, K, N_i], y_i [M, N_i]");
    if (wd[2] % 8 != 0) return ffi::Error::InvalidArgument("raydeploy small_matmul: N must be a multiple of 8");
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("raydeploy small_matmul: layer index out of range");
    wp[i] = w->typed_data() + static_cast<int64_t>(l) * K * wd[2];
    yp[i] = (*y)->typed_data();
    cols[i + 1] = cols[i] + wd[2] / 8;
  }
  const float* xp = x.typed_data();
  SplitRows(
      pool, K, 8 * M * cols[n],
      [&](int64_t k0, int64_t k1, float* scratch) {
        for (size_t i = 0; i < n; ++i) {
          const int64_t N = 8 * (cols[i + 1] - cols[i]);
          Columns(xp + k0, wp[i] + k0 * N, scratch ? scratch + 8 * M * cols[i] : yp[i], M, K, k1 - k0, N, 0, N);
        }
      },
      [&](const float* scratch) {
        for (size_t i = 0; i < n; ++i) AddInto(yp[i], scratch + 8 * M * cols[i], 8 * M * (cols[i + 1] - cols[i]));
      });
  return ffi::Error::Success();
}

// Packed weights (`raydeploy.model.native.packing`), both stored as tiles of 32 weight rows x 32 columns, one after
// another in row-block-major order ([K/32, N/32] tiles), a tile the 32 columns' scales then their values:
// - 4-bit layer kernels (`pack_q4`; a GGUF Q4_1 checkpoint dequantized to float32): every block of 32 weights
//   down a column is d * q + m, q in 0..15. A tile is 768 bytes: the columns' d (float32), their m (float32), then
//   32 rows of 16 bytes, byte j of a row holding column j in its low nibble and column 16 + j in its high one.
// - 8-bit tables (`pack_q8`; a GGUF Q8_0 table, the tied embedding read as the LM head, transposed to [K, N]):
//   every block of 32 weights down a column is d * q, q in -127..127. A tile is 1152 bytes: the columns' d
//   (float32), then 16 row pairs of 64 bytes, pair p holding rows 2p and 2p + 1 of column j at bytes 2j and
//   2j + 1.
// Per block the sum x . w = d * (x . q) (+ m * sum(x)): the kernel sums x . q over the block and applies d (and m)
// once per block, 0.75 or 1.125 bytes a weight instead of 4 and no per-weight rebuild.
constexpr int64_t kPackBlock = 32;
constexpr int64_t kQ4Tile = 2 * kPackBlock * 4 + kPackBlock * 16;
constexpr int64_t kQ8Tile = kPackBlock * 4 + kPackBlock * kPackBlock;
// Every line of the tile this many tiles ahead is prefetched (one thread streams the weight alone: measured on
// the demo's 211 matmuls, one thread, 4 rows: 22.9 ms prefetching one line of a tile, 18.5 all 12; 4 tiles ahead
// and 16 no better than 8).
constexpr int64_t kPackPrefetchTiles = 8;
// At most this many rows pass over a weight row block at once: their outputs [rows, N] stay in L2.
constexpr int64_t kPackRowChunk = 64;

#if defined(__AVX512F__)
// Rows of x a tile's sums are held for at once (2 x 16 columns a row in registers).
constexpr int64_t kPackGroup = kGroup;

// The AVX-512 build multiplies 16-bit integers: each row's block of 32 values of x is rounded to x ~ c * xq, xq
// int16 with the block's largest |x| at 32767 (a step of 1/65534 of it), and x . q is c * (xq . q) summed exactly
// in int32 (`vpdpwssd`, or `vpmaddwd` + `vpaddd` without AVX512-VNNI: the same sums): two products an
// instruction where a float32 multiply-add does one. sum(x) stays float32. A row's result depends on that row
// alone, in any batch, and the integer sums on no order. What it costs in accuracy: see `packing`.
constexpr float kXMax = 32767.0f;

// One block of 32 values of M rows of x, prepared once for all the block's tiles.
struct BlockX {
  const float* x;  // row 0's block
  int64_t K;
  float* sum;      // [M] sum(x)
  float* scale;    // [M] c
  int32_t* pairs;  // [M][16] xq[2p], xq[2p+1] as one int32
};

inline void PrepareBlockX(const BlockX& b, int64_t M) {
  for (int64_t i = 0; i < M; ++i) {
    const __m512 v0 = _mm512_loadu_ps(b.x + i * b.K), v1 = _mm512_loadu_ps(b.x + i * b.K + 16);
    b.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 f = _mm512_set1_ps(top > 0.0f ? kXMax / top : 0.0f);
    b.scale[i] = top / kXMax;
    const __m256i q0 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, f)));
    const __m256i q1 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, f)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.pairs + 16 * i), q0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.pairs + 16 * i + 8), q1);
  }
}

// acc += the pairwise products of w and x (int16) summed into int32.
inline __m512i DotPairs(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// The two kinds of tile: where their values start, whether they have an m, and their row pair p as int16 pairs
// (`w0` columns 0-15, `w1` 16-31, column j's rows 2p and 2p + 1 in int32 j).
struct Q4Tiles {
  static constexpr int64_t kBytes = kQ4Tile, kValues = 256;
  static constexpr bool kMin = true;
  static void Pair(const uint8_t* q, int64_t p, __m512i& w0, __m512i& w1) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i v = _mm512_permutexvar_epi16(
        order, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p))));
    w0 = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
    w1 = _mm512_srli_epi16(v, 4);
  }
};

struct Q8Tiles {
  static constexpr int64_t kBytes = kQ8Tile, kValues = 128;
  static constexpr bool kMin = false;
  static void Pair(const uint8_t* q, int64_t p, __m512i& w0, __m512i& w1) {
    w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * p)));
    w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * p + 32)));
  }
};

// Above this many rows a tile's values are converted once (`Unpack`) for all the row groups.
template <typename T>
constexpr int64_t kUnpackFromRows = kGroup;

// y[i, 0:32] (+)= d * c[i] * a[i] (+ m * sum[i]) for a tile's MR rows: the block's integer sums xq . q in `a`.
template <typename T, int MR>
inline void AddBlockSums(const __m512i (&a)[MR][2], const float* s, const BlockX& b, int64_t m, float* y, int64_t N,
                         bool first) {
  const __m512 d0 = _mm512_loadu_ps(s), d1 = _mm512_loadu_ps(s + 16);
  for (int i = 0; i < MR; ++i) {
    const __m512 c = _mm512_set1_ps(b.scale[m + i]);
    __m512 y0 = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * N);
    __m512 y1 = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * N + 16);
    if constexpr (T::kMin) {
      const __m512 t = _mm512_set1_ps(b.sum[m + i]);
      y0 = _mm512_fmadd_ps(t, _mm512_loadu_ps(s + 32), y0);
      y1 = _mm512_fmadd_ps(t, _mm512_loadu_ps(s + 48), y1);
    }
    _mm512_storeu_ps(y + i * N, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][0]), _mm512_mul_ps(d0, c), y0));
    _mm512_storeu_ps(y + i * N + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][1]), _mm512_mul_ps(d1, c), y1));
  }
}

// One tile into rows m .. m + MR of y (32 columns), converting its values as it goes.
template <typename T, int MR>
inline void Tile(const BlockX& b, int64_t m, const uint8_t* tile, float* y, int64_t N, bool first) {
  const int32_t* x = b.pairs + 16 * m;
  __m512i a[MR][2];
  for (int i = 0; i < MR; ++i) a[i][0] = a[i][1] = _mm512_setzero_si512();
  for (int64_t p = 0; p < kPackBlock / 2; ++p) {
    __m512i w0, w1;
    T::Pair(tile + T::kValues, p, w0, w1);
    for (int i = 0; i < MR; ++i) {
      const __m512i v = _mm512_set1_epi32(x[16 * i + p]);
      a[i][0] = DotPairs(a[i][0], w0, v);
      a[i][1] = DotPairs(a[i][1], w1, v);
    }
  }
  AddBlockSums<T, MR>(a, reinterpret_cast<const float*>(tile), b, m, y, N, first);
}

// The same sums from a tile converted once (`Unpack`: `qw` [16 pairs][2][32] int16).
template <typename T, int MR>
inline void TileUnpacked(const BlockX& b, int64_t m, const uint8_t* tile, const int16_t* qw, float* y, int64_t N,
                         bool first) {
  const int32_t* x = b.pairs + 16 * m;
  __m512i a[MR][2];
  for (int i = 0; i < MR; ++i) a[i][0] = a[i][1] = _mm512_setzero_si512();
  for (int64_t p = 0; p < kPackBlock / 2; ++p) {
    const __m512i w0 = _mm512_load_si512(qw + 64 * p), w1 = _mm512_load_si512(qw + 64 * p + 32);
    for (int i = 0; i < MR; ++i) {
      const __m512i v = _mm512_set1_epi32(x[16 * i + p]);
      a[i][0] = DotPairs(a[i][0], w0, v);
      a[i][1] = DotPairs(a[i][1], w1, v);
    }
  }
  AddBlockSums<T, MR>(a, reinterpret_cast<const float*>(tile), b, m, y, N, first);
}

// A tile's 32 x 32 values as int16 pairs into `qw` (64-byte aligned).
template <typename T>
inline void Unpack(const uint8_t* tile, int16_t* qw) {
  for (int64_t p = 0; p < kPackBlock / 2; ++p) {
    __m512i w0, w1;
    T::Pair(tile + T::kValues, p, w0, w1);
    _mm512_store_si512(qw + 64 * p, w0);
    _mm512_store_si512(qw + 64 * p + 32, w1);
  }
}
using Unpacked = int16_t;

#else
// AVX2: sixteen 256-bit registers hold the sums of a tile's 32 columns (four vectors of 8) for at most three rows,
// so a tile's values are converted to float32 once (`Unpack`) whenever more than one row passes over it, and the
// rows pass in groups of three reading the converted tile from L1. The products are float32 (x as it is, the
// values converted exactly).
constexpr int64_t kPackGroup = 3;

// One block of 32 values of M rows of x: the rows themselves, and each one's sum.
struct BlockX {
  const float* x;  // row 0's block
  int64_t K;
  float* sum;  // [M]
};

inline void PrepareBlockX(const BlockX& b, int64_t M) {
  for (int64_t i = 0; i < M; ++i) {
    const float* x = b.x + i * b.K;
    const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    b.sum[i] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
}

// The two kinds of tile (as in the AVX-512 build) and their weight row k as float32, columns 0-7, 8-15, 16-23,
// 24-31 (`Row`; 4-bit: the low nibbles of bytes 0-7, 8-15, then their high nibbles).
struct Q4Tiles {
  static constexpr int64_t kBytes = kQ4Tile, kValues = 256;
  static constexpr bool kMin = true;
  static void Row(const uint8_t* q, int64_t k, __m256 (&v)[4]) {
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * k)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16 * k + 8)));
    const __m256i low = _mm256_set1_epi32(0xF);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, low));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, low));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
  }
};

struct Q8Tiles {
  static constexpr int64_t kBytes = kQ8Tile, kValues = 128;
  static constexpr bool kMin = false;
  // Rows 2p and 2p + 1 at once: each 16 bytes of a pair (8 columns, both rows) split into the two rows' bytes.
  static void Pair(const uint8_t* q, int64_t p, __m256 (&even)[4], __m256 (&odd)[4]) {
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int c = 0; c < 4; ++c) {
      const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 64 * p + 16 * c)), split);
      even[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
      odd[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
    }
  }
};

// Above this many rows a tile's values are converted once (`Unpack`): 4-bit from two rows, 8-bit always.
template <typename T>
constexpr int64_t kUnpackFromRows = T::kMin ? 1 : 0;

// y[i, 0:32] (+)= d * a[i] (+ m * sum[i]) for a tile's MR rows: the block's sums x . q in `a`.
template <typename T, int MR>
inline void AddBlockSums(const __m256 (&a)[MR][4], const float* s, const BlockX& b, int64_t m0, float* y, int64_t N,
                         bool first) {
  for (int c = 0; c < 4; ++c) {
    const __m256 d = _mm256_loadu_ps(s + 8 * c);
    for (int i = 0; i < MR; ++i) {
      __m256 y0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + i * N + 8 * c);
      if constexpr (T::kMin) y0 = _mm256_fmadd_ps(_mm256_set1_ps(b.sum[m0 + i]), _mm256_loadu_ps(s + 32 + 8 * c), y0);
      _mm256_storeu_ps(y + i * N + 8 * c, _mm256_fmadd_ps(a[i][c], d, y0));
    }
  }
}

// One tile into MR rows of y (32 columns), converting each weight row as it goes (4-bit, one row of x).
template <typename T, int MR>
inline void Tile(const BlockX& b, int64_t m0, const uint8_t* tile, float* y, int64_t N, bool first) {
  if constexpr (T::kMin) {
    const float* x = b.x + m0 * b.K;
    __m256 a[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 4; ++c) a[i][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kPackBlock; ++k) {
      __m256 v[4];
      T::Row(tile + T::kValues, k, v);
      for (int i = 0; i < MR; ++i) {
        const __m256 xk = _mm256_set1_ps(x[i * b.K + k]);
        for (int c = 0; c < 4; ++c) a[i][c] = _mm256_fmadd_ps(xk, v[c], a[i][c]);
      }
    }
    AddBlockSums<T, MR>(a, reinterpret_cast<const float*>(tile), b, m0, y, N, first);
  }
}

// The same sums from a tile converted once (`qf` [32 rows][32 columns] float32).
template <typename T, int MR>
inline void TileUnpacked(const BlockX& b, int64_t m0, const uint8_t* tile, const float* qf, float* y, int64_t N,
                         bool first) {
  const float* x = b.x + m0 * b.K;
  __m256 a[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < 4; ++c) a[i][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kPackBlock; ++k) {
    for (int i = 0; i < MR; ++i) {
      const __m256 xk = _mm256_set1_ps(x[i * b.K + k]);
      for (int c = 0; c < 4; ++c) a[i][c] = _mm256_fmadd_ps(xk, _mm256_load_ps(qf + 32 * k + 8 * c), a[i][c]);
    }
  }
  AddBlockSums<T, MR>(a, reinterpret_cast<const float*>(tile), b, m0, y, N, first);
}

template <typename T>
inline void Unpack(const uint8_t* tile, float* qf) {
  const uint8_t* q = tile + T::kValues;
  if constexpr (T::kMin) {
    for (int64_t k = 0; k < kPackBlock; ++k) {
      __m256 v[4];
      T::Row(q, k, v);
      for (int c = 0; c < 4; ++c) _mm256_store_ps(qf + 32 * k + 8 * c, v[c]);
    }
  } else {
    for (int64_t p = 0; p < kPackBlock / 2; ++p) {
      __m256 even[4], odd[4];
      T::Pair(q, p, even, odd);
      for (int c = 0; c < 4; ++c) {
        _mm256_store_ps(qf + 64 * p + 8 * c, even[c]);
        _mm256_store_ps(qf + 64 * p + 32 + 8 * c, odd[c]);
      }
    }
  }
}
using Unpacked = float;
#endif

// Weight rows [k0, k1) (multiples of 32) and tile columns [g0, g1) of a packed weight with N columns (`T` its
// tiles) into y [M, N] (written, not added to): the tiles of each row block are one contiguous run, read once, in
// order; every group of `kPackGroup` rows of x passes over each tile while it is in L1. Each row's block of x is
// prepared once for all the block's tiles (`BlockX`).
template <typename T>
void RowsOf(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1,
            int64_t g0, int64_t g1) {
  if (M > kPackRowChunk) {  // row chunks, each a pass over the weight rows
    for (int64_t m = 0; m < M; m += kPackRowChunk)
      RowsOf<T>(x + m * K, w, y + m * N, M - m < kPackRowChunk ? M - m : kPackRowChunk, K, N, k0, k1, g0, g1);
    return;
  }
  const int64_t groups = N / kPackBlock;
  thread_local std::vector<float> sums(2 * kPackRowChunk);
#if defined(__AVX512F__)
  alignas(64) int32_t pairs[kPackRowChunk * kPackBlock / 2];
  const BlockX base{x, K, sums.data(), sums.data() + kPackRowChunk, pairs};
#else
  const BlockX base{x, K, sums.data()};
#endif
  alignas(64) Unpacked qu[kPackBlock * kPackBlock];
  for (int64_t kb = k0 / kPackBlock; kb < k1 / kPackBlock; ++kb) {
    BlockX b = base;
    b.x = x + kb * kPackBlock;
    PrepareBlockX(b, M);
    const uint8_t* row = w + kb * groups * T::kBytes;
    const bool first = kb * kPackBlock == k0;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* tile = row + g * T::kBytes;
      const char* ahead = reinterpret_cast<const char*>(tile + kPackPrefetchTiles * T::kBytes);
      for (int64_t line = 0; line < T::kBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      if (M > kUnpackFromRows<T>) {
        Unpack<T>(tile, qu);
        for (int64_t m = 0; m < M; m += kPackGroup) {
          const int64_t mr = M - m < kPackGroup ? M - m : kPackGroup;
          UpTo8(mr, [&](auto r) {
            TileUnpacked<T, decltype(r)::value>(b, m, tile, qu, y + m * N + g * kPackBlock, N, first);
          });
        }
        continue;
      }
      for (int64_t m = 0; m < M; m += kPackGroup) {
        const int64_t mr = M - m < kPackGroup ? M - m : kPackGroup;
        UpTo8(mr, [&](auto r) { Tile<T, decltype(r)::value>(b, m, tile, y + m * N + g * kPackBlock, N, first); });
      }
    }
  }
}

// y_i = x @ w_i[layer] for packed weights w_i [L, K/32, N_i/32, 768] (uint8), in one call, the weights' rows split
// over the threads as in `MultiImpl`.
ffi::Error MultiQ4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  const size_t n = ws.size();
  if (n == 0 || n > kMaxWeights || ys.size() != n)
    return ffi::Error::InvalidArgument("raydeploy small_matmul_q4: expected 1 to 8 weights and one result each");
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] % kPackBlock != 0)
    return ffi::Error::InvalidArgument("raydeploy small_matmul_q4: expected x [M, K], K a multiple of 32");
  const int64_t M = xd[0], K = xd[1];
  const int32_t l = *layer.typed_data();
  const uint8_t* wp[kMaxWeights];
  float* yp[kMaxWeights];
  int64_t cols[kMaxWeights + 1] = {0};
  for (size_t i = 0; i < n; ++i) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("raydeploy small_matmul_q4: a weight or result of the wrong type");
    const auto wd = w->dimensions();
    const auto yd = (*y)->dimensions();
    if (wd.size() != 4 || yd.size() != 2 || wd[1] * kPackBlock != K || wd[3] != kQ4Tile || yd[0] != M ||
        yd[1] != wd[2] * kPackBlock)
      return ffi::Error::InvalidArgument(
          "raydeploy small_matmul_q4: expected w_i [L, K/32, N_i/32, 768], y_i [M, N_i]");
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("raydeploy small_matmul: layer index out of range");
    wp[i] = w->typed_data() + static_cast<int64_t>(l) * wd[1] * wd[2] * kQ4Tile;
    yp[i] = (*y)->typed_data();
    cols[i + 1] = cols[i] + yd[1];
  }
  const float* xp = x.typed_data();
  const int64_t threads = pool.num_threads();
  if (threads > 1 && M >= threads * kPackRowChunk) {
    // Many rows (a prompt chunk): each thread its own rows over the whole weight, written straight into y. Split
    // over the weight's rows instead, every thread sums into [M, N] partials that one thread adds at the end.
    auto first = [&](int64_t p) { return p == threads ? M : M * p / threads / kPackGroup * kPackGroup; };
    Split(pool, threads, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t m0 = first(p), m1 = first(p + 1);
        for (size_t i = 0; i < n; ++i) {
          const int64_t N = cols[i + 1] - cols[i];
          RowsOf<Q4Tiles>(xp + m0 * K, wp[i], yp[i] + m0 * N, m1 - m0, K, N, 0, K, 0, N / kPackBlock);
        }
      }
    });
    return ffi::Error::Success();
  }
  SplitRows<kPackBlock>(
      pool, K, M * cols[n],
      [&](int64_t k0, int64_t k1, float* scratch) {
        for (size_t i = 0; i < n; ++i) {
          const int64_t N = cols[i + 1] - cols[i];
          RowsOf<Q4Tiles>(xp, wp[i], scratch ? scratch + M * cols[i] : yp[i], M, K, N, k0, k1, 0, N / kPackBlock);
        }
      },
      [&](const float* scratch) {
        for (size_t i = 0; i < n; ++i) AddInto(yp[i], scratch + M * cols[i], M * (cols[i + 1] - cols[i]));
      });
  return ffi::Error::Success();
}

// Tile columns a thread's share of an 8-bit table is cut into: each chunk's outputs [M, 32 * chunk] stay in L2
// while every row block of the table passes over them.
constexpr int64_t kQ8ChunkTiles = 64;

// y = x @ w[layer] for a packed 8-bit table w [L, K/32, N/32, 1152] (uint8; the tied embedding table, transposed,
// as the LM head): the columns split over the threads, each thread's in chunks (`kQ8ChunkTiles`).
ffi::Error Q8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> layer,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || xd[1] % kPackBlock != 0 || wd[1] * kPackBlock != xd[1] ||
      wd[3] != kQ8Tile || yd[0] != xd[0] || yd[1] != wd[2] * kPackBlock)
    return ffi::Error::InvalidArgument(
        "raydeploy small_matmul_q8: expected x [M, K] (K a multiple of 32), w [L, K/32, N/32, 1152], y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("raydeploy small_matmul: layer index out of range");
  const uint8_t* wp = w.typed_data() + static_cast<int64_t>(l) * wd[1] * wd[2] * kQ8Tile;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t groups = N / kPackBlock, chunks = (groups + kQ8ChunkTiles - 1) / kQ8ChunkTiles;
  Split(pool, chunks, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g0 = c * kQ8ChunkTiles, g1 = g0 + kQ8ChunkTiles < groups ? g0 + kQ8ChunkTiles : groups;
      RowsOf<Q8Tiles>(xp, wp, yp, M, K, N, 0, K, g0, g1);
    }
  });
  return ffi::Error::Success();
}

template <ffi::DataType WT>
auto MultiBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .RemainingArgs()
      .RemainingRets();
}

// Every other handler: the CPU client's thread pool, x, the stacked weight, the layer index; y.
template <ffi::DataType WT>
auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<WT>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmul, SmallMatmulImpl<ffi::F32>, Binding<ffi::F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmulOutFirst, OutFirstImpl<ffi::F32>, Binding<ffi::F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmulMulti, MultiImpl<ffi::F32>, MultiBinding<ffi::F32>());

// packed 4-bit layer weights and 8-bit tables (float32 rows of x and y): both builds.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmulQ4, MultiQ4Impl, MultiBinding<ffi::U8>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmulQ8, Q8Impl, Binding<ffi::U8>());

#if defined(__AVX512F__)
// bfloat16 weights (float32 rows of x and y): the AVX-512 build only.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmulBf16, SmallMatmulImpl<ffi::BF16>, Binding<ffi::BF16>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmulOutFirstBf16, OutFirstImpl<ffi::BF16>, Binding<ffi::BF16>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaydeploySmallMatmulMultiBf16, MultiImpl<ffi::BF16>, MultiBinding<ffi::BF16>());
#endif
