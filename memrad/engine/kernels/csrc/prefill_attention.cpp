// A prefill chunk's attention over the whole KV cache on the CPU: on AMX tiles, or on the vector
// units (AVX512-BF16's pair dots, or float32 FMAs on AVX512 or AVX2).
//
//   memra::prefill_attention(q [1, H_q, T, D], keys [1, H_kv, L, D], values [1, H_kv, L, D],
//                            scale) -> out [1, T, H_q, D]          (all bfloat16, or all float32)
//
// Query t sits at position L - T + t and attends keys 0 .. L - T + t: the cache before the chunk,
// then the chunk's own rows causally (the slab holds the chunk's rows at the end). No mask is read.
// q, keys and values may be strided views (the in-place slabs, transformers' transposed q); only
// their rows must be contiguous. Nothing of the cache is copied whole: each block of KB key rows is
// repacked once per call into the layout the products read, then shared by the G query heads of
// its KV head:
//
//   keys   | block 0 (KB rows) | block 1 | ... | block B-1 (tail, zero-padded) |
//   task (h, query block of QB rows): for each block b up to the causal end, for each of the G
//          heads: S = q k_b^T (fp32), online softmax in fp32 (running max m, sum l,
//          rescale of the partial output), acc += P v_b
//   out    acc / l, per query row
//
// Three paths, by dtype and CPU (`prefill_attention_path` names the one that runs):
//   amx          bf16 where oneDNN drives AMX: both products through brgemm (VNNI-packed blocks)
//   avx512-bf16  bf16 on AVX512-BF16 without AMX: the same VNNI blocks, vdpbf16ps register tiles
//   <isa> fp32   float32 (and bf16 elsewhere, widened): keys packed transposed in fp32, FMA tiles
//
// The partition depends only on (T, L), never on the thread count, and every task's reductions
// run in one order: the bits are the same with any number of threads, and a chunk computes the
// same bits whether its cache came from a cold prefill or a resumed one (memrad.grid). On the
// vector paths a row's bits depend on its position and the rows it attends only, not on the
// chunk around it: key blocks sit at fixed positions, each score and output sums in one order,
// and a row's tile neighbours only add exact zeros (P = 0 past the row's causal end).
//
// Built at run time like decode_attention.cpp (memrad.engine.kernels.build), with the vector
// width of the kernels' ISA (MEMRA_KERNEL_ISA=avx2 builds the AVX2 fp32 path alone).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using VF = at::vec::Vectorized<float>;
using VB = at::vec::Vectorized<c10::BFloat16>;
using bf16 = c10::BFloat16;
constexpr int64_t QB = 64;     // query rows per task and head
constexpr int64_t KB = 512;    // key rows per block
constexpr int64_t SUB = 16;    // query rows per product (one AMX tile of rows)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Key rows [n, D] (row stride ld) -> the B operand of q k^T ([D, np]) in VNNI layout [D/2][np][2];
// columns n .. np are zero. As 32-bit words (a pair of bf16 along D) it is the transpose of the
// rows' words.
void pack_keys(const bf16* k, int64_t ld, int64_t n, int64_t np, int64_t D, bf16* out) {
  const float* src = reinterpret_cast<const float*>(k);  // bit moves only: words, never arithmetic
  float* dst = reinterpret_cast<float*>(out);
  const int64_t W = D / 2, lds = ld / 2;
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const int64_t rows = std::clamp<int64_t>(n - j0, 0, 16);
    for (int64_t w0 = 0; w0 < W; w0 += 16) {
      const int cols = static_cast<int>(std::min<int64_t>(16, W - w0));
      float* to = dst + w0 * np + j0;
      if (rows == 16 && cols == 16) {
        at::vec::transpose_mxn<float, 16, 16>(src + j0 * lds + w0, lds, to, np);
      } else if (rows > 0) {
        at::vec::transpose_mxn<float>(src + j0 * lds + w0, lds, to, np, static_cast<int>(rows), cols);
      }
      for (int c = 0; c < cols; ++c) std::fill(to + c * np + rows, to + c * np + 16, 0.f);
    }
  }
}

