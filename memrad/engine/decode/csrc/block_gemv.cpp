// One token's matrix-vector product straight from a GGUF's Q8_0 or Q5_0 blocks, as shipped.
//
//   memra::block_gemv(x [M, K], blocks [N, K/32 * B] uint8, kind) -> out [M, N]   (x's dtype)
//
//   kind 8, Q8_0 (B = 34):  | d fp16 | q[32] int8 |                        w_j = d * q_j
//   kind 5, Q5_0 (B = 22):  | d fp16 | qh uint32 | qs[16] |                w_j = d * (q_j - 16)
//                           q_j = low nibble of qs[j] (j < 16) or high nibble of qs[j - 16],
//                           plus 16 * bit j of qh
//
// torch's int4 kernel can run these only as two 4-bit passes (hi|lo: 10 bits a weight with
// its bf16 scales, where the blocks are 8.5 and 5.5); this kernel reads the blocks llama.cpp
// reads, and multiplies the shipped weights exactly (fp16 d is exact in float32). With AVX512
// the activation is rounded to int16 per block of 32 (2^-16 of the block's largest |x|: see
// `quantize`), so a block is one int8 x int16 multiply-add (exact) and one float32 scale; a
// float32 product per weight needed twice the instructions and ran no faster than hi|lo.
//
// Each output (m, n) is one fixed sequence of operations: per block, the products summed
// lane-wise (16 lanes; plain C++ in float32 where AVX512 is absent), scaled by d into the row's
// lane accumulator; the lanes summed at the end. Rows are cut into fixed tiles of ROWS spread
// over torch's threads, so the result has the same bits with any thread count and any M
// (a batched request decodes as it does alone).
//
// Built at run time with the flags of the machine's CPU (memrad.engine.decode.cpu_attention).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t ROWS = 4;  // rows computed together: their x loads are shared
constexpr int64_t TILE = 64;  // rows per task

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <int KIND>
constexpr int64_t block_bytes() { return KIND == 8 ? 34 : 22; }

#if defined(CPU_CAPABILITY_AVX512)

// The block's 32 codes as int16 (q_j, or q_j - 16 for Q5_0), weight j in lane j.
template <int KIND>
inline __m512i codes16(const uint8_t* b) {
  if constexpr (KIND == 8) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)));
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

// The rows' block scales d as float32, [r][nb_pad] (nb_pad: nb rounded up to 16), converted
// 16 at a time: a scalar fp16 conversion per block cost more than the block's products.
inline void scales(const uint8_t* row, int64_t stride, int64_t bytes, int64_t nb, int64_t nb_pad, int64_t r,
                   float* d) {
  alignas(32) uint16_t bits[16];
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t b0 = 0; b0 < nb_pad; b0 += 16) {
      for (int64_t b = 0; b < 16; ++b)
        bits[b] = b0 + b < nb ? static_cast<uint16_t>(row[i * stride + (b0 + b) * bytes] |
                                                      (row[i * stride + (b0 + b) * bytes + 1] << 8)) : 0;
      _mm512_storeu_ps(d + i * nb_pad + b0, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bits))));
    }
  }
}

// x as int16 per block of 32 with its scale: x_j ~ sx * x16_j, |error| <= sx / 2 = 2^-16 of the
// block's largest |x| (bf16 itself rounds that one by 2^-9). Products of int8 codes and int16
// are exact in int32, and a pair's sum (< 2^24) exact in float32.
struct Activation {
  std::vector<int16_t> x16;  // [M, K]
  std::vector<float> sx;  // [M, nb]
};

inline Activation quantize(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / GROUP;
  Activation a{std::vector<int16_t>(M * K), std::vector<float>(M * nb)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * GROUP;
      float amax = 0.f;
      for (int j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int j = 0; j < GROUP; ++j) a.x16[m * K + b * GROUP + j] = static_cast<int16_t>(std::nearbyint(xb[j] * inv));
      a.sx[m * nb + b] = amax / 32767.f;
    }
  }
  return a;
}

