// One token's attention over a KV cache on the CPU, reading the cache once at memory speed.
//
//   memra::decode_attention(q [1, H_kv, G, D], keys [1, H_kv, L, D], values [1, H_kv, L, D],
//                           scale) -> out [1, H_kv, G, D]      (out: q's dtype)
//   memra::decode_attention_rows(q [B, H_kv, G, D], keys [B x [1, H_kv, capacity_r, D]], values [same],
//                                lengths [B], scale) -> out [B, H_kv, G, D]
//                                (row r over its first lengths[r] rows, as the op above gives it)
//
// The G query heads that share a KV head are scored together, so each key and value row is
// read once per token. Rows are cut into C chunks of at most CHUNK_ROWS, as equal as integers
// allow (`chunk_count`: C raised, while chunks keep MIN_CHUNK_ROWS, until H_kv x C is a multiple
// of 4); each (KV head, chunk) is one task with its own max, sum and weighted values
// (flash-decoding), spread over torch's threads, then merged in chunk order. The partition
// depends only on L and H_kv, never on the thread count, so the result has the same bits with
// any number of threads.
//
//   rows  | chunk 0 (L/C) | chunk 1 | ... | chunk C-1 |    chunk c: rows [c L / C, (c + 1) L / C)
//   task (h, c): scores s = q_h . k_j (scaled), m = max s, l = sum e^(s-m), a = sum e^(s-m) v_j
//   out_h = sum_c e^(m_c - M) a_c / sum_c e^(m_c - M) l_c,   M = max_c m_c
//
// q is bf16 or fp32, keys and values bf16 or fp32 (both one dtype): fp32 activations over a bf16
// cache (memrad.engine.model.kv_dtype) read half the bytes, and a bf16 row widens to fp32 exactly,
// so the scores are those of the same rows held in fp32.
//
// Built at run time with the flags of the machine's CPU (memrad.engine.kernels.build).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using VF = at::vec::Vectorized<float>;
constexpr int64_t CHUNK_ROWS = 256;
constexpr int64_t MIN_CHUNK_ROWS = 32;