// Value rows [n, D] -> the B operand of P v ([np, D]) in VNNI layout [np/2][D][2] (rows j and j + 1
// interleaved); rows n .. np are zero.
void pack_values(const bf16* v, int64_t ld, int64_t n, int64_t np, int64_t D, bf16* out) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(v);
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t j = 0; j < np; j += 2) {
    uint32_t* o = dst + (j / 2) * D;
    const uint16_t* a = src + j * ld;
    if (j + 1 < n) {
      const uint16_t* b = a + ld;
      for (int64_t d = 0; d < D; ++d) o[d] = a[d] | (static_cast<uint32_t>(b[d]) << 16);
    } else if (j < n) {
      for (int64_t d = 0; d < D; ++d) o[d] = a[d];
    } else {
      std::fill(o, o + D, 0u);
    }
  }
}

inline void store_pair(VF e0, VF e1, bf16* p) { at::vec::convert_from_float<bf16>(e0, e1).store(p); }
inline void store_pair(VF e0, VF e1, float* p) {
  e0.store(p);
  e1.store(p + VF::size());
}

// One row of scores s[0, valid) (raw q.k) into the running softmax: p = e^(scale s - m') in P
// (bf16 for the bf16 products, fp32 for the fp32 ones), zero from `valid` to `np`; returns the
// factor the row's earlier sum and output scale by.
template <typename P>
float softmax_row(const float* s, int64_t valid, int64_t np, float scale, float& m, float& l, P* p) {
  const int64_t W = VF::size(), full = valid - valid % W;
  VF mv(NEG_INF);
  for (int64_t j = 0; j < full; j += W) mv = at::vec::maximum(mv, VF::loadu(s + j));
  float raw = at::vec::vec_reduce_all<float>([](VF& a, VF& b) { return at::vec::maximum(a, b); }, mv);
  for (int64_t j = full; j < valid; ++j) raw = std::max(raw, s[j]);
  const float m_new = std::max(m, raw * scale);
  const float alpha = std::exp(m - m_new);  // m = -inf on the first block: 0
  const VF vs(scale), vm(-m_new);
  VF total(0.f);
  int64_t j = 0;
  for (; j + 2 * W <= full; j += 2 * W) {
    const VF e0 = at::vec::fmadd(VF::loadu(s + j), vs, vm).exp_u20();
    const VF e1 = at::vec::fmadd(VF::loadu(s + j + W), vs, vm).exp_u20();
    total = total + e0 + e1;
    store_pair(e0, e1, p + j);
  }
  float sum = at::vec::vec_reduce_all<float>([](VF& a, VF& b) { return a + b; }, total);
  for (; j < valid; ++j) {
    const float e = std::exp(s[j] * scale - m_new);
    sum += e;
    p[j] = static_cast<P>(e);
  }
  std::fill(p + valid, p + np, static_cast<P>(0.f));
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__) && defined(__GNUC__)
// The same row on AVX512 with native bf16 conversion: the softmax is most of the kernel's time
// (the products run on AMX), and every CPU with AMX has these instructions. exp as 2^x: x split
// at the nearest integer n, 2^(x - n) by its degree-5 series on [-1/2, 1/2] (relative error
// 2e-6, far below the bf16 that P is rounded to), scaled by 2^n (scalef: underflows to 0).
#define MEMRA_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

MEMRA_AVX512_BF16 inline __m512 exp2_avx512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.3333558e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

MEMRA_AVX512_BF16 inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

