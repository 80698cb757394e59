// One token's matrix-vector product straight from a GGUF's Q8_0, Q5_0, Q4_1, MXFP4, Q4_K, Q5_K or
// Q6_K blocks, as shipped.
//
//   memra::block_gemv(x [M, K], blocks [N, K/32 * B] uint8, kind) -> out [M, N]   (x's dtype)
//   (the k-quants: blocks [N, K/256 * B], below)
//
//   kind 8, Q8_0 (B = 34):  | d fp16 | q[32] int8 |                        w_j = d * q_j
//   kind 5, Q5_0 (B = 22):  | d fp16 | qh uint32 | qs[16] |                w_j = d * (q_j - 16)
//                           q_j = low nibble of qs[j] (j < 16) or high nibble of qs[j - 16],
//                           plus 16 * bit j of qh
//   kind 4, Q4_1 (B = 20):  | d fp16 | m fp16 | qs[16] |                   w_j = d * q_j + m
//                           q_j = low nibble of qs[j] (j < 16) or high nibble of qs[j - 16]
//   kind 39, MXFP4 (B = 17): | e uint8 | qs[16] |                          w_j = 2^(e - 128) * v(q_j)
//                           q_j as Q4_1's; v = kvalues_mxfp4, the E2M1 values doubled (0, 1, 2, 3,
//                           4, 6, 8, 12 and their negatives): int8 codes, so a block is Q8_0's
//                           arithmetic with the power of two 2^(e - 128) (ggml's
//                           GGML_E8M0_TO_FP32_HALF: E8M0's 2^(e - 127), halved for the doubled
//                           values) in place of d; gpt-oss's experts ship it (ggml type 39)
//
// torch's int4 kernel can run Q8_0 / Q5_0 only as two 4-bit passes (hi|lo: 10 bits a weight with
// its bf16 scales, where the blocks are 8.5 and 5.5), and runs Q4_1 with d and m rounded to bf16.
// This kernel reads the blocks llama.cpp reads and multiplies the shipped weights exactly (fp16
// d, m are exact in float32). Row-major Q4_1 blocks lost to torch's int4 kernel, its codes laid
// out across output rows (docs/BENCHMARKS.md, issue 22 session 10); the interleaved kinds (40, 80,
// below: 16 rows' blocks side by side, laid out once at load) beat it on AVX512 at one row and
// cost a row past the first 0.1-0.15x of one (memrad bench rows, issue 34); AVX2 runs them at 8
// lanes with the AVX512 path's bits (issue 38). With AVX512 the activation is rounded to int16 per block of 32 (2^-16 of the
// block's largest |x|: see `quantize`), so a block is one int16 x int16 multiply-add (exact) and
// one float32 scale; a float32 product per weight needed twice the instructions and ran no
// faster than hi|lo. Q4_1's min term is m * sum_j x_j = m * sx * (sum_j x16_j): the int sum is
// exact, taken once per activation row and block. AVX2 does the same arithmetic at half the
// width (8 lanes; int8 activations, llama.cpp's q8_0, flipped a near-tie greedy answer: below).
//
// A tile of output rows decodes each block's codes once and applies them to every activation
// row (register-blocked: ROWS output rows x up to XROWS activation rows of accumulators), so
// M rows cost less than M times one. Each output (m, n) is still one fixed sequence of
// operations: per block, the products summed lane-wise (16 lanes, 8 for Q4_1's row pairs; 8 on
// AVX2, below; plain C++ in float32 without either), scaled by d * sx into the output's lane accumulator;
// the lanes summed at the end (then, for Q4_1, the min terms: 16 blocks a lane, summed). Rows
// are cut into fixed tiles of TILE spread over torch's threads, so the result has the same bits
// with any thread count, any M and any neighbours (a batched request decodes as it does alone).
//
// Built at run time with the flags of the machine's CPU (memrad.engine.kernels.build).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t ROWS = 4;  // output rows computed together: their activation loads are shared
constexpr int64_t XROWS = 4;  // activation rows computed together: each block's codes decode once for them
constexpr int64_t TILE = 64;  // output rows per task

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

constexpr int MXFP4 = 39;  // ggml's type number

template <int KIND>
constexpr int64_t block_bytes() { return KIND == 8 ? 34 : KIND == 5 ? 22 : KIND == MXFP4 ? 17 : 20; }

inline int64_t bytes_of(int64_t kind) {
  return kind == 8 ? block_bytes<8>() : kind == 5 ? block_bytes<5>() : kind == MXFP4 ? block_bytes<MXFP4>() : block_bytes<4>();
}

// MXFP4's doubled E2M1 values by code (ggml's kvalues_mxfp4), and its E8M0 scale byte as the
// float32 2^(e - 128) (ggml's ggml_e8m0_to_fp32_half: e < 2 are the subnormals 2^-128, 2^-127).
alignas(16) constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// The k-quants, by ggml's type numbers: super-blocks of 256 weights (K a multiple of 256).
//
//   kind 12, Q4_K (144 B):  | d fp16 | dmin fp16 | sc, m: 8 x 6 bits each in 12 B | qs[128] |
//                           w = (d * sc_j) * q - dmin * m_j in 32-weight block j; q = nibble of qs:
//                           block 2i low and 2i + 1 high nibbles of qs[32 i .. 32 i + 31]
//   kind 13, Q5_K (176 B):  | d | dmin | sc, m (12 B) | qh[32] | qs[128] |   as Q4_K, q + 16 * bit j of qh[l]
//   kind 14, Q6_K (210 B):  | ql[128] | qh[64] | sc[16] int8 | d fp16 |
//                           w = (d * sc_i) * (q - 32) in 16-weight sub-block i; 32-weight block
//                           b = 4 h + t: low (t < 2) or high nibbles of ql[64 h + 32 (t % 2) ..],
//                           plus 16 * bits 2t, 2t + 1 of qh[32 h + l]
//
// d * sc and dmin * m are exact in float32 (11 + 6 or 8 significant bits), as gguf-py computes
// them, and each 32-weight block meets the activation's int16 block of 32: per block the codes'
// products are summed exactly in int32 and scaled once by (d * sc) * sx (Q6_K: its two halves
// of 16, each by its own scale; on AVX2 the int8 scales multiply the codes first, then d * sx
// the sums); Q4_K's and Q5_K's min terms are dmin * m * sx * sum_j x16_j, summed as Q4_1's.
constexpr int Q4_K = 12, Q5_K = 13, Q6_K = 14;
constexpr int64_t SUPER = 256;

template <int KIND>
constexpr bool is_k() { return KIND == Q4_K || KIND == Q5_K || KIND == Q6_K; }

template <int KIND>
constexpr int64_t super_bytes() { return KIND == Q4_K ? 144 : KIND == Q5_K ? 176 : 210; }

// Q6_K has two scales a block of 32 (its 16-weight halves), the others one.
template <int KIND>
constexpr int64_t halves() { return KIND == Q6_K ? 2 : 1; }

// Bytes per 32 weights (per 256 for the k-quants) of the op's kind: what `blocks` must hold per row.
inline int64_t row_bytes(int64_t kind, int64_t K) {
  if (kind == 40 || kind == 80) return K / GROUP * bytes_of(kind / 10);  // the plain kind's bytes, interleaved
  if (kind == Q4_K || kind == Q5_K || kind == Q6_K)
    return K / SUPER * (kind == Q4_K ? super_bytes<Q4_K>() : kind == Q5_K ? super_bytes<Q5_K>() : super_bytes<Q6_K>());
  return K / GROUP * bytes_of(kind);
}

