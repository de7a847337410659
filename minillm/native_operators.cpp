// The CPU kernels of our two PyTorch operators, minillm::paged_decode and minillm::linear_bf16_rows,
// in C++. Compiled at first use by minillm/native_build.py (build_operators); register_operator
// then hands each operator its kernel — a function of our kernels' own libraries
// (attention/cpu_paged_decode.cpp, layers/cpu_bf16_rows.cpp) — and registers it with PyTorch's
// dispatcher, once per process, before the first compiled graph that calls it is loaded.
//
// Why: a compiled decode graph with a free row count calls these ~151 times a step (30 attention
// calls, 121 matrix products for SmolLM2-135M). Their Python functions (registered for every
// device in cpu_paged.py and cpu_bf16_rows.py: the fallback) cost the dispatcher a trip into
// Python each time — ~7 µs a product and ~20 µs an attention call on top of the kernel
// (benchmarks/bench_bf16_rows.py, bench_kernel_operator.py): about 1.5 ms of a step. Here the
// same checks run in C++, and a kernel registered for the CPU is what the dispatcher prefers.
//
// Why a library of its own, not a part of each kernel's: PyTorch's headers make a build ~8 s
// slower on a cold cache, and an eager engine's first answer waits for the attention kernel; and
// the kernels compiled in one unit with those headers came out slower (the compiler inlined
// less). The kernels are built as before; this calls them through the pointers it is handed.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using PagedDecode = void (*)(const float*, const void*, const void*, const int64_t*, const int64_t*, const int64_t*,
                             float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float);
using LinearRows = void (*)(const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);

PagedDecode paged_decode_kernels[3] = {};  // for float32, bfloat16, float16 pools
LinearRows linear_rows_kernel = nullptr;
std::mutex registering;
// Held for the process and never destroyed: a registration lives as long as its Library object,
// and at exit nothing must deregister from a dispatcher that may already be gone.
auto* const registrations = new std::vector<std::unique_ptr<torch::Library>>();