// A row's chunk count: ceil(L / CHUNK_ROWS), raised while chunks keep MIN_CHUNK_ROWS until
// heads x chunks is a multiple of 4. at::parallel_for hands each thread a contiguous run of
// tasks: equal tasks in a count 2 and 4 divide give the threads equal shares (SmolLM2 at 544
// rows: 9 tasks of 256, 256 and 32 rows split 5 / 4 left one thread 800 rows, the other 576).
inline int64_t chunk_count(int64_t length, int64_t heads) {
  int64_t chunks = (length + CHUNK_ROWS - 1) / CHUNK_ROWS;
  while ((heads * chunks) % 4 != 0 && (chunks + 1) * MIN_CHUNK_ROWS <= length) ++chunks;
  return chunks;
}
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline VF load_float(const float* p) { return VF::loadu(p); }
inline VF load_float(const c10::BFloat16* p) {
  VF out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

// Scores in place -> e^(score - max); returns (max, sum).
inline std::pair<float, float> softmax_terms(float* s, int64_t rows) {
  const int64_t W = VF::size(), full = rows - rows % W;
  VF m_vec(NEG_INF);
  for (int64_t j = 0; j < full; j += W) m_vec = at::vec::maximum(m_vec, VF::loadu(s + j));
  float m = at::vec::vec_reduce_all<float>([](VF& a, VF& b) { return at::vec::maximum(a, b); }, m_vec);
  for (int64_t j = full; j < rows; ++j) m = std::max(m, s[j]);
  VF total_vec(0.f);
  for (int64_t j = 0; j < full; j += W) {
    VF e = (VF::loadu(s + j) - VF(m)).exp_u20();
    e.store(s + j);
    total_vec = total_vec + e;
  }
  float total = at::vec::vec_reduce_all<float>([](VF& a, VF& b) { return a + b; }, total_vec);
  for (int64_t j = full; j < rows; ++j) {
    s[j] = std::exp(s[j] - m);
    total += s[j];
  }
  return {m, total};
}

// Task (h, c) for a head dim D that is a multiple of the vector width and G <= 8 queries:
// queries and partial outputs stay in registers.
template <typename T, int D, int G>
void chunk_task(const float* q, const T* keys, const T* values, int64_t row_stride, int64_t rows,
                float* scores, float* max_out, float* sum_out, float* acc_out) {
  constexpr int N = D / VF::size();
  VF qv[G][N];
  for (int g = 0; g < G; ++g)
    for (int n = 0; n < N; ++n) qv[g][n] = VF::loadu(q + g * D + n * VF::size());
  for (int64_t j = 0; j < rows; ++j) {
    const T* k = keys + j * row_stride;
    VF kv[N];
    for (int n = 0; n < N; ++n) kv[n] = load_float(k + n * VF::size());
    for (int g = 0; g < G; ++g) {
      VF s = qv[g][0] * kv[0];
      for (int n = 1; n < N; ++n) s = at::vec::fmadd(qv[g][n], kv[n], s);
      scores[g * CHUNK_ROWS + j] = at::vec::vec_reduce_all<float>([](VF& a, VF& b) { return a + b; }, s);
    }
  }
  for (int g = 0; g < G; ++g) std::tie(max_out[g], sum_out[g]) = softmax_terms(scores + g * CHUNK_ROWS, rows);
  VF acc[G][N];
  for (int g = 0; g < G; ++g)
    for (int n = 0; n < N; ++n) acc[g][n] = VF(0.f);
  for (int64_t j = 0; j < rows; ++j) {
    const T* v = values + j * row_stride;
    VF vv[N];
    for (int n = 0; n < N; ++n) vv[n] = load_float(v + n * VF::size());
    for (int g = 0; g < G; ++g) {
      VF p(scores[g * CHUNK_ROWS + j]);
      for (int n = 0; n < N; ++n) acc[g][n] = at::vec::fmadd(p, vv[n], acc[g][n]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int n = 0; n < N; ++n) acc[g][n].store(acc_out + g * D + n * VF::size());
}

// Any other head dim or group size: the same task in plain loops.
template <typename T>
void chunk_task_any(const float* q, int64_t G, int64_t D, const T* keys, const T* values, int64_t row_stride,
                    int64_t rows, float* scores, float* max_out, float* sum_out, float* acc_out) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * static_cast<float>(keys[j * row_stride + d]);
      scores[g * CHUNK_ROWS + j] = dot;
    }
  for (int64_t g = 0; g < G; ++g) std::tie(max_out[g], sum_out[g]) = softmax_terms(scores + g * CHUNK_ROWS, rows);
  std::fill(acc_out, acc_out + G * D, 0.f);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        acc_out[g * D + d] += scores[g * CHUNK_ROWS + j] * static_cast<float>(values[j * row_stride + d]);
}

using Task = void (*)(const float*, const void*, const void*, int64_t, int64_t, float*, float*, float*, float*);

template <typename T, int D, int G>
void typed_task(const float* q, const void* k, const void* v, int64_t stride, int64_t rows, float* s, float* m,
                float* l, float* a) {
  chunk_task<T, D, G>(q, static_cast<const T*>(k), static_cast<const T*>(v), stride, rows, s, m, l, a);
}

template <typename T, int D>
Task pick_group(int64_t G) {
  switch (G) {
    case 1: return typed_task<T, D, 1>;
    case 2: return typed_task<T, D, 2>;
    case 3: return typed_task<T, D, 3>;
    case 4: return typed_task<T, D, 4>;
    case 5: return typed_task<T, D, 5>;
    case 6: return typed_task<T, D, 6>;
    case 7: return typed_task<T, D, 7>;
    case 8: return typed_task<T, D, 8>;
    default: return nullptr;
  }
}

template <typename T>
Task pick(int64_t G, int64_t D) {
  if (D % VF::size() != 0) return nullptr;
  switch (D) {
    case 16: return pick_group<T, 16>(G);
    case 32: return pick_group<T, 32>(G);
    case 64: return pick_group<T, 64>(G);
    case 128: return pick_group<T, 128>(G);
    case 256: return pick_group<T, 256>(G);  // Gemma 3
    default: return nullptr;
  }
}

// Rows r = 0..B-1, each its own query q[r] [H_kv, G, D] over the first L_r rows of its own keys[r],
// values[r] [1, H_kv, >= L_r, D]: every (row, KV head, chunk) is one task of one parallel loop, so B rows cost
// one call (one thread wake-up, one dispatch), not B. A task's arithmetic and a row's merge do
// not depend on the other rows, so a row has the bits the row alone gives (B = 1 is the one-row op).
template <typename TQ, typename T>
void attend(const at::Tensor& q, at::TensorList keys, at::TensorList values, at::IntArrayRef lengths, double scale,
            at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), G = q.size(2), D = q.size(3);
  // Row r's tasks are [first[r], first[r + 1]): heads x chunks of its length.
  std::vector<int64_t> chunks(batch), first(batch + 1, 0);
  for (int64_t r = 0; r < batch; ++r) {
    chunks[r] = chunk_count(lengths[r], heads);
    first[r + 1] = first[r] + heads * chunks[r];
  }
  const int64_t tasks = first[batch];
  // Queries as float, scaled: [B, H_kv, G, D] (here, not as torch ops: two dispatches a call).
  const at::Tensor qc = q.contiguous();
  const TQ* qsrc = qc.const_data_ptr<TQ>();
  const float qscale = static_cast<float>(scale);
  std::vector<float> qf(qc.numel());
  for (size_t i = 0; i < qf.size(); ++i) qf[i] = static_cast<float>(qsrc[i]) * qscale;
  const float* qp = qf.data();
  std::vector<float> maxes(tasks * G), sums(tasks * G), accs(tasks * G * D);
  const Task task_fn = pick<T>(G, D);
  at::parallel_for(0, tasks, 1, [&](int64_t begin_task, int64_t end_task) {
    std::vector<float> scores(G * CHUNK_ROWS);
    int64_t r = std::upper_bound(first.begin(), first.end(), begin_task) - first.begin() - 1;
    for (int64_t task = begin_task; task < end_task; ++task) {
      while (task >= first[r + 1]) ++r;
      const int64_t local = task - first[r], h = local / chunks[r], c = local % chunks[r];
      const int64_t begin = c * lengths[r] / chunks[r], rows = (c + 1) * lengths[r] / chunks[r] - begin;  // <= CHUNK_ROWS
      const at::Tensor &row_keys = keys[r], &row_values = values[r];
      const int64_t row_stride = row_keys.stride(2);
      const T* k = row_keys.const_data_ptr<T>() + h * row_keys.stride(1) + begin * row_stride;
      const T* v = row_values.const_data_ptr<T>() + h * row_values.stride(1) + begin * row_stride;
      float *m = &maxes[task * G], *l = &sums[task * G], *a = &accs[task * G * D];
      const float* qh = qp + (r * heads + h) * G * D;
      if (task_fn != nullptr) {
        task_fn(qh, k, v, row_stride, rows, scores.data(), m, l, a);
      } else {
        chunk_task_any<T>(qh, G, D, k, v, row_stride, rows, scores.data(), m, l, a);
      }
    }
  });
  TQ* op = out.data_ptr<TQ>();
  std::vector<float> o(D);
  for (int64_t r = 0; r < batch; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head_first = first[r] + h * chunks[r];
        float M = NEG_INF;
        for (int64_t c = 0; c < chunks[r]; ++c) M = std::max(M, maxes[(head_first + c) * G + g]);
        float total = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t c = 0; c < chunks[r]; ++c) {
          const int64_t at = (head_first + c) * G + g;
          const float w = std::exp(maxes[at] - M);
          total += w * sums[at];
          for (int64_t d = 0; d < D; ++d) o[d] += w * accs[at * D + d];
        }
        TQ* dst = op + ((r * heads + h) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<TQ>(o[d] / total);
      }
    }
  }
}