// A Q4_K / Q5_K super-block's 12 bytes of 6-bit sc and m as 16 bytes, sc_0..7 then m_0..7:
// llama.cpp's get_scale_min_k4, a word at a time (its AVX2 vec_dot's masks).
inline void k_scale_bytes(const uint8_t* sb, uint8_t* sc_m) {
  uint32_t u[4];
  std::memcpy(u, sb + 4, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t m_low = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = m_low;
  u[0] &= low6;
  std::memcpy(sc_m, u, 16);
}

// A k-quant row's scales as float32, per 32-weight block b: scale[b] = d * sc_b, mins[b] =
// -(dmin * m_b) (Q4_K, Q5_K); Q6_K: scale[2b + h] = d * sc of block b's half h, no mins.
template <int KIND>
inline void k_scales(const uint8_t* row, int64_t nsuper, float* scale, float* mins) {
  for (int64_t s = 0; s < nsuper; ++s) {
    const uint8_t* sb = row + s * super_bytes<KIND>();
    if constexpr (KIND == Q6_K) {
      const float d = half_at(sb + 208);
      for (int i = 0; i < 16; ++i) scale[s * 16 + i] = d * static_cast<float>(static_cast<int8_t>(sb[192 + i]));
    } else {
      const float d = half_at(sb), dmin = half_at(sb + 2);
      uint8_t sc_m[16];
      k_scale_bytes(sb, sc_m);
      for (int j = 0; j < 8; ++j) {
        scale[s * 8 + j] = d * static_cast<float>(sc_m[j]);
        mins[s * 8 + j] = -(dmin * static_cast<float>(sc_m[8 + j]));
      }
    }
  }
}

// Calls f.template operator()<J>() for J = 0..7: a super-block's eight blocks of 32, unrolled
// so that each block's byte offsets and shifts are constants.
template <typename F>
inline void each_block(F&& f) {
  [&]<int... J>(std::integer_sequence<int, J...>) { (f.template operator()<J>(), ...); }(std::make_integer_sequence<int, 8>{});
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

// x as int16 per block of 32 with its scale: x_j ~ sx * x16_j, |error| <= sx / 2 = 2^-16 of the
// block's largest |x| (bf16 itself rounds that one by 2^-9). Products of the codes and int16
// are exact in int32, and a lane's sum (2 products on AVX512, 4 on AVX2: < 2^24) exact in float32.
struct Activation {
  std::vector<int16_t> x16;  // [M, K]
  std::vector<float> sx;  // [M, nb_pad], zeros past nb
  std::vector<float> sums;  // [M, nb_pad]: sx * sum_j x16_j (Q4_1's min term), zeros past nb
};

inline Activation quantize(const float* x, int64_t M, int64_t K, int64_t nb_pad) {
  const int64_t nb = K / GROUP;
  Activation a{std::vector<int16_t>(M * K), std::vector<float>(M * nb_pad, 0.f), std::vector<float>(M * nb_pad, 0.f)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * GROUP;
      float amax = 0.f;
      for (int j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      int32_t total = 0;
      for (int j = 0; j < GROUP; ++j) {
        const int16_t q = static_cast<int16_t>(std::nearbyint(xb[j] * inv));
        a.x16[m * K + b * GROUP + j] = q;
        total += q;
      }
      a.sx[m * nb_pad + b] = amax / 32767.f;
      a.sums[m * nb_pad + b] = a.sx[m * nb_pad + b] * static_cast<float>(total);
    }
  }
  return a;
}

// The 8 floats' sum in one fixed order.
inline float sum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

// An MXFP4 block's 32 values v(q_j) as int8, weight j in byte j: each nibble looked up in
// kvalues_mxfp4 by a byte shuffle (llama.cpp's way).
inline __m256i mxfp4_values(const uint8_t* b) {
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(MXFP4_VALUES));
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)), nibble = _mm_set1_epi8(15);
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(qs, nibble));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), nibble));
  return _mm256_set_m128i(hi, lo);
}

// `k_scales` with the conversions and products 8 at a time (the same float32 products: a
// scalar decode per block cost as much as the block's multiply-adds).
template <int KIND>
inline void k_scales_vec(const uint8_t* row, int64_t nsuper, float* scale, float* mins) {
  for (int64_t s = 0; s < nsuper; ++s) {
    const uint8_t* sb = row + s * super_bytes<KIND>();
    if constexpr (KIND == Q6_K) {
      const __m256 d = _mm256_set1_ps(half_at(sb + 208));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192));  // 16 int8 scales
      _mm256_storeu_ps(scale + s * 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      _mm256_storeu_ps(scale + s * 16 + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
    } else {
      uint8_t sc_m[16];
      k_scale_bytes(sb, sc_m);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc_m));
      _mm256_storeu_ps(scale + s * 8, _mm256_mul_ps(_mm256_set1_ps(half_at(sb)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
      // -(dmin * m) == (-dmin) * m: a product's sign is its factors'
      _mm256_storeu_ps(mins + s * 8, _mm256_mul_ps(_mm256_set1_ps(-half_at(sb + 2)),
                                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
    }
  }
}

// The interleaved kinds (block_linear.interleave, made once at load): 16 output rows'
// blocks b side by side, so that a vector's 16 int32 lanes are 16 outputs and a row's block is
// summed in its lane, with no horizontal sum and no per-row decode: a block's codes are widened
// once for all the activation rows, and each row then costs 16 multiply-adds a block for 16
// outputs (llama.cpp's ggml-cpu repack kernels, column-interleaved the same way).
//
//   kind 40, Q4_1 x16 (320 B per 16 rows and block): | d fp16 [16] | m fp16 [16] | qs[256] |
//     qs[32 j + 2 c + e]: low nibble q_{2j+e}, high nibble q_{2(j+8)+e} of row c (j < 8, e < 2)
//   kind 80, Q8_0 x16 (544 B per 16 rows and block): | d fp16 [16] | qs[512] int8 |
//     qs[32 p + 2 c + e] = q_{2p+e} of row c (p < 16)
//
// blocks [N, K/32 * 20 or 34] as the plain kinds (N a multiple of 16): group g of 16 rows is
// rows 16 g .. 16 g + 15, its blocks one after another, so rows cut at a multiple of 16 (a fused
// projection's parts) are the parts' own blocks. Per output, activation row and block: the 32
// products summed exactly in int32 (at most 32 * 128 * 32767 < 2^31), rounded once to float32,
// scaled by d * sx into the output's accumulator, then (Q4_1) += m * sx * sum_j x16_j: one
// fixed sequence per output whatever M, its neighbours or the thread count.
template <int KIND>
constexpr int64_t x16_bytes() { return KIND == 40 ? 320 : 544; }

// Tasks (TILE output rows each) of at least MIN_TASK_WEIGHTS weights: on AVX2 a layer smaller than
// 2^18 weights runs on one thread, which on a busy machine costs less than waiting at the team's
// barrier for a descheduled thread (the tiles and so the bits are the same either way); AVX512's
// tasks are one tile each, as measured there.
#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t MIN_TASK_WEIGHTS = int64_t{1} << 18;
#else
constexpr int64_t MIN_TASK_WEIGHTS = 1;
#endif

inline int64_t task_grain(int64_t K) { return std::max<int64_t>(1, MIN_TASK_WEIGHTS / (TILE * K)); }

#endif

#if defined(CPU_CAPABILITY_AVX512)

// The block's 32 codes as int16 (q_j; q_j - 16 for Q5_0; v(q_j) for MXFP4), weight j in lane j.
template <int KIND>
inline __m512i codes16(const uint8_t* b) {
  if constexpr (KIND == 8) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)));
  } else if constexpr (KIND == 4) {
    const __m256i qs = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    const __m256i lo = _mm256_and_si256(qs, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(qs, 4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else if constexpr (KIND == MXFP4) {
    return _mm512_cvtepi8_epi16(mxfp4_values(b));
  } else {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m128i nibble = _mm_set1_epi8(15), sixteen = _mm_set1_epi8(16);
    const __m128i lo = _mm_or_si128(_mm_and_si128(qs, nibble),
                                    _mm_maskz_mov_epi8(static_cast<__mmask16>(qh), sixteen));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), nibble),
                                    _mm_maskz_mov_epi8(static_cast<__mmask16>(qh >> 16), sixteen));
    return _mm512_sub_epi16(_mm512_cvtepi8_epi16(_mm256_set_m128i(hi, lo)), _mm512_set1_epi16(16));
  }
}

// The rows' block scales d (and for Q4_1 mins m) as float32, [r][nb_pad] (nb_pad: nb rounded up
// to 16, zeros past nb): 16 blocks' first 4 bytes in one gather, converted together (a scalar
// fp16 conversion per block cost more than the block's products); MXFP4's first byte e as
// 2^(e - 128), its float32 bits built as `e8m0_half` builds them.
template <int KIND>
inline void scales(const uint8_t* row, int64_t stride, int64_t nb, int64_t nb_pad, int64_t r, float* d, float* mins) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(static_cast<int>(block_bytes<KIND>())));
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t b0 = 0; b0 < nb_pad; b0 += 16) {
      const __mmask16 in = nb - b0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (nb - b0)) - 1);
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, at,
                                                    row + i * stride + b0 * block_bytes<KIND>(), 1);
      if constexpr (KIND == MXFP4) {
        const __m512i e = _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
        const __mmask16 subnormal = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i bits = _mm512_mask_blend_epi32(subnormal, normal, _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e));
        _mm512_storeu_ps(d + i * nb_pad + b0, _mm512_castsi512_ps(_mm512_maskz_mov_epi32(in, bits)));
      } else {
        _mm512_storeu_ps(d + i * nb_pad + b0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
      }
      if constexpr (KIND == 4)
        _mm512_storeu_ps(mins + i * nb_pad + b0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
    }
  }
}

