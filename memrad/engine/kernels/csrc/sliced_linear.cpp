// A prefill chunk's dense product whose bits do not depend on the intra-op thread count.
//
//   memra::sliced_linear(x [..., K], weight [N, K], bias [N] or None, slices) -> y [..., N]
//
// oneDNN picks its blocking (and, for some shapes, a split of the K reduction) from the
// threads it may use, so the same bf16 GEMM rounds differently at 1 and 2 threads (the
// default model's down projection, 256 x 1536 -> 576, on Sapphire Rapids). Here the output
// columns are cut into `slices` fixed spans (the cut depends only on N and `slices`), each
// span is one single-threaded GEMM, and torch's threads share the spans: with any number of
// threads every span is the same call, so y has the same bits.
//
//   columns | span 0 | span 1 | ... | span S-1 |      span s: y[:, s] = x @ weight[s]^T + bias[s]
//
// Each span runs with one OpenMP thread asked for (its own ICV), also when the loop runs
// inline on the calling thread (one thread), so oneDNN sees the same count either way; the
// workers run under the caller's thread-local state (inference mode, grad mode).
// Built at run time with the flags of the machine's CPU (memrad.engine.kernels.build).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t ALIGN = 16;  // spans start on a multiple of 16 columns (a vector of floats)

// Ask for one thread in this scope: the spans' GEMMs must not fan out, inline or nested.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

at::Tensor sliced_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t slices) {
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "sliced_linear: x [..., K], weight [N, K]");
  TORCH_CHECK(slices >= 1, "sliced_linear: slices >= 1");
  const int64_t n = weight.size(0);
  const auto flat = x.reshape({-1, x.size(-1)});
  auto out = at::empty({flat.size(0), n}, x.options());
  const int64_t span = std::max<int64_t>(ALIGN, (n + slices - 1) / slices + ALIGN - 1) / ALIGN * ALIGN;
  const int64_t spans = (n + span - 1) / span;
  const at::ThreadLocalState caller;  // inference mode, grad mode: the workers run as the caller
  at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard as_caller(caller);
    OneThread one;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t start = s * span, width = std::min(span, n - start);
      std::optional<at::Tensor> part;
      if (bias.has_value()) part = bias->narrow(0, start, width);
      out.narrow(1, start, width).copy_(at::linear(flat, weight.narrow(0, start, width), part));
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(memra, m) {
  m.def("sliced_linear(Tensor x, Tensor weight, Tensor? bias, int slices) -> Tensor");
}

TORCH_LIBRARY_IMPL(memra, CPU, m) { m.impl("sliced_linear", sliced_linear); }