// R rows starting at `row` (blocks of `stride` bytes each, scales `d` [R][nb_pad]) against
// one activation row (x16 [K], sx [nb]).
template <int KIND, int R>
inline void rows_dot(const uint8_t* row, int64_t stride, const int16_t* x16, const float* sx, int64_t blocks,
                     const float* d, int64_t nb_pad, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512i xb = _mm512_loadu_si512(x16 + b * GROUP);
    for (int r = 0; r < R; ++r) {
      const __m512i c = codes16<KIND>(row + r * stride + b * block_bytes<KIND>());
      const __m512 s = _mm512_cvtepi32_ps(_mm512_madd_epi16(c, xb));  // 16 pair sums, exact
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[r * nb_pad + b] * sx[b]), s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#else

template <int KIND>
inline void codes(const uint8_t* b, float* c) {
  if constexpr (KIND == 8) {
    for (int j = 0; j < 32; ++j) c[j] = static_cast<float>(static_cast<int8_t>(b[2 + j]));
  } else {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      c[j] = static_cast<float>(((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      c[j + 16] = static_cast<float>(((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  }
}

// Without AVX512 the activation stays float32 (no int16 rounding).
struct Activation {
  std::vector<float> x16;  // [M, K]: named as the AVX512 path's, float here
  std::vector<float> sx;  // unused
};

inline Activation quantize(const float* x, int64_t M, int64_t K) { return {std::vector<float>(x, x + M * K), {}}; }

inline void scales(const uint8_t* row, int64_t stride, int64_t bytes, int64_t nb, int64_t nb_pad, int64_t r,
                   float* d) {
  for (int64_t i = 0; i < r; ++i)
    for (int64_t b = 0; b < nb; ++b) d[i * nb_pad + b] = half_at(row + i * stride + b * bytes);
}

template <int KIND, int R>
inline void rows_dot(const uint8_t* row, int64_t stride, const float* x, const float*, int64_t blocks,
                     const float* d, int64_t nb_pad, float* out) {
  float acc[R][16] = {};
  float c[32];
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * GROUP;
    for (int r = 0; r < R; ++r) {
      codes<KIND>(row + r * stride + b * block_bytes<KIND>(), c);
      const float scale = d[r * nb_pad + b];
      for (int l = 0; l < 16; ++l) acc[r][l] += scale * (c[l] * xb[l] + c[l + 16] * xb[l + 16]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int l = 0; l < 16; ++l) total += acc[r][l];
    out[r] = total;
  }
}

#endif

template <int KIND, typename T>
void gemv(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / GROUP;
  const int64_t stride = blocks.stride(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const Activation a = quantize(xf.const_data_ptr<float>(), M, K);
  const uint8_t* bp = blocks.const_data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  const int64_t nb_pad = (nb + 15) / 16 * 16;
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t first, int64_t last) {
    std::vector<float> d(ROWS * nb_pad);
    float y[ROWS];
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t end = std::min(N, (tile + 1) * TILE);
      for (int64_t n = tile * TILE; n < end; n += ROWS) {
        const int64_t r = std::min(ROWS, end - n);
        const uint8_t* row = bp + n * stride;
        scales(row, stride, block_bytes<KIND>(), nb, nb_pad, r, d.data());
        for (int64_t m = 0; m < M; ++m) {
          if (r == ROWS) {
            rows_dot<KIND, ROWS>(row, stride, a.x16.data() + m * K, a.sx.data() + m * nb, nb, d.data(), nb_pad, y);
          } else {
            for (int64_t i = 0; i < r; ++i)
              rows_dot<KIND, 1>(row + i * stride, stride, a.x16.data() + m * K, a.sx.data() + m * nb, nb,
                                d.data() + i * nb_pad, nb_pad, y + i);
          }
          for (int64_t i = 0; i < r; ++i) op[m * N + n + i] = static_cast<T>(y[i]);
        }
      }
    }
  });
}

template <int KIND>
void dispatch(const at::Tensor& x, const at::Tensor& blocks, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) {
    gemv<KIND, c10::BFloat16>(x, blocks, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "block_gemv takes bfloat16 or float32 activations");
    gemv<KIND, float>(x, blocks, out);
  }
}

at::Tensor block_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "block_gemv takes x [M, K] and blocks [N, K/32 * bytes]");
  TORCH_CHECK(kind == 8 || kind == 5, "block_gemv kind is 8 (Q8_0) or 5 (Q5_0)");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.stride(1) == 1, "blocks must be uint8 rows");
  TORCH_CHECK(x.size(1) % GROUP == 0, "K must be a multiple of 32");
  const int64_t bytes = kind == 8 ? block_bytes<8>() : block_bytes<5>();
  TORCH_CHECK(blocks.size(1) == x.size(1) / GROUP * bytes, "blocks do not match K for this kind");
  at::Tensor out = at::empty({x.size(0), blocks.size(0)}, x.options());
  if (kind == 8) {
    dispatch<8>(x, blocks, out);
  } else {
    dispatch<5>(x, blocks, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(memra, m) { m.def("block_gemv(Tensor x, Tensor blocks, int kind) -> Tensor"); }

TORCH_LIBRARY_IMPL(memra, CPU, m) { m.impl("block_gemv", block_gemv); }