// The products' scales d * sx, [r][M][nb_pad], 16 blocks at a time.
inline void products(const float* d, const float* sx, int64_t r, int64_t M, int64_t nb_pad, float* ds) {
  for (int64_t i = 0; i < r; ++i)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb_pad; b += 16)
        _mm512_storeu_ps(ds + (i * M + m) * nb_pad + b,
                         _mm512_mul_ps(_mm512_loadu_ps(d + i * nb_pad + b), _mm512_loadu_ps(sx + m * nb_pad + b)));
}

// R output rows starting at `row` (blocks of `stride` bytes each) against MC activation rows
// starting at x16 (row length K); ds [R][M][nb_pad] from `products`, pointing at the first of
// the MC rows; out [R][MC] (row pitch MC).
template <int KIND, int R, int MC>
inline void tile_dot(const uint8_t* row, int64_t stride, const int16_t* x16, int64_t K, int64_t blocks,
                     const float* ds, int64_t M, int64_t nb_pad, float* out) {
  __m512 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i c[R];
    for (int r = 0; r < R; ++r) c[r] = codes16<KIND>(row + r * stride + b * block_bytes<KIND>());
    for (int m = 0; m < MC; ++m) {
      const __m512i xb = _mm512_loadu_si512(x16 + m * K + b * GROUP);
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_madd_epi16(c[r], xb));  // 16 pair sums, exact
        acc[r][m] = _mm512_fmadd_ps(_mm512_set1_ps(ds[(r * M + m) * nb_pad + b]), s, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) out[r * MC + m] = _mm512_reduce_add_ps(acc[r][m]);
}

// Q4_1: two output rows per vector. Their blocks' 16 code bytes side by side, widened to int16,
// give both rows' low nibbles (weights 0..15) in one vector and high nibbles (16..31) in another;
// against x16's first and second halves, each broadcast to both 256-bit halves, the two
// multiply-adds summed give lanes 0..7 the first row's pair sums and lanes 8..15 the second's
// (exact in int32). Decoding costs half the instructions a row of `codes16` does. A lone row
// (the tile's last, where r is odd) pairs with itself and keeps its lanes 0..7: the same
// operations, so an output's bits never depend on its neighbour. pair_sums: lo * x0 + hi * x1
// summed in pairs into int32; VNNI's dpwssd does the second multiply-add and
// the sum in one instruction (exact, so the same integers as madd + add). Written as asm: the
// kernel is compiled with torch's AVX512 flags, which do not include VNNI, and chosen at run time.
template <bool VNNI>
inline __m512i pair_sums(__m512i lo, __m512i x0, __m512i hi, __m512i x1) {
  __m512i sums = _mm512_madd_epi16(lo, x0);
  if constexpr (VNNI) {
    asm("vpdpwssd %2, %1, %0" : "+v"(sums) : "v"(hi), "v"(x1));
  } else {
    sums = _mm512_add_epi32(sums, _mm512_madd_epi16(hi, x1));
  }
  return sums;
}

template <int P, int MC, bool VNNI>
inline void pair_dot(const uint8_t* const* rows, const int16_t* x16, int64_t K, int64_t blocks, const float* d,
                     const float* sx, int64_t nb_pad, float* out) {
  __m512 acc[P][MC];
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < MC; ++m) acc[p][m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(15);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i lo[P], hi[P];
    __m512 dd[P];
    for (int p = 0; p < P; ++p) {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p] + b * 20 + 4));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * p + 1] + b * 20 + 4));
      const __m512i q = _mm512_cvtepu8_epi16(_mm256_set_m128i(q1, q0));
      lo[p] = _mm512_and_si512(q, nibble);
      hi[p] = _mm512_srli_epi16(q, 4);
      dd[p] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[(2 * p) * nb_pad + b]),
                                   _mm512_set1_ps(d[(2 * p + 1) * nb_pad + b]));
    }
    for (int m = 0; m < MC; ++m) {
      const int16_t* xb = x16 + m * K + b * GROUP;
      const __m512i x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb)));
      const __m512i x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16)));
      const __m512 s = _mm512_set1_ps(sx[m * nb_pad + b]);
      for (int p = 0; p < P; ++p) {
        const __m512i sums = pair_sums<VNNI>(lo[p], x0, hi[p], x1);
        acc[p][m] = _mm512_fmadd_ps(_mm512_mul_ps(dd[p], s), _mm512_cvtepi32_ps(sums), acc[p][m]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < MC; ++m) {
      out[(2 * p) * MC + m] = sum8(_mm512_castps512_ps256(acc[p][m]));
      out[(2 * p + 1) * MC + m] = sum8(_mm512_extractf32x8_ps(acc[p][m], 1));
    }
}

// Q4_1's min terms sum_b m_b * sums_b for one output and activation row, 16 blocks a lane.
inline float min_terms(const float* mins, const float* sums, int64_t nb_pad) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb_pad; b += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(mins + b), _mm512_loadu_ps(sums + b), acc);
  return _mm512_reduce_add_ps(acc);
}

template <int KIND, int R>
inline void tile_rows(const uint8_t* row, int64_t stride, const Activation& a, int64_t m0, int64_t mc, int64_t K,
                      int64_t nb, const float* ds, int64_t M, int64_t nb_pad, float* y) {
  const int16_t* x16 = a.x16.data() + m0 * K;
  const float* d0 = ds + m0 * nb_pad;
  switch (mc) {
    case 1: tile_dot<KIND, R, 1>(row, stride, x16, K, nb, d0, M, nb_pad, y); break;
    case 2: tile_dot<KIND, R, 2>(row, stride, x16, K, nb, d0, M, nb_pad, y); break;
    case 3: tile_dot<KIND, R, 3>(row, stride, x16, K, nb, d0, M, nb_pad, y); break;
    default: tile_dot<KIND, R, 4>(row, stride, x16, K, nb, d0, M, nb_pad, y); break;
  }
}

const bool HAS_VNNI = __builtin_cpu_supports("avx512vnni");

template <int P, bool VNNI>
inline void pair_rows_with(const uint8_t* const* rows, const int16_t* x16, int64_t mc, int64_t K, int64_t nb,
                           const float* d, const float* sx, int64_t nb_pad, float* y) {
  switch (mc) {
    case 1: pair_dot<P, 1, VNNI>(rows, x16, K, nb, d, sx, nb_pad, y); break;
    case 2: pair_dot<P, 2, VNNI>(rows, x16, K, nb, d, sx, nb_pad, y); break;
    case 3: pair_dot<P, 3, VNNI>(rows, x16, K, nb, d, sx, nb_pad, y); break;
    default: pair_dot<P, 4, VNNI>(rows, x16, K, nb, d, sx, nb_pad, y); break;
  }
}

template <int P>
inline void pair_rows(const uint8_t* const* rows, const Activation& a, int64_t m0, int64_t mc, int64_t K, int64_t nb,
                      const float* d, int64_t nb_pad, float* y) {
  const int16_t* x16 = a.x16.data() + m0 * K;
  const float* sx = a.sx.data() + m0 * nb_pad;
  if (HAS_VNNI) {
    pair_rows_with<P, true>(rows, x16, mc, K, nb, d, sx, nb_pad, y);
  } else {
    pair_rows_with<P, false>(rows, x16, mc, K, nb, d, sx, nb_pad, y);
  }
}