at::Tensor attend_any(const at::Tensor& q, at::TensorList keys, at::TensorList values, at::IntArrayRef lengths,
                      double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(0) == static_cast<int64_t>(keys.size()) && keys.size() == values.size() &&
                  keys.size() == lengths.size(),
              "decode_attention_rows takes q [B, H_kv, G, D] and B keys, values and lengths");
  for (size_t r = 0; r < keys.size(); ++r) {
    const at::Tensor &k = keys[r], &v = values[r];
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == 1, "keys and values are [1, H_kv, L, D] a row");
    TORCH_CHECK(k.sizes() == v.sizes() && k.stride(2) == v.stride(2), "keys and values differ in shape or row stride");
    TORCH_CHECK(q.size(1) == k.size(1) && q.size(3) == k.size(3), "q does not match the keys' heads");
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "key and value rows must be contiguous");
    TORCH_CHECK(lengths[r] > 0, "no rows to attend");
    TORCH_CHECK(lengths[r] <= k.size(2), "a length past its keys' rows");
    TORCH_CHECK(k.scalar_type() == keys[0].scalar_type() && v.scalar_type() == k.scalar_type(),
                "keys and values differ in dtype");
  }
  const auto q_type = q.scalar_type(), kv_type = keys[0].scalar_type();
  TORCH_CHECK((q_type == at::kBFloat16 || q_type == at::kFloat) && (kv_type == at::kBFloat16 || kv_type == at::kFloat),
              "decode_attention takes bfloat16 or float32");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q_type == at::kBFloat16) {
    if (kv_type == at::kBFloat16) attend<c10::BFloat16, c10::BFloat16>(q, keys, values, lengths, scale, out);
    else attend<c10::BFloat16, float>(q, keys, values, lengths, scale, out);
  } else {
    if (kv_type == at::kBFloat16) attend<float, c10::BFloat16>(q, keys, values, lengths, scale, out);
    else attend<float, float>(q, keys, values, lengths, scale, out);
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && q.size(0) == 1 && keys.size(0) == 1,
              "decode_attention takes q [1, H_kv, G, D], keys and values [1, H_kv, L, D]");
  return attend_any(q, {keys}, {values}, {keys.size(2)}, scale);
}

// The slabs whole and the lengths beside them: a compiled graph hands its inputs as they are,
// where a list of slices costs it a view made per row and layer (~1 µs each).
at::Tensor decode_attention_rows(const at::Tensor& q, at::TensorList keys, at::TensorList values,
                                 at::IntArrayRef lengths, double scale) {
  return attend_any(q, keys, values, lengths, scale);
}

}  // namespace

TORCH_LIBRARY(memra, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, float scale) -> Tensor");
  m.def("decode_attention_rows(Tensor q, Tensor[] keys, Tensor[] values, SymInt[] lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(memra, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_rows", decode_attention_rows);
}