MEMRA_AVX512_BF16 float softmax_row_avx512(const float* s, int64_t valid, int64_t np, float scale, float& m, float& l,
                                           bf16* p) {
  const __m512 lowest = _mm512_set1_ps(NEG_INF);
  __m512 m0 = lowest, m1 = lowest;
  int64_t j = 0;
  for (; j + 32 <= valid; j += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
  }
  for (; j < valid; j += 16) {
    const __mmask16 k = first_lanes(valid - j);
    m0 = _mm512_mask_max_ps(m0, k, m0, _mm512_maskz_loadu_ps(k, s + j));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(m0, m1)) * scale);
  const float alpha = std::exp(m - m_new);  // m = -inf on the first block: 0
  const float log2e = 1.4426950408889634f;
  const __m512 a = _mm512_set1_ps(scale * log2e), b = _mm512_set1_ps(-m_new * log2e);
  __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
  for (j = 0; j < valid; j += 32) {  // a tail's lanes past `valid` are zeroed; np >= j + 32
    const __mmask16 k0 = first_lanes(valid - j), k1 = first_lanes(valid - j - 16);
    const __m512 e0 = _mm512_maskz_mov_ps(k0, exp2_avx512(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k0, s + j), a, b)));
    const __m512 e1 = _mm512_maskz_mov_ps(k1, exp2_avx512(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k1, s + j + 16), a, b)));
    t0 = _mm512_add_ps(t0, e0);
    t1 = _mm512_add_ps(t1, e1);
    _mm512_storeu_si512(reinterpret_cast<void*>(p + j), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
  }
  std::fill(p + j, p + np, static_cast<bf16>(0.f));
  l = l * alpha + _mm512_reduce_add_ps(_mm512_add_ps(t0, t1));
  m = m_new;
  return alpha;
}

bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return yes;
}