// r <= ROWS Q4_1 rows from `row` into out[m * N + i]: the pairs (0, 1), (2, 3); an odd last
// row pairs with itself.
template <typename T>
void q4_1_rows(const uint8_t* row, int64_t stride, int64_t r, const Activation& a, int64_t M, int64_t K, int64_t nb,
               int64_t nb_pad, float* d, float* mins, float* y, T* out, int64_t N) {
  const uint8_t* rows[ROWS];
  for (int64_t i = 0; i < ROWS; ++i) rows[i] = row + (i < r ? i : i % 2 == 1 && i - 1 < r ? i - 1 : 0) * stride;
  for (int64_t i = 0; i < ROWS; ++i) scales<4>(rows[i], stride, nb, nb_pad, 1, d + i * nb_pad, mins + i * nb_pad);
  for (int64_t m0 = 0; m0 < M; m0 += XROWS) {
    const int64_t mc = std::min(XROWS, M - m0);
    if (r > 2) {
      pair_rows<2>(rows, a, m0, mc, K, nb, d, nb_pad, y);
    } else {
      pair_rows<1>(rows, a, m0, mc, K, nb, d, nb_pad, y);
    }
    for (int64_t i = 0; i < r; ++i)
      for (int64_t m = 0; m < mc; ++m)
        out[(m0 + m) * N + i] = static_cast<T>(y[i * mc + m] + min_terms(mins + i * nb_pad, a.sums.data() + (m0 + m) * nb_pad, nb_pad));
  }
}

template <int KIND, typename T>
void gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  static_assert(XROWS == 4, "tile_rows instantiates 1..4 activation rows");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / GROUP;
  const int64_t stride = blocks.stride(0);
  const int64_t nb_pad = (nb + 15) / 16 * 16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const Activation a = quantize(xf.const_data_ptr<float>(), M, K, nb_pad);
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t first, int64_t last) {
    std::vector<float> d(ROWS * nb_pad), mins(ROWS * nb_pad), ds(ROWS * M * nb_pad);
    float y[ROWS * XROWS];
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t end = std::min(N, (tile + 1) * TILE);
      for (int64_t n = tile * TILE; n < end; n += ROWS) {
        const int64_t r = std::min(ROWS, end - n);
        const uint8_t* row = bp + n * stride;
        if constexpr (KIND == 4) {
          q4_1_rows(row, stride, r, a, M, K, nb, nb_pad, d.data(), mins.data(), y, op + n, N);
          continue;
        }
        scales<KIND>(row, stride, nb, nb_pad, r, d.data(), mins.data());
        products(d.data(), a.sx.data(), r, M, nb_pad, ds.data());
        for (int64_t m0 = 0; m0 < M; m0 += XROWS) {
          const int64_t mc = std::min(XROWS, M - m0);
          if (r == ROWS) {
            tile_rows<KIND, ROWS>(row, stride, a, m0, mc, K, nb, ds.data(), M, nb_pad, y);
          } else {
            for (int64_t i = 0; i < r; ++i)
              tile_rows<KIND, 1>(row + i * stride, stride, a, m0, mc, K, nb, ds.data() + i * M * nb_pad, M, nb_pad,
                                 y + i * mc);
          }
          for (int64_t i = 0; i < r; ++i)
            for (int64_t m = 0; m < mc; ++m) {
              float total = y[i * mc + m];
              if constexpr (KIND == 4) total += min_terms(mins.data() + i * nb_pad, a.sums.data() + (m0 + m) * nb_pad, nb_pad);
              op[(m0 + m) * N + n + i] = static_cast<T>(total);
            }
        }
      }
    }
  });
}

// Block J (0..7) of a k-quant super-block: its 32 codes as int16, weight l in lane l (q for
// Q4_K and Q5_K; q - 32 for Q6_K).
template <int KIND, int J>
inline __m512i k_codes16(const uint8_t* sb) {
  const __m512i nibble = _mm512_set1_epi16(15);
  if constexpr (KIND == Q4_K) {
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * (J / 2))));
    return _mm512_and_si512(_mm512_srli_epi16(q, 4 * (J % 2)), nibble);
  } else if constexpr (KIND == Q5_K) {
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 48 + 32 * (J / 2))));
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(q, 4 * (J % 2)), nibble);
    const __mmask32 high = _mm256_test_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16)),
                                                 _mm256_set1_epi8(static_cast<char>(1 << J)));
    return _mm512_mask_add_epi16(low, high, low, _mm512_set1_epi16(16));
  } else {
    constexpr int h = J / 4, t = J % 4;
    const __m512i ql = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32 * (t % 2))));
    const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h)));
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(ql, 4 * (t / 2)), nibble);
    const __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * t), _mm512_set1_epi16(3)), 4);
    return _mm512_sub_epi16(_mm512_or_si512(low, high), _mm512_set1_epi16(32));
  }
}

// R k-quant output rows from `row` against MC activation rows from x16; ds [R][M][P] (P =
// halves * nb_pad, entry b * halves + h: block b's (d * sc) * sx), pointing at the first of the
// MC rows; out [R][MC]. Per output and block: lanes += scale * products (Q6_K: lanes 0..7 hold
// the first 16 weights' pair sums, 8..15 the second's, each half its scale); the lanes summed.
template <int KIND, int R, int MC>
inline void k_tile_dot(const uint8_t* row, int64_t stride, const int16_t* x16, int64_t K, int64_t nsuper,
                       const float* ds, int64_t M, int64_t P, float* out) {
  __m512 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < nsuper; ++s) {
    each_block([&]<int J>() {
      const int64_t b = s * 8 + J;
      __m512i c[R];
      for (int r = 0; r < R; ++r) c[r] = k_codes16<KIND, J>(row + r * stride + s * super_bytes<KIND>());
      for (int m = 0; m < MC; ++m) {
        const __m512i xb = _mm512_loadu_si512(x16 + m * K + b * GROUP);
        for (int r = 0; r < R; ++r) {
          const float* at = ds + (r * M + m) * P + b * halves<KIND>();
          __m512 scale = _mm512_set1_ps(at[0]);
          if constexpr (KIND == Q6_K) scale = _mm512_mask_blend_ps(0xFF00, scale, _mm512_set1_ps(at[1]));
          acc[r][m] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_madd_epi16(c[r], xb)), acc[r][m]);
        }
      }
    });
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) out[r * MC + m] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int KIND, int R>
inline void k_tile_rows(const uint8_t* row, int64_t stride, const Activation& a, int64_t m0, int64_t mc, int64_t K,
                        int64_t nsuper, const float* ds, int64_t M, int64_t P, float* y) {
  const int16_t* x16 = a.x16.data() + m0 * K;
  const float* d0 = ds + m0 * P;
  switch (mc) {
    case 1: k_tile_dot<KIND, R, 1>(row, stride, x16, K, nsuper, d0, M, P, y); break;
    case 2: k_tile_dot<KIND, R, 2>(row, stride, x16, K, nsuper, d0, M, P, y); break;
    case 3: k_tile_dot<KIND, R, 3>(row, stride, x16, K, nsuper, d0, M, P, y); break;
    default: k_tile_dot<KIND, R, 4>(row, stride, x16, K, nsuper, d0, M, P, y); break;
  }
}

template <int KIND, typename T>
void k_gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / GROUP, nsuper = K / SUPER;
  const int64_t stride = blocks.stride(0);
  const int64_t nb_pad = (nb + 15) / 16 * 16, P = halves<KIND>() * nb_pad;
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const Activation a = quantize(xf.const_data_ptr<float>(), M, K, nb_pad);
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scale(ROWS * P, 0.f), mins(ROWS * nb_pad, 0.f), ds(ROWS * M * P, 0.f);  // zeros past nb
    float y[ROWS * XROWS];
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t end = std::min(N, (tile + 1) * TILE);
      for (int64_t n = tile * TILE; n < end; n += ROWS) {
        const int64_t r = std::min(ROWS, end - n);
        const uint8_t* row = bp + n * stride;
        for (int64_t i = 0; i < r; ++i) {
          k_scales_vec<KIND>(row + i * stride, nsuper, scale.data() + i * P, mins.data() + i * nb_pad);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t b = 0; b < nb; b += 8) {  // nb: a multiple of 8
              const float* sc = scale.data() + i * P + b * halves<KIND>();
              const float* sx = a.sx.data() + m * nb_pad + b;
              float* at = ds.data() + (i * M + m) * P + b * halves<KIND>();
              if constexpr (KIND == Q6_K) {  // each block's sx for both its halves
                const __m256 x = _mm256_loadu_ps(sx);
                const __m256 lo = _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
                const __m256 hi = _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
                _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(sc), lo));
                _mm256_storeu_ps(at + 8, _mm256_mul_ps(_mm256_loadu_ps(sc + 8), hi));
              } else {
                _mm256_storeu_ps(at, _mm256_mul_ps(_mm256_loadu_ps(sc), _mm256_loadu_ps(sx)));
              }
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += XROWS) {
          const int64_t mc = std::min(XROWS, M - m0);
          if (r == ROWS) {
            k_tile_rows<KIND, ROWS>(row, stride, a, m0, mc, K, nsuper, ds.data(), M, P, y);
          } else {
            for (int64_t i = 0; i < r; ++i)
              k_tile_rows<KIND, 1>(row + i * stride, stride, a, m0, mc, K, nsuper, ds.data() + i * M * P, M, P, y + i * mc);
          }
          for (int64_t i = 0; i < r; ++i)
            for (int64_t m = 0; m < mc; ++m) {
              float total = y[i * mc + m];
              if constexpr (KIND != Q6_K) total += min_terms(mins.data() + i * nb_pad, a.sums.data() + (m0 + m) * nb_pad, nb_pad);
              op[(m0 + m) * N + n + i] = static_cast<T>(total);
            }
        }
      }
    }
  });
}