// q[B, H, D] (any float dtype) against the paged pools: the checks of cpu_paged.paged_decode_op.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& visible,
                        int64_t block_size, double scale, int64_t window) {
  const auto pool = k_pool.scalar_type();
  const int which = pool == at::kFloat ? 0 : pool == at::kBFloat16 ? 1 : pool == at::kHalf ? 2 : -1;
  TORCH_CHECK_VALUE(
      q.dim() == 3 && k_pool.dim() == 3 && which >= 0 && v_pool.scalar_type() == pool &&
          v_pool.sizes() == k_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
          k_pool.size(2) == q.size(2) && k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0 &&
          block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && context_lens.scalar_type() == at::kLong &&
          visible.scalar_type() == at::kLong && block_tables.is_contiguous() && context_lens.is_contiguous() &&
          visible.is_contiguous() && block_tables.size(0) == q.size(0) && context_lens.dim() == 1 &&
          context_lens.size(0) == q.size(0) && visible.dim() == 1 && visible.size(0) == q.size(0) && q.device().is_cpu() &&
          k_pool.device().is_cpu() && v_pool.device().is_cpu() && block_tables.device().is_cpu() &&
          context_lens.device().is_cpu() && visible.device().is_cpu(),
      "minillm::paged_decode: q ", q.sizes(), ", k_pool ", k_pool.sizes(), " ", k_pool.scalar_type(), ", v_pool ",
      v_pool.sizes(), " ", v_pool.scalar_type(), ", block_tables ", block_tables.sizes(), " ", block_tables.scalar_type(),
      ", context_lens ", context_lens.sizes(), " ", context_lens.scalar_type(), ", visible ", visible.sizes(), " ",
      visible.scalar_type(),
      ": contiguous CPU pools of float32, bfloat16 or float16 and contiguous int64 tables, one row per query, are needed");
  const at::Tensor q32 = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(q32.sizes(), q32.options());
  paged_decode_kernels[which](q32.data_ptr<float>(), k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr<int64_t>(),
                              context_lens.data_ptr<int64_t>(), visible.data_ptr<int64_t>(), out.data_ptr<float>(),
                              q.size(0), q.size(1), k_pool.size(1), q.size(2), block_tables.size(1), block_size, window,
                              static_cast<float>(scale));
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

// x[M, K] · Wᵀ for packed[N/16, K/2, 16, 2]: the checks of cpu_bf16_rows.linear_bf16_rows.
at::Tensor linear_bf16_rows(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK_VALUE(x.dim() == 2 && packed.dim() == 4 && x.scalar_type() == at::kBFloat16 &&
                        packed.scalar_type() == at::kBFloat16 && packed.size(2) == 16 && packed.size(3) == 2 &&
                        x.size(1) == 2 * packed.size(1) && packed.is_contiguous() && x.device().is_cpu() &&
                        packed.device().is_cpu(),
                    "minillm::linear_bf16_rows: x ", x.sizes(), " ", x.scalar_type(), " on ", x.device(), ", packed ",
                    packed.sizes(), " ", packed.scalar_type(),
                    ": expected bf16 CPU x[M, K] and a contiguous packed[N/16, K/2, 16, 2] (cpu_bf16_rows.pack)");
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool can_run = __builtin_cpu_supports("avx512bf16");  // else it would die on the first instruction
  TORCH_CHECK(can_run, "minillm::linear_bf16_rows cannot run here: this CPU has no AVX-512 BF16");
#endif
  const at::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), n = packed.size(0) * 16;
  at::Tensor out = at::empty({m, n}, rows.options());
  if (m)
    linear_rows_kernel(static_cast<const uint16_t*>(rows.data_ptr()), static_cast<const uint16_t*>(packed.data_ptr()),
                       static_cast<uint16_t*>(out.data_ptr()), m, k, n);
  return out;
}

// Registers `kernel` for the CPU under `name`, once. 1: registered now; 0: already; -1: failed.
template <typename Fn>
int register_once(const char* name, bool& done, Fn kernel) {
  std::lock_guard<std::mutex> hold(registering);
  if (done) return 0;
  try {
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "minillm", c10::DispatchKey::CPU, __FILE__,
                                                    __LINE__);
    library->impl(name, kernel);
    registrations->push_back(std::move(library));
    done = true;
    return 1;
  } catch (const std::exception&) {
    return -1;
  }
}

bool paged_decode_registered = false, linear_rows_registered = false;

}  // namespace

// The kernels of attention/cpu_paged_decode.cpp, one per pool dtype (float32, bfloat16, float16).
extern "C" int minillm_register_paged_decode(void* float32, void* bfloat16, void* float16) {
  if (!float32 || !bfloat16 || !float16) return -1;
  {
    std::lock_guard<std::mutex> hold(registering);
    if (!paged_decode_registered) {
      paged_decode_kernels[0] = reinterpret_cast<PagedDecode>(float32);
      paged_decode_kernels[1] = reinterpret_cast<PagedDecode>(bfloat16);
      paged_decode_kernels[2] = reinterpret_cast<PagedDecode>(float16);
    }
  }
  return register_once("paged_decode", paged_decode_registered, TORCH_FN(paged_decode));
}

// The kernel of layers/cpu_bf16_rows.cpp; handed over only where it can run (cpu_bf16_rows.py
// registers it after unavailable_reason() found AVX-512 BF16 and a build).
extern "C" int minillm_register_linear_bf16_rows(void* kernel) {
  if (!kernel) return -1;
  {
    std::lock_guard<std::mutex> hold(registering);
    if (!linear_rows_registered) linear_rows_kernel = reinterpret_cast<LinearRows>(kernel);
  }
  return register_once("linear_bf16_rows", linear_rows_registered, TORCH_FN(linear_bf16_rows));
}