// c [R, C x 16] (+)= a [R, 2K] b [2K, C x 16] on pair dots (vdpbf16ps): a's rows as 32-bit words
// (a bf16 pair along the sum), b as K rows of C x 16 pairs ([K][16 C][2], row stride ldb pairs),
// k in order, so each output sums its K pairs in one order whatever the tile. `add` false starts
// from zero. q k^T (pairs along D, keys as pack_keys lays them out) and P v (pairs of keys, values
// as pack_values lays them out) are both this product.
template <int R, int C>
MEMRA_AVX512_BF16 void tile_bf16(const bf16* a, int64_t lda, const bf16* b, int64_t ldb, int64_t K, float* c,
                                 int64_t ldc, bool add) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) acc[r][v] = add ? _mm512_loadu_ps(c + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512bh x[C];
    for (int v = 0; v < C; ++v)
      x[v] = reinterpret_cast<__m512bh>(
          _mm512_loadu_si512(reinterpret_cast<const void*>(b + (k * ldb + 16 * v) * 2)));
    for (int r = 0; r < R; ++r) {
      const int32_t word = reinterpret_cast<const int32_t*>(a + r * lda)[k];
      const __m512bh y = reinterpret_cast<__m512bh>(_mm512_set1_epi32(word));
      for (int v = 0; v < C; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], y, x[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
}
#define MEMRA_DOT_BF16 1
#else
bool has_avx512_bf16() { return false; }
float softmax_row_avx512(const float*, int64_t, int64_t, float, float&, float&, bf16*) { return 0.f; }
#endif

// Runs tile(first row, rows per tile) over `rows` rows: tiles of 6 rows, then one of those left.
// Six rows hold 6 x 4 accumulators of AVX512's 32 registers, 6 x 2 of AVX2's 16 (fp32 and the
// pair dots ran 1.1-1.25x faster than with tiles of 4 on Zen 5, either ISA).
template <typename Tile>
inline void by_row_tiles(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) tile(r, std::integral_constant<int, 6>{});
  switch (rows - r) {
    case 5: tile(r, std::integral_constant<int, 5>{}); break;
    case 4: tile(r, std::integral_constant<int, 4>{}); break;
    case 3: tile(r, std::integral_constant<int, 3>{}); break;
    case 2: tile(r, std::integral_constant<int, 2>{}); break;
    case 1: tile(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

#if defined(MEMRA_DOT_BF16)
// The bf16 path on AVX512-BF16: blocks in pack_keys / pack_values' VNNI layout, P in bf16.
struct DotBf16 {
  using In = bf16;
  using Q = bf16;
  using K = bf16;
  using P = bf16;
  static constexpr int64_t COLS = 64;  // score columns per tile; blocks are padded to it
  static void pack_k(const bf16* k, int64_t ld, int64_t n, int64_t np, int64_t D, bf16* out) {
    pack_keys(k, ld, n, np, D, out);
  }
  static void pack_v(const bf16* v, int64_t ld, int64_t n, int64_t np, int64_t D, bf16* out) {
    pack_values(v, ld, n, np, D, out);
  }
  static void scores(const bf16* q, int64_t rows, int64_t D, const bf16* kb, int64_t np, int64_t cols, float* s,
                     int64_t lds) {
    by_row_tiles(rows, [&](int64_t r, auto R) {
      for (int64_t j = 0; j < cols; j += COLS)  // kb: [D/2][np][2]
        tile_bf16<decltype(R)::value, 4>(q + r * D, D, kb + 2 * j, np, D / 2, s + r * lds + j, lds, false);
    });
  }
  static float softmax(const float* s, int64_t valid, int64_t np, float scale, float& m, float& l, bf16* p) {
    return softmax_row_avx512(s, valid, np, scale, m, l, p);
  }
  // acc [rows, D] += p [rows, used) v [used, D]
  static void accumulate(const bf16* p, int64_t ldp, int64_t rows, int64_t D, const bf16* vb, int64_t used,
                         float* acc) {
    const int64_t pairs = (used + 1) / 2;  // p is zero past each row's end, the block past its rows
    by_row_tiles(rows, [&](int64_t r, auto R) {
      constexpr int Rt = decltype(R)::value;
      for (int64_t d0 = 0; d0 < D;) {  // vb: [np/2][D][2]
        if (D - d0 >= 64) {
          tile_bf16<Rt, 4>(p + r * ldp, ldp, vb + 2 * d0, D, pairs, acc + r * D + d0, D, true);
          d0 += 64;
        } else {
          tile_bf16<Rt, 2>(p + r * ldp, ldp, vb + 2 * d0, D, pairs, acc + r * D + d0, D, true);
          d0 += 32;
        }
      }
    });
  }
};
#endif

// The fp32 path: keys transposed and values in fp32 (bf16 widened), FMA register tiles of the
// kernels' vector width (8 lanes on AVX2, 16 on AVX512), P in fp32.
constexpr int VECTORS = VF::size() >= 16 ? 4 : 2;  // vectors of columns (outputs) a tile holds per row

template <typename T>
void pack_keys_f32(const T* k, int64_t ld, int64_t n, int64_t np, int64_t D, float* out) {
  for (int64_t j0 = 0; j0 < np; j0 += 16) {  // [D][np]: column j is key row j
    const int64_t rows = std::clamp<int64_t>(n - j0, 0, 16);
    for (int64_t d = 0; d < D; ++d) {
      float* to = out + d * np + j0;
      for (int64_t j = 0; j < rows; ++j) to[j] = static_cast<float>(k[(j0 + j) * ld + d]);
      std::fill(to + rows, to + 16, 0.f);
    }
  }
}

template <typename T>
void pack_values_f32(const T* v, int64_t ld, int64_t n, int64_t np, int64_t D, float* out) {
  for (int64_t j = 0; j < np; ++j) {  // [np][D], rows n .. np zero
    float* to = out + j * D;
    if (j < n) {
      for (int64_t d = 0; d < D; ++d) to[d] = static_cast<float>(v[j * ld + d]);
    } else {
      std::fill(to, to + D, 0.f);
    }
  }
}

// c [R, C vectors] (+)= a [R, K] b [K, C vectors]: one of a's values broadcast times C vectors of a
// row of b, for k in order, so each output sums its K products in one order whatever the tile.
// Rows stride lda, ldb, ldc; `add` false starts from zero. q k^T (K = D over the transposed keys)
// and P v (K = the block's keys) are both this product.
template <int R, int C>
void tile_f32(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c, int64_t ldc, bool add) {
  constexpr int64_t W = VF::size();
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) acc[r][v] = add ? VF::loadu(c + r * ldc + v * W) : VF(0.f);
  for (int64_t k = 0; k < K; ++k) {
    VF x[C];
    for (int v = 0; v < C; ++v) x[v] = VF::loadu(b + k * ldb + v * W);
    for (int r = 0; r < R; ++r) {
      const VF y(a[r * lda + k]);
      for (int v = 0; v < C; ++v) acc[r][v] = at::vec::fmadd(y, x[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) acc[r][v].store(c + r * ldc + v * W);
}

template <typename T>
struct Float32 {
  using In = T;
  using Q = float;
  using K = float;
  using P = float;
  static constexpr int64_t COLS = VECTORS * VF::size();  // score columns per tile; blocks are padded to it
  static void pack_k(const T* k, int64_t ld, int64_t n, int64_t np, int64_t D, float* out) {
    pack_keys_f32(k, ld, n, np, D, out);
  }
  static void pack_v(const T* v, int64_t ld, int64_t n, int64_t np, int64_t D, float* out) {
    pack_values_f32(v, ld, n, np, D, out);
  }
  static void scores(const float* q, int64_t rows, int64_t D, const float* kb, int64_t np, int64_t cols, float* s,
                     int64_t lds) {
    by_row_tiles(rows, [&](int64_t r, auto R) {
      for (int64_t j = 0; j < cols; j += COLS)  // kb: [D][np]
        tile_f32<decltype(R)::value, VECTORS>(q + r * D, D, kb + j, np, D, s + r * lds + j, lds, false);
    });
  }
  static float softmax(const float* s, int64_t valid, int64_t np, float scale, float& m, float& l, float* p) {
    return softmax_row(s, valid, np, scale, m, l, p);
  }
  static void accumulate(const float* p, int64_t ldp, int64_t rows, int64_t D, const float* vb, int64_t used,
                         float* acc) {
    by_row_tiles(rows, [&](int64_t r, auto R) {
      constexpr int Rt = decltype(R)::value;
      for (int64_t d0 = 0; d0 < D;) {  // vb: [np][D]
        if (D - d0 >= COLS) {
          tile_f32<Rt, VECTORS>(p + r * ldp, ldp, vb + d0, D, used, acc + r * D + d0, D, true);
          d0 += COLS;
        } else {
          tile_f32<Rt, 1>(p + r * ldp, ldp, vb + d0, D, used, acc + r * D + d0, D, true);
          d0 += VF::size();
        }
      }
    });
  }
};

void store_row(const float* a, float inv, int64_t D, bf16* o) {
  for (int64_t d = 0; d < D; d += 2 * VF::size()) {
    at::vec::convert_from_float<bf16>(VF::loadu(a + d) * VF(inv), VF::loadu(a + d + VF::size()) * VF(inv))
        .store(o + d);
  }
}

void store_row(const float* a, float inv, int64_t D, float* o) {
  for (int64_t d = 0; d < D; d += VF::size()) (VF::loadu(a + d) * VF(inv)).store(o + d);
}

constexpr int64_t VKB = 256;  // key rows per block on the vector paths (a block's fp32 keys: 64 KiB at D = 64)

// The vector paths' driver: the tasks and the online softmax of the header, with Ops' layouts
// and products.
template <class Ops>
at::Tensor attend_vec(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale) {
  using In = typename Ops::In;
  using K = typename Ops::K;
  const int64_t Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = keys.size(1), L = keys.size(2);
  const int64_t G = Hq / Hkv, start = L - T;
  const int64_t blocks = (L + VKB - 1) / VKB, qblocks = (T + QB - 1) / QB;
  const float s = static_cast<float>(scale);
  static thread_local std::vector<K> packed;  // [H_kv][block][VKB * D], keys then values
  packed.resize(static_cast<size_t>(2 * Hkv * blocks * VKB * D));
  K* kp = packed.data();
  K* vp = kp + Hkv * blocks * VKB * D;
  const In* kd = keys.const_data_ptr<In>();
  const In* vd = values.const_data_ptr<In>();
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t h = task / blocks, c0 = (task % blocks) * VKB;
      const int64_t n = std::min(VKB, L - c0), np = round_up(n, Ops::COLS);
      Ops::pack_k(kd + h * keys.stride(1) + c0 * keys.stride(2), keys.stride(2), n, np, D, kp + task * VKB * D);
      Ops::pack_v(vd + h * values.stride(1) + c0 * values.stride(2), values.stride(2), n, np, D, vp + task * VKB * D);
    }
  });
  at::Tensor out = at::empty({1, T, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  In* od = out.data_ptr<In>();
  const In* qd = q.const_data_ptr<In>();
  at::parallel_for(0, Hkv * qblocks, 1, [&](int64_t first, int64_t last) {
    // The task's G heads x QB query rows as one M = G * rows matrix: row g * rows + r.
    std::vector<typename Ops::Q> queries(G * QB * D);
    std::vector<typename Ops::P> probs(SUB * VKB);
    std::vector<float> scores(SUB * VKB), acc(G * QB * D), maxes(G * QB), sums(G * QB);
    for (int64_t task = first; task < last; ++task) {
      const int64_t h = task / qblocks, m0 = (task % qblocks) * QB, rows = std::min(QB, T - m0);
      const int64_t M = G * rows, needed = start + m0 + rows;  // keys [0, needed) for these rows
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 0; r < rows; ++r) {
          const In* from = qd + (h * G + g) * q.stride(1) + (m0 + r) * q.stride(2);
          for (int64_t d = 0; d < D; ++d) queries[(g * rows + r) * D + d] = static_cast<typename Ops::Q>(from[d]);
        }
      std::fill(maxes.begin(), maxes.end(), NEG_INF);
      std::fill(sums.begin(), sums.end(), 0.f);
      std::fill(acc.begin(), acc.begin() + M * D, 0.f);
      for (int64_t b = 0; b * VKB < needed; ++b) {
        const int64_t c0 = b * VKB, n = std::min(VKB, L - c0), np = round_up(n, Ops::COLS);
        const K* kb = kp + (h * blocks + b) * VKB * D;
        const K* vb = vp + (h * blocks + b) * VKB * D;
        for (int64_t i0 = 0; i0 < M; i0 += SUB) {
          const int64_t sub = std::min(SUB, M - i0);
          auto valid = [&](int64_t i) { return std::clamp<int64_t>(start + m0 + i % rows - c0 + 1, 0, n); };
          int64_t widest = 0;  // the most keys of this block any of the sub rows attends
          for (int64_t i = i0; i < i0 + sub; ++i) widest = std::max(widest, valid(i));
          if (widest == 0) continue;  // these rows' keys ended in an earlier block (never block 0)
          const int64_t cols = round_up(widest, Ops::COLS);
          Ops::scores(queries.data() + i0 * D, sub, D, kb, np, cols, scores.data(), VKB);
          for (int64_t i = i0; i < i0 + sub; ++i) {
            auto* p = probs.data() + (i - i0) * VKB;
            const int64_t row_valid = valid(i);
            if (row_valid == 0) {
              std::fill(p, p + cols, static_cast<typename Ops::P>(0.f));
              continue;
            }
            const float alpha = Ops::softmax(scores.data() + (i - i0) * VKB, row_valid, cols, s, maxes[i], sums[i], p);
            if (b > 0 && alpha != 1.f) {
              float* a = acc.data() + i * D;
              at::vec::map<float>([alpha](VF x) { return x * VF(alpha); }, a, a, D);
            }
          }
          Ops::accumulate(probs.data(), VKB, sub, D, vb, widest, acc.data() + i0 * D);
        }
      }
      for (int64_t i = 0; i < M; ++i) {
        const int64_t g = i / rows, r = i % rows;
        store_row(acc.data() + i * D, 1.f / sums[i], D, od + ((m0 + r) * Hq + h * G + g) * D);
      }
    }
  });
  return out;
}

void check(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && q.size(0) == 1 && keys.size(0) == 1,
              "prefill_attention takes q [1, H_q, T, D], keys and values [1, H_kv, L, D]");
  TORCH_CHECK(keys.sizes() == values.sizes(), "keys and values differ in shape");
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) &&
              keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "prefill_attention takes bfloat16 or float32 (one dtype)");
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1, "rows must be contiguous");
  TORCH_CHECK(q.size(3) == keys.size(3) && q.size(3) % 32 == 0, "head dim must match and be a multiple of 32");
  TORCH_CHECK(q.size(1) % keys.size(1) == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(q.size(2) >= 1 && keys.size(2) >= q.size(2), "the keys must hold the chunk's own rows");
  TORCH_CHECK(keys.stride(2) % 2 == 0, "key rows must start on 32-bit words");
}

bool amx_runs() {
#if defined(CPU_CAPABILITY_AVX512)
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;  // an AVX2 build stands for an AVX2 machine, which has no AMX
#endif
}

at::Tensor attend_amx(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale) {
  const int64_t Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = keys.size(1), L = keys.size(2);
  const int64_t G = Hq / Hkv, start = L - T;
  const int64_t blocks = (L + KB - 1) / KB, qblocks = (T + QB - 1) / QB;
  const float s = static_cast<float>(scale);
  const bool fast = has_avx512_bf16();
  // Packed keys and values, [H_kv][block][KB * D] each: thread-local, so a long cache's pages
  // are faulted in once per thread, not once per layer.
  static thread_local std::vector<bf16> packed;
  packed.resize(static_cast<size_t>(2 * Hkv * blocks * KB * D));
  bf16* kp = packed.data();
  bf16* vp = kp + Hkv * blocks * KB * D;
  const bf16* kd = keys.const_data_ptr<bf16>();
  const bf16* vd = values.const_data_ptr<bf16>();
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t h = task / blocks, c0 = (task % blocks) * KB;
      const int64_t n = std::min(KB, L - c0), np = round_up(n, 32);
      pack_keys(kd + h * keys.stride(1) + c0 * keys.stride(2), keys.stride(2), n, np, D, kp + task * KB * D);
      pack_values(vd + h * values.stride(1) + c0 * values.stride(2), values.stride(2), n, np, D,
                  vp + task * KB * D);
    }
  });
  at::Tensor out = at::empty({1, T, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  bf16* od = out.data_ptr<bf16>();
  const bf16* qd = q.const_data_ptr<bf16>();
  at::parallel_for(0, Hkv * qblocks, 1, [&](int64_t first, int64_t last) {
    // The task's G heads x QB query rows as one M = G * rows matrix: row g * rows + r.
    std::vector<bf16> queries(G * QB * D), probs(SUB * KB);
    std::vector<float> scores(SUB * KB), acc(G * QB * D), maxes(G * QB), sums(G * QB);
    for (int64_t task = first; task < last; ++task) {
      const int64_t h = task / qblocks, m0 = (task % qblocks) * QB, rows = std::min(QB, T - m0);
      const int64_t M = G * rows, needed = start + m0 + rows;  // keys [0, needed) for these rows
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(&queries[(g * rows + r) * D], qd + (h * G + g) * q.stride(1) + (m0 + r) * q.stride(2),
                      D * sizeof(bf16));
      std::fill(maxes.begin(), maxes.end(), NEG_INF);
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t b = 0; b * KB < needed; ++b) {
        const int64_t c0 = b * KB, n = std::min(KB, L - c0), np = round_up(n, 32);
        const bf16* kb = kp + (h * blocks + b) * KB * D;
        const bf16* vb = vp + (h * blocks + b) * KB * D;
        // SUB rows at a time, so their scores stay in the L1 cache between the two products.
        for (int64_t i0 = 0; i0 < M; i0 += SUB) {
          const int64_t sub = std::min(SUB, M - i0);
          // scores [sub, np] = queries [sub, D] k_b^T [D, np]
          at::native::cpublas::brgemm(sub, np, D, D, np, KB, false, queries.data() + i0 * D, kb, scores.data());
          for (int64_t i = i0; i < i0 + sub; ++i) {
            const int64_t r = i % rows;
            const int64_t valid = std::clamp<int64_t>(start + m0 + r - c0 + 1, 0, n);
            bf16* p = probs.data() + (i - i0) * KB;
            if (valid == 0) {  // the row's keys ended in an earlier block (never block 0)
              std::fill(p, p + np, static_cast<bf16>(0.f));
              continue;
            }
            const float* row = scores.data() + (i - i0) * KB;
            const float alpha = fast ? softmax_row_avx512(row, valid, np, s, maxes[i], sums[i], p)
                                     : softmax_row(row, valid, np, s, maxes[i], sums[i], p);
            if (b > 0 && alpha != 1.f) {
              float* a = acc.data() + i * D;
              at::vec::map<float>([alpha](VF x) { return x * VF(alpha); }, a, a, D);
            }
          }
          // acc [sub, D] (+)= probs [sub, np] v_b [np, D]
          at::native::cpublas::brgemm(sub, D, np, KB, D, D, b > 0, probs.data(), vb, acc.data() + i0 * D);
        }
      }
      for (int64_t i = 0; i < M; ++i) {
        const int64_t g = i / rows, r = i % rows;
        const float inv = 1.f / sums[i];
        const float* a = acc.data() + i * D;
        bf16* o = od + ((m0 + r) * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; d += 2 * VF::size()) {
          at::vec::convert_from_float<bf16>(VF::loadu(a + d) * VF(inv), VF::loadu(a + d + VF::size()) * VF(inv))
              .store(o + d);
        }
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale) {
  check(q, keys, values);
  if (q.scalar_type() == at::kFloat) return attend_vec<Float32<float>>(q, keys, values, scale);
  if (amx_runs()) return attend_amx(q, keys, values, scale);
#if defined(MEMRA_DOT_BF16)
  if (has_avx512_bf16()) return attend_vec<DotBf16>(q, keys, values, scale);
#endif
  return attend_vec<Float32<bf16>>(q, keys, values, scale);
}

// The path prefill_attention takes for bf16 (true) or float32 inputs: "amx", "avx512-bf16",
// "avx512 fp32", "avx2 fp32 (bf16 widened)", ...
std::string prefill_attention_path(bool bf16_inputs) {
#if defined(CPU_CAPABILITY_AVX512)
  const std::string isa = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  const std::string isa = "avx2";
#else
  const std::string isa = "scalar";
#endif
  if (!bf16_inputs) return isa + " fp32";
  if (amx_runs()) return "amx";
#if defined(MEMRA_DOT_BF16)
  if (has_avx512_bf16()) return "avx512-bf16";
#endif
  return isa + " fp32 (bf16 widened)";
}

}  // namespace

// A fragment: decode_attention.cpp's library owns the `memra` namespace.
TORCH_LIBRARY_FRAGMENT(memra, m) {
  m.def("prefill_attention(Tensor q, Tensor keys, Tensor values, float scale) -> Tensor");
  m.def("prefill_attention_path(bool bf16) -> str", &prefill_attention_path);
}

TORCH_LIBRARY_IMPL(memra, CPU, m) { m.impl("prefill_attention", prefill_attention); }