template <bool VNNI>
inline __m512i dot_pair(__m512i acc, __m512i codes, __m512i x) {
  if constexpr (VNNI) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(codes), "v"(x));
    return acc;
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(codes, x));
  }
}

// One group's 16 outputs for MC activation rows from x16 (row length K); out [MC][16]. A block's
// codes are widened once; then up to 4 activation rows at a time, each row's 16 multiply-adds
// split over two int32 chains (even and odd pairs) and the rows' chains interleaved, so the
// vpdpwssd latency is hidden by independent work rather than paid 16 times a row (the sums are
// exact integers, so the split gives the same int32 as one chain); the float accumulators live in
// `out` (L1) between blocks, leaving the registers to the codes and the chains. Per output and
// row the float operations are the same sequence whatever MC.
template <int KIND, int MC, bool VNNI>
inline void x16_dot(const uint8_t* group, int64_t nb, const int16_t* x16, int64_t K, const float* sx,
                    const float* sums, int64_t nb_pad, float* out) {
  for (int m = 0; m < MC; ++m) _mm512_storeu_ps(out + m * 16, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * x16_bytes<KIND>();
    __m512i c[16];  // c[p]: lane l holds rows l's codes 2p, 2p + 1 as int16
    if constexpr (KIND == 40) {
      const __m512i nibble = _mm512_set1_epi16(15);
      for (int j = 0; j < 8; ++j) {
        const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 + 32 * j)));
        c[j] = _mm512_and_si512(q, nibble);
        c[j + 8] = _mm512_srli_epi16(q, 4);
      }
    } else {
      for (int p = 0; p < 16; ++p)
        c[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 + 32 * p)));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
    for (int m0 = 0; m0 < MC; m0 += 4) {
      constexpr int G = MC < 4 ? MC : 4;
      const int g = MC - m0 < G ? MC - m0 : G;
      __m512i s0[G], s1[G];
      for (int m = 0; m < G; ++m) s0[m] = s1[m] = _mm512_setzero_si512();
      for (int p = 0; p < 16; p += 2)
        for (int m = 0; m < G; ++m) {
          if (m >= g) break;
          const int16_t* xb = x16 + (m0 + m) * K + b * GROUP + 2 * p;
          int32_t even, odd;
          std::memcpy(&even, xb, 4);
          std::memcpy(&odd, xb + 2, 4);
          s0[m] = dot_pair<VNNI>(s0[m], c[p], _mm512_set1_epi32(even));
          s1[m] = dot_pair<VNNI>(s1[m], c[p + 1], _mm512_set1_epi32(odd));
        }
      for (int m = 0; m < g; ++m) {
        float* at = out + (m0 + m) * 16;
        const __m512i s = _mm512_add_epi32(s0[m], s1[m]);
        __m512 acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(sx[(m0 + m) * nb_pad + b])), _mm512_cvtepi32_ps(s),
                                     _mm512_loadu_ps(at));
        if constexpr (KIND == 40)
          acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32))),
                                _mm512_set1_ps(sums[(m0 + m) * nb_pad + b]), acc);
        _mm512_storeu_ps(at, acc);
      }
    }
  }
}

std::string path_name() { return HAS_VNNI ? "avx512 int16 avx512-vnni" : "avx512 int16"; }

#elif defined(CPU_CAPABILITY_AVX2)

// AVX2 (+FMA, F16C): the AVX512 path's arithmetic at half the width. The activation is rounded
// to int16 per block of 32 (`quantize`, above), a block's codes widened to int16, and its 32
// products summed by two `_mm256_madd_epi16` (or one madd and AVX-VNNI's `vpdpwssd`) into 8
// int32 lanes: each lane 4 products, at most 4 * 128 * 32767 < 2^24, exact in int32 and in
// float32; then one float32 scale d * sx per block. int8 activations (llama.cpp's q8_0, the
// `maddubs` way) cost no fewer instructions a block here and move each entry by up to 1/254 of
// its block's largest |x|: on SmolLM2's head that flipped "What is the capital of France?"
// from "The" (25.325 against 25.243 in float64) to "L'Étoile, ...", as llama.cpp answers too
// (docs/BENCHMARKS.md#avx2-class-cpus). Q4_1's min term is m * sx * sum_j x16_j, as on AVX512.

inline float half_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);  // exact, as c10::Half's conversion
}

// The 16 code bytes' nibbles, weight j in byte j (j < 16: low nibbles; 16..31: high).
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

// The block's 32 codes as int16: weights 0..15 in lo, 16..31 in hi (q_j; q_j - 16 for Q5_0;
// v(q_j) for MXFP4).
template <int KIND>
inline void codes16(const uint8_t* b, __m256i& lo, __m256i& hi) {
  if constexpr (KIND == 8) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
  } else if constexpr (KIND == 4) {
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
    lo = _mm256_and_si256(q, _mm256_set1_epi16(15));
    hi = _mm256_srli_epi16(q, 4);
  } else if constexpr (KIND == MXFP4) {
    const __m256i v = mxfp4_values(b);
    lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
    hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
  } else {
    // byte j = 0xFF where bit j of qh is set: the high bit; where it is clear, 0xF0 | nibble is q - 16
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    const __m256i q = _mm256_or_si256(nibbles(b + 6), _mm256_andnot_si256(bit, _mm256_set1_epi8(static_cast<char>(0xF0))));
    lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
    hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
  }
}

const bool HAS_VNNI = [] {
  const char* off = std::getenv("MEMRA_KERNEL_VNNI");  // "0": two madds (the same integers; tested)
  return __builtin_cpu_supports("avxvnni") && !(off != nullptr && off[0] == '0');
}();

// acc + codes * x summed in pairs into 8 int32 lanes, exact: VNNI's vpdpwssd does the multiply-add
// and the sum in one instruction (the same integers as madd + add). Written as asm: AVX-VNNI is
// not in the AVX2 flags, and chosen at run time.
template <bool VNNI>
inline __m256i dot_pair(__m256i acc, __m256i codes, __m256i x) {
  if constexpr (VNNI) {
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(codes), "x"(x));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(codes, x));
  }
}

// lo * x0 + hi * x1 summed in pairs into 8 int32 lanes.
template <bool VNNI>
inline __m256i pair_sums(__m256i lo, __m256i x0, __m256i hi, __m256i x1) {
  return dot_pair<VNNI>(_mm256_madd_epi16(lo, x0), hi, x1);
}

