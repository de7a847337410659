// Paged decode attention on CPU: one query token per sequence against its keys, read from the
// paged pool in place. Compiled at first use by minillm/attention/cpu_paged.py with PyTorch's own
// C++ toolchain (the one torch.compile's CPU code uses), which also provides the portable SIMD
// type at::vec::Vectorized (AVX2, AVX-512, NEON: whatever this CPU has).
//
// Why a kernel: the PyTorch reference gathers every row's blocks into a padded copy, upcasts it
// to fp32 and calls SDPA — three passes over the keys per layer, plus padding. Here each
// (sequence, KV head) task walks its own blocks once for K and once for V, converting as it loads,
// for exactly its own context (or the last `window` keys of it).
//
// Per task: the G query heads sharing the KV head (grouped-query attention) are scored against
// every key (K read once for all G), softmax in fp32, then the V rows are summed with those
// weights (V read once). Everything computes in fp32 whatever the pool stores.

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

template <typename T>
static inline Vec load_as_float(const T* p, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, count);
  } else {
    return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, count));
  }
}

// q[B, H, D] fp32; k_pool, v_pool[slots, KV, D]; block_tables[B, max_blocks]; context_lens[B];
// out[B, H, D] fp32. window <= 0: no sliding window.
template <typename T>
static void paged_decode(const float* q, const T* k_pool, const T* v_pool, const int64_t* block_tables,
                         const int64_t* context_lens, float* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                         int64_t max_blocks, int64_t block_size, int64_t window, float scale) {
  const int64_t G = H / KV, W = Vec::size(), chunks = (D + W - 1) / W;
#pragma omp parallel
  {
    std::vector<float> scores;      // [G, keys] of the current task
    std::vector<Vec> acc(G * chunks);  // [G, D] output accumulators
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KV; task++) {
      const int64_t b = task / KV, kv = task % KV, len = context_lens[b];
      const int64_t first = (window > 0 && len > window) ? len - window : 0, n = len - first;
      const int64_t* table = block_tables + b * max_blocks;
      const float* qg0 = q + (b * H + kv * G) * D;
      scores.resize(G * n);
      for (int64_t t = 0; t < n; t++) {  // scores = q · k for every key, K read once
        const int64_t pos = first + t, slot = table[pos / block_size] * block_size + pos % block_size;
        const T* key = k_pool + (slot * KV + kv) * D;
        for (int64_t g = 0; g < G; g++) {
          Vec dot(0.f);
          for (int64_t c = 0; c < chunks; c++) {
            const int64_t m = std::min(W, D - c * W);
            dot = at::vec::fmadd(Vec::loadu(qg0 + g * D + c * W, m), load_as_float(key + c * W, m), dot);
          }
          scores[g * n + t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, dot) * scale;
        }
      }
      for (int64_t g = 0; g < G; g++) {  // softmax over the keys, in place
        float* s = scores.data() + g * n;
        const float top = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp_u20(); }, s, s, n);
        const float inv = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, s, s, n);
        for (int64_t c = 0; c < chunks; c++) acc[g * chunks + c] = Vec(0.f);
      }
      for (int64_t t = 0; t < n; t++) {  // out = Σ p · v, V read once
        const int64_t pos = first + t, slot = table[pos / block_size] * block_size + pos % block_size;
        const T* value = v_pool + (slot * KV + kv) * D;
        for (int64_t c = 0; c < chunks; c++) {
          const Vec val = load_as_float(value + c * W, std::min(W, D - c * W));
          for (int64_t g = 0; g < G; g++) {
            acc[g * chunks + c] = at::vec::fmadd(Vec(scores[g * n + t]), val, acc[g * chunks + c]);
          }
        }
      }
      for (int64_t g = 0; g < G; g++) {
        for (int64_t c = 0; c < chunks; c++) {
          acc[g * chunks + c].store(out + (b * H + kv * G + g) * D + c * W, std::min(W, D - c * W));
        }
      }
    }
  }
}

#define MINILLM_PAGED_DECODE(NAME, T)                                                                          \
  extern "C" void NAME(const float* q, const T* k_pool, const T* v_pool, const int64_t* block_tables,         \
                       const int64_t* context_lens, float* out, int64_t B, int64_t H, int64_t KV, int64_t D, \
                       int64_t max_blocks, int64_t block_size, int64_t window, float scale) {                \
    paged_decode<T>(q, k_pool, v_pool, block_tables, context_lens, out, B, H, KV, D, max_blocks, block_size,  \
                    window, scale);                                                                           \
  }

MINILLM_PAGED_DECODE(paged_decode_float32, float)
MINILLM_PAGED_DECODE(paged_decode_bfloat16, at::BFloat16)
MINILLM_PAGED_DECODE(paged_decode_float16, at::Half)