// R output rows from `row` against MC activation rows from x16 (row length K; sx, sums with row
// pitch nb); out [R][MC]. Per output and block: lanes += (d * sx) * products; then the lanes
// summed, plus (Q4_1) the min terms summed block by block: one order whatever R, MC or threads.
template <int KIND, int R, int MC, bool VNNI>
inline void tile_dot(const uint8_t* row, int64_t stride, const int16_t* x16, const float* sx, const float* sums,
                     int64_t K, int64_t nb, float* out) {
  __m256 acc[R][MC];
  float mins[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm256_setzero_ps(), mins[r][m] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = row + r * stride + b * block_bytes<KIND>();
      __m256i lo, hi;
      codes16<KIND>(block, lo, hi);  // decoded once for the MC activation rows
      const float d = KIND == MXFP4 ? e8m0_half(block[0]) : half_f16c(block);
      for (int m = 0; m < MC; ++m) {
        const int16_t* xb = x16 + m * K + b * GROUP;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
        const __m256 p = _mm256_cvtepi32_ps(pair_sums<VNNI>(lo, x0, hi, x1));
        acc[r][m] = _mm256_fmadd_ps(_mm256_set1_ps(d * sx[m * nb + b]), p, acc[r][m]);
        if constexpr (KIND == 4) mins[r][m] = std::fma(half_f16c(block + 2), sums[m * nb + b], mins[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) out[r * MC + m] = KIND == 4 ? sum8(acc[r][m]) + mins[r][m] : sum8(acc[r][m]);
}

constexpr int64_t XROWS_AVX2 = 2;  // 16 ymm registers: ROWS x 2 accumulators, a row's codes and the activation

template <int KIND, int R, bool VNNI>
inline void tile_rows(const uint8_t* row, int64_t stride, const Activation& a, int64_t m0, int64_t mc, int64_t K,
                      int64_t nb, float* y) {
  const int16_t* x16 = a.x16.data() + m0 * K;
  const float* sx = a.sx.data() + m0 * nb;
  const float* sums = a.sums.data() + m0 * nb;
  if (mc == 1) {
    tile_dot<KIND, R, 1, VNNI>(row, stride, x16, sx, sums, K, nb, y);
  } else {
    tile_dot<KIND, R, 2, VNNI>(row, stride, x16, sx, sums, K, nb, y);
  }
}

template <int KIND, bool VNNI, typename T>
void gemv_with(const Activation& a, int64_t M, int64_t K, int64_t N, const uint8_t* bp, int64_t stride, T* op) {
  const int64_t nb = K / GROUP;
  at::parallel_for(0, (N + TILE - 1) / TILE, task_grain(K), [&](int64_t first, int64_t last) {
    float y[ROWS * XROWS_AVX2];
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t end = std::min(N, (tile + 1) * TILE);
      for (int64_t n = tile * TILE; n < end; n += ROWS) {
        const int64_t r = std::min(ROWS, end - n);
        const uint8_t* row = bp + n * stride;
        for (int64_t m0 = 0; m0 < M; m0 += XROWS_AVX2) {
          const int64_t mc = std::min(XROWS_AVX2, M - m0);
          if (r == ROWS) {
            tile_rows<KIND, ROWS, VNNI>(row, stride, a, m0, mc, K, nb, y);
          } else {
            for (int64_t i = 0; i < r; ++i) tile_rows<KIND, 1, VNNI>(row + i * stride, stride, a, m0, mc, K, nb, y + i * mc);
          }
          for (int64_t i = 0; i < r; ++i)
            for (int64_t m = 0; m < mc; ++m) op[(m0 + m) * N + n + i] = static_cast<T>(y[i * mc + m]);
        }
      }
    }
  });
}

template <int KIND, typename T>
void gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const Activation a = quantize(xf.const_data_ptr<float>(), M, K, K / GROUP);  // row pitch nb: no padding
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  if (HAS_VNNI) {
    gemv_with<KIND, true>(a, M, K, N, bp, blocks.stride(0), out.data_ptr<T>());
  } else {
    gemv_with<KIND, false>(a, M, K, N, bp, blocks.stride(0), out.data_ptr<T>());
  }
}

// Block J (0..7) of a k-quant super-block: its 32 codes as int16, weights 0..15 in lo, 16..31
// in hi (q for Q4_K and Q5_K; q - 32 for Q6_K).
template <int KIND, int J>
inline void k_codes16(const uint8_t* sb, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(15);
  __m256i q;
  if constexpr (KIND == Q4_K) {
    q = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * (J / 2))),
                                           4 * (J % 2)), nibble);
  } else if constexpr (KIND == Q5_K) {
    const __m256i low = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 48 + 32 * (J / 2))), 4 * (J % 2)), nibble);
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << J));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);  // 0xFF where bit J of qh[l] is set
    q = _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  } else {
    constexpr int h = J / 4, t = J % 4;
    const __m256i low = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32 * (t % 2))), 4 * (t / 2)), nibble);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3)), 4);
    q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));  // -32..31
    lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
    hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    return;
  }
  lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
  hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
}

// R k-quant output rows from `row` against MC activation rows from x16 (sx, sums with row pitch
// nb); scale [R][nb] and mins [R][nb] from `k_scales_vec` (not Q6_K's); out [R][MC]. Per output
// and block: lanes += ((d * sc) * sx) * products, the min term summed block by block; then the
// lanes summed: one order whatever R, MC or threads. Q6_K: each half's codes times its int8
// scale first ((q - 32) * sc: |.| <= 4096, exact in int16; a lane's 4 products < 2^29, exact
// in int32, rounded once to float32), then lanes += (d * sx) * products: one multiply-add a
// block, as the other kinds, where a float scale per half took two.
template <int KIND, int R, int MC, bool VNNI>
inline void k_tile_dot(const uint8_t* row, int64_t stride, const int16_t* x16, const float* sx, const float* sums,
                       const float* scale, const float* mins_in, int64_t K, int64_t nsuper, float* out) {
  const int64_t nb = nsuper * 8;
  __m256 acc[R][MC];
  float mins[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm256_setzero_ps(), mins[r][m] = 0.f;
  for (int64_t s = 0; s < nsuper; ++s) {
    float d6[R];  // Q6_K: the super-blocks' d
    if constexpr (KIND == Q6_K)
      for (int r = 0; r < R; ++r) d6[r] = half_f16c(row + r * stride + s * super_bytes<KIND>() + 208);
    each_block([&]<int J>() {
      const int64_t b = s * 8 + J;
      for (int r = 0; r < R; ++r) {
        const uint8_t* sb = row + r * stride + s * super_bytes<KIND>();
        __m256i lo, hi;
        k_codes16<KIND, J>(sb, lo, hi);  // decoded once for the MC rows
        float sc;
        if constexpr (KIND == Q6_K) {
          lo = _mm256_mullo_epi16(lo, _mm256_set1_epi16(static_cast<int8_t>(sb[192 + 2 * J])));
          hi = _mm256_mullo_epi16(hi, _mm256_set1_epi16(static_cast<int8_t>(sb[193 + 2 * J])));
          sc = d6[r];
        } else {
          sc = scale[r * nb + b];
        }
        for (int m = 0; m < MC; ++m) {
          const int16_t* xb = x16 + m * K + b * GROUP;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
          acc[r][m] = _mm256_fmadd_ps(_mm256_set1_ps(sc * sx[m * nb + b]),
                                      _mm256_cvtepi32_ps(pair_sums<VNNI>(lo, x0, hi, x1)), acc[r][m]);
          if constexpr (KIND != Q6_K) mins[r][m] = std::fma(mins_in[r * nb + b], sums[m * nb + b], mins[r][m]);
        }
      }
    });
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) out[r * MC + m] = KIND == Q6_K ? sum8(acc[r][m]) : sum8(acc[r][m]) + mins[r][m];
}

template <int KIND, int R, bool VNNI>
inline void k_tile_rows(const uint8_t* row, int64_t stride, const Activation& a, int64_t m0, int64_t mc, int64_t K,
                        int64_t nsuper, const float* scale, const float* mins, float* y) {
  const int64_t nb = nsuper * 8;
  const int16_t* x16 = a.x16.data() + m0 * K;
  const float* sx = a.sx.data() + m0 * nb;
  const float* sums = a.sums.data() + m0 * nb;
  if (mc == 1) {
    k_tile_dot<KIND, R, 1, VNNI>(row, stride, x16, sx, sums, scale, mins, K, nsuper, y);
  } else {
    k_tile_dot<KIND, R, 2, VNNI>(row, stride, x16, sx, sums, scale, mins, K, nsuper, y);
  }
}

template <int KIND, bool VNNI, typename T>
void k_gemv_with(const Activation& a, int64_t M, int64_t K, int64_t N, const uint8_t* bp, int64_t stride, T* op) {
  const int64_t nb = K / GROUP, nsuper = K / SUPER;
  at::parallel_for(0, (N + TILE - 1) / TILE, task_grain(K), [&](int64_t first, int64_t last) {
    std::vector<float> scale(ROWS * nb), mins(ROWS * nb);
    float y[ROWS * XROWS_AVX2];
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t end = std::min(N, (tile + 1) * TILE);
      for (int64_t n = tile * TILE; n < end; n += ROWS) {
        const int64_t r = std::min(ROWS, end - n);
        const uint8_t* row = bp + n * stride;
        if constexpr (KIND != Q6_K)  // Q6_K's scales are read in the tile (k_tile_dot)
          for (int64_t i = 0; i < r; ++i) k_scales_vec<KIND>(row + i * stride, nsuper, scale.data() + i * nb, mins.data() + i * nb);
        for (int64_t m0 = 0; m0 < M; m0 += XROWS_AVX2) {
          const int64_t mc = std::min(XROWS_AVX2, M - m0);
          if (r == ROWS) {
            k_tile_rows<KIND, ROWS, VNNI>(row, stride, a, m0, mc, K, nsuper, scale.data(), mins.data(), y);
          } else {
            for (int64_t i = 0; i < r; ++i)
              k_tile_rows<KIND, 1, VNNI>(row + i * stride, stride, a, m0, mc, K, nsuper, scale.data() + i * nb,
                                         mins.data() + i * nb, y + i * mc);
          }
          for (int64_t i = 0; i < r; ++i)
            for (int64_t m = 0; m < mc; ++m) op[(m0 + m) * N + n + i] = static_cast<T>(y[i * mc + m]);
        }
      }
    }
  });
}

template <int KIND, typename T>
void k_gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const Activation a = quantize(xf.const_data_ptr<float>(), M, K, K / GROUP);
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  if (HAS_VNNI) {
    k_gemv_with<KIND, true>(a, M, K, N, bp, blocks.stride(0), out.data_ptr<T>());
  } else {
    k_gemv_with<KIND, false>(a, M, K, N, bp, blocks.stride(0), out.data_ptr<T>());
  }
}

// The interleaved kinds (40, 80; their layout: above) at 8 lanes: a group's 16 outputs are two
// halves of 8 rows, the half's codes of a pair the 16 bytes of the 32 the AVX512 path widens, one
// output a ymm lane. Each output runs the AVX512 path's own operations (the int32 sums exact, then
// acc = fma(d * sx, sums, acc), then Q4_1's acc = fma(m, sums_x, acc)), so the two builds give
// the same bits. 16 ymm registers: a half's MC int32 sums for the block (8 at MC = 8), its codes
// of one pair (Q4_1: one load gives pairs j and j + 8), the broadcast activation pair and a
// product; the float32 accumulators wait in `out` (L1), updated once a block and half. Up to 4
// activation rows both halves run together (2 x MC sums), so one broadcast pair serves 16
// outputs; 5..8 rows, one half after the other. Either way a block's codes are widened once for
// all MC activation rows (the row-major AVX2 path: once for 2, XROWS_AVX2).
// x16_j's weights 2p, 2p + 1 in every int32 lane.
inline __m256i x_pair(const int16_t* xb, int p) {
  int32_t pair;
  std::memcpy(&pair, xb + 2 * p, 4);
  return _mm256_set1_epi32(pair);
}

// Halves h0 .. h0 + H - 1 of block b (at `block`) against MC activation rows from x16:
// out[m * 16 + 8 h + c] += (d_c * sx_m) * row 8 h + c's products (Q4_1: then += m_c * sums_m).
template <int KIND, int MC, int H, bool VNNI>
inline void x16_block(const uint8_t* block, int h0, int64_t b, const int16_t* x16, int64_t K, const float* sx,
                      const float* sums, int64_t nb_pad, float* out) {
  __m256i s[H][MC];
  for (int h = 0; h < H; ++h)
    for (int m = 0; m < MC; ++m) s[h][m] = _mm256_setzero_si256();
  const int16_t* xb = x16 + b * GROUP;
  if constexpr (KIND == 40) {
    for (int j = 0; j < 8; ++j) {
      __m256i lo[H], hi[H];  // pairs j and j + 8
      for (int h = 0; h < H; ++h) {
        const __m256i q = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 + 32 * j + 16 * (h0 + h))));
        lo[h] = _mm256_and_si256(q, _mm256_set1_epi16(15));
        hi[h] = _mm256_srli_epi16(q, 4);
      }
      for (int m = 0; m < MC; ++m) {
        const __m256i x0 = x_pair(xb + m * K, j), x1 = x_pair(xb + m * K, j + 8);
        for (int h = 0; h < H; ++h) s[h][m] = dot_pair<VNNI>(dot_pair<VNNI>(s[h][m], lo[h], x0), hi[h], x1);
      }
    }
  } else {
    for (int p = 0; p < 16; ++p) {
      __m256i c[H];
      for (int h = 0; h < H; ++h)
        c[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 32 * p + 16 * (h0 + h))));
      for (int m = 0; m < MC; ++m) {
        const __m256i x = x_pair(xb + m * K, p);
        for (int h = 0; h < H; ++h) s[h][m] = dot_pair<VNNI>(s[h][m], c[h], x);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * (h0 + h))));
    for (int m = 0; m < MC; ++m) {
      float* at = out + m * 16 + 8 * (h0 + h);
      __m256 acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(sx[m * nb_pad + b])), _mm256_cvtepi32_ps(s[h][m]),
                                   _mm256_loadu_ps(at));
      if constexpr (KIND == 40)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * (h0 + h)))),
                              _mm256_set1_ps(sums[m * nb_pad + b]), acc);
      _mm256_storeu_ps(at, acc);
    }
  }
}

// One group's 16 outputs for MC activation rows from x16 (row length K); out [MC][16].
template <int KIND, int MC, bool VNNI>
inline void x16_dot(const uint8_t* group, int64_t nb, const int16_t* x16, int64_t K, const float* sx,
                    const float* sums, int64_t nb_pad, float* out) {
  std::fill(out, out + MC * 16, 0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * x16_bytes<KIND>();
    if constexpr (MC <= 4) {
      x16_block<KIND, MC, 2, VNNI>(block, 0, b, x16, K, sx, sums, nb_pad, out);
    } else {
      x16_block<KIND, MC, 1, VNNI>(block, 0, b, x16, K, sx, sums, nb_pad, out);
      x16_block<KIND, MC, 1, VNNI>(block, 1, b, x16, K, sx, sums, nb_pad, out);
    }
  }
}

std::string path_name() { return HAS_VNNI ? "avx2 int16 avx-vnni" : "avx2 int16"; }

#else

template <int KIND>
inline void codes(const uint8_t* b, float* c) {
  if constexpr (KIND == 8) {
    for (int j = 0; j < 32; ++j) c[j] = static_cast<float>(static_cast<int8_t>(b[2 + j]));
  } else if constexpr (KIND == 4) {
    for (int j = 0; j < 16; ++j) {
      c[j] = static_cast<float>(b[4 + j] & 15);
      c[j + 16] = static_cast<float>(b[4 + j] >> 4);
    }
  } else if constexpr (KIND == MXFP4) {
    for (int j = 0; j < 16; ++j) {
      c[j] = static_cast<float>(MXFP4_VALUES[b[1 + j] & 15]);
      c[j + 16] = static_cast<float>(MXFP4_VALUES[b[1 + j] >> 4]);
    }
  } else {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      // int: qh is unsigned, and q - 16 must not wrap
      c[j] = static_cast<float>(static_cast<int>((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      c[j + 16] = static_cast<float>(static_cast<int>((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  }
}

// Without AVX512 the activation stays float32 (no int16 rounding), one output at a time.
template <int KIND>
float row_dot(const uint8_t* row, const float* x, int64_t blocks) {
  float acc[16] = {}, mins = 0.f, c[32];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * block_bytes<KIND>();
    const float* xb = x + b * GROUP;
    codes<KIND>(block, c);
    const float scale = KIND == MXFP4 ? e8m0_half(block[0]) : half_at(block);
    for (int l = 0; l < 16; ++l) acc[l] += scale * (c[l] * xb[l] + c[l + 16] * xb[l + 16]);
    if constexpr (KIND == 4) {
      float sum = 0.f;
      for (int j = 0; j < GROUP; ++j) sum += xb[j];
      mins += half_at(block + 2) * sum;
    }
  }
  float total = 0.f;
  for (int l = 0; l < 16; ++l) total += acc[l];
  return total + mins;
}

template <int KIND, typename T>
void gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / GROUP;
  const int64_t stride = blocks.stride(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const float* xp = xf.const_data_ptr<float>();
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t first, int64_t last) {
    for (int64_t n = first * TILE; n < std::min(N, last * TILE); ++n)
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = static_cast<T>(row_dot<KIND>(bp + n * stride, xp + m * K, nb));
  });
}

// Block j of a k-quant super-block: its 32 codes (q; q - 32 for Q6_K) as float.
template <int KIND>
inline void k_codes(const uint8_t* sb, int j, float* c) {
  for (int l = 0; l < 32; ++l) {
    if constexpr (KIND == Q4_K) {
      c[l] = static_cast<float>((sb[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15);
    } else if constexpr (KIND == Q5_K) {
      c[l] = static_cast<float>(((sb[48 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15) | (((sb[16 + l] >> j) & 1) << 4));
    } else {
      const int h = j / 4, t = j % 4;
      const int q = ((sb[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15) | (((sb[128 + 32 * h + l] >> (2 * t)) & 3) << 4);
      c[l] = static_cast<float>(q - 32);
    }
  }
}

template <int KIND>
float k_row_dot(const uint8_t* row, const float* x, int64_t nsuper, float* scale, float* mins) {
  k_scales<KIND>(row, nsuper, scale, mins);
  float acc[16] = {}, min_sum = 0.f, c[32];
  for (int64_t s = 0; s < nsuper; ++s) {
    for (int j = 0; j < 8; ++j) {
      const int64_t b = s * 8 + j;
      const float* xb = x + b * GROUP;
      k_codes<KIND>(row + s * super_bytes<KIND>(), j, c);
      const float s0 = scale[b * halves<KIND>()], s1 = scale[b * halves<KIND>() + halves<KIND>() - 1];
      for (int l = 0; l < 16; ++l) acc[l] += s0 * c[l] * xb[l] + s1 * c[l + 16] * xb[l + 16];
      if constexpr (KIND != Q6_K) {
        float sum = 0.f;
        for (int l = 0; l < GROUP; ++l) sum += xb[l];
        min_sum += mins[b] * sum;
      }
    }
  }
  float total = 0.f;
  for (int l = 0; l < 16; ++l) total += acc[l];
  return total + min_sum;
}

template <int KIND, typename T>
void k_gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nsuper = K / SUPER;
  const int64_t stride = blocks.stride(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const float* xp = xf.const_data_ptr<float>();
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scale(nsuper * 16), mins(nsuper * 8);
    for (int64_t n = first * TILE; n < std::min(N, last * TILE); ++n)
      for (int64_t m = 0; m < M; ++m)
        op[m * N + n] = static_cast<T>(k_row_dot<KIND>(bp + n * stride, xp + m * K, nsuper, scale.data(), mins.data()));
  });
}

std::string path_name() { return "plain float32"; }

#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

// Activation rows a group's codes are widened once for: AVX512 holds a block's 16 code vectors
// and 8 accumulators in its 32 registers; AVX2 8 int32 sums a half (its x16_dot).
constexpr int64_t XROWS16 = 8;

template <int KIND, bool VNNI>
inline void x16_rows(const uint8_t* group, int64_t nb, const Activation& a, int64_t m0, int64_t mc, int64_t K,
                     int64_t nb_pad, float* y) {
  const int16_t* x16 = a.x16.data() + m0 * K;
  const float* sx = a.sx.data() + m0 * nb_pad;
  const float* sums = a.sums.data() + m0 * nb_pad;
  switch (mc) {
    case 1: x16_dot<KIND, 1, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
    case 2: x16_dot<KIND, 2, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
    case 3: x16_dot<KIND, 3, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
    case 4: x16_dot<KIND, 4, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
    case 5: x16_dot<KIND, 5, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
    case 6: x16_dot<KIND, 6, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
    case 7: x16_dot<KIND, 7, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
    default: x16_dot<KIND, 8, VNNI>(group, nb, x16, K, sx, sums, nb_pad, y); break;
  }
}

template <int KIND, bool VNNI, typename T>
void x16_gemv_with(const Activation& a, int64_t M, int64_t K, int64_t N, const uint8_t* bp, int64_t nb_pad, T* op) {
  const int64_t nb = K / GROUP, groups = N / 16, per_tile = TILE / 16;
  at::parallel_for(0, (groups + per_tile - 1) / per_tile, task_grain(K), [&](int64_t first, int64_t last) {
    alignas(64) float y[XROWS16 * 16];
    for (int64_t g = first * per_tile; g < std::min(groups, last * per_tile); ++g) {
      const uint8_t* group = bp + g * nb * x16_bytes<KIND>();
      for (int64_t m0 = 0; m0 < M; m0 += XROWS16) {
        const int64_t mc = std::min(XROWS16, M - m0);
        x16_rows<KIND, VNNI>(group, nb, a, m0, mc, K, nb_pad, y);
        for (int64_t m = 0; m < mc; ++m)
          for (int64_t i = 0; i < 16; ++i) op[(m0 + m) * N + g * 16 + i] = static_cast<T>(y[m * 16 + i]);
      }
    }
  });
}

template <int KIND, typename T>
void x16_gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / GROUP;
  const int64_t nb_pad = (nb + 15) / 16 * 16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const Activation a = quantize(xf.const_data_ptr<float>(), M, K, nb_pad);
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  if (HAS_VNNI) {
    x16_gemv_with<KIND, true>(a, M, K, N, bp, nb_pad, out.data_ptr<T>());
  } else {
    x16_gemv_with<KIND, false>(a, M, K, N, bp, nb_pad, out.data_ptr<T>());
  }
}

constexpr bool INTERLEAVES = true;
#else

template <int KIND, typename T>
void x16_gemv(const at::Tensor&, const at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "the interleaved block kinds (40, 80) run on the AVX512 and AVX2 builds only");
}

constexpr bool INTERLEAVES = false;

#endif

template <int KIND, typename T>
void run(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  if constexpr (KIND == 40 || KIND == 80) {
    x16_gemv<KIND, T>(x, blocks, out);
  } else if constexpr (is_k<KIND>()) {
    k_gemv<KIND, T>(x, blocks, out);
  } else {
    gemv<KIND, T>(x, blocks, out);
  }
}

template <int KIND>
void dispatch(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) {
    run<KIND, c10::BFloat16>(x, blocks, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "block_gemv takes bfloat16 or float32 activations");
    run<KIND, float>(x, blocks, out);
  }
}

at::Tensor block_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "block_gemv takes x [M, K] and blocks [N, K/32 * bytes]");
  const bool k_quant = kind == Q4_K || kind == Q5_K || kind == Q6_K, interleaved = kind == 40 || kind == 80;
  TORCH_CHECK(kind == 8 || kind == 5 || kind == 4 || kind == MXFP4 || k_quant || (interleaved && INTERLEAVES),
              "block_gemv kind is 8 (Q8_0), 5 (Q5_0), 4 (Q4_1), 39 (MXFP4), 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K)",
              INTERLEAVES ? "; 40 (Q4_1 x16) or 80 (Q8_0 x16)" : " (the interleaved kinds run on AVX512 and AVX2 only)");
  TORCH_CHECK(!interleaved || blocks.size(0) % 16 == 0, "interleaved blocks come in groups of 16 rows");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.stride(1) == 1, "blocks must be uint8 rows");
  TORCH_CHECK(x.size(1) % (k_quant ? SUPER : GROUP) == 0, "K must be a multiple of 32 (of 256 for a k-quant)");
  TORCH_CHECK(blocks.size(1) == row_bytes(kind, x.size(1)), "blocks do not match K for this kind");
  at::Tensor out = at::empty({x.size(0), blocks.size(0)}, x.options());
  switch (kind) {
    case 8: dispatch<8>(x, blocks, out); break;
    case 5: dispatch<5>(x, blocks, out); break;
    case 4: dispatch<4>(x, blocks, out); break;
    case MXFP4: dispatch<MXFP4>(x, blocks, out); break;
    case 40: dispatch<40>(x, blocks, out); break;
    case 80: dispatch<80>(x, blocks, out); break;
    case Q4_K: dispatch<Q4_K>(x, blocks, out); break;
    case Q5_K: dispatch<Q5_K>(x, blocks, out); break;
    default: dispatch<Q6_K>(x, blocks, out); break;
  }
  return out;
}

}  // namespace

// Which path this build runs: its ISA, the activation rounding and the dot instruction.
std::string block_gemv_path() { return path_name(); }

// Whether this build runs the interleaved kinds (40, 80): the AVX512 and AVX2 ones.
bool block_gemv_interleaves() { return INTERLEAVES; }

TORCH_LIBRARY_FRAGMENT(memra, m) {
  m.def("block_gemv(Tensor x, Tensor blocks, int kind) -> Tensor");
  m.def("block_gemv_path() -> str", &block_gemv_path);
  m.def("block_gemv_interleaves() -> bool", &block_gemv_interleaves);
}

TORCH_LIBRARY_IMPL(memra, CPU, m) { m.impl("block_gemv", block_gemv); }
