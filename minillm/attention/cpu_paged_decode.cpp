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
// Per task: each of the G query heads sharing the KV head (grouped-query attention) is scored
// against every key, softmax in fp32, then the V rows are summed with those weights. A task's
// keys come from memory once; the other heads of its group find them in the CPU's cache.
// Everything computes in fp32 whatever the pool stores.

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

using Vec = at::vec::Vectorized<float>;

// `count` values from p as fp32 lanes: a full vector straight from memory; a short last chunk
// (a head size that is not a multiple of the vector width) through a zeroed buffer, so the unused
// lanes are 0 whatever is in memory after the row.
template <typename T>
static inline Vec load_as_float(const T* p, int64_t count) {
  if (count == Vec::size()) {
    if constexpr (std::is_same_v<T, float>) {
      return Vec::loadu(p);
    } else {
      Vec out;
      at::vec::load_to_float(p, out);  // exactly one float vector's worth of 16-bit values
      return out;
    }
  }
  alignas(64) float buffer[Vec::size()] = {};
  for (int64_t i = 0; i < count; i++) buffer[i] = static_cast<float>(p[i]);
  return Vec::loadu(buffer);
}

// q[B, H, D] fp32; k_pool, v_pool[slots, KV, D]; block_tables[B, max_blocks]; context_lens[B];
// visible[B]: which of a row's last 63 keys it sees (bit j: the key j places before its own, so
// bit 0 is itself; keys further back are always seen; -1: every key, a plain causal row) — a
// speculative tree's node sees its ancestors, not its sibling branches (speculative/tree.py);
// out[B, H, D] fp32. window <= 0: no sliding window. CH: D / Vec::size() when the caller knows it
// at compile time (then the loops over a row unroll and q stays in registers); 0: any D.
template <typename T, int CH>
static void paged_decode(const float* q, const T* k_pool, const T* v_pool, const int64_t* block_tables,
                         const int64_t* context_lens, const int64_t* visible, float* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                         int64_t max_blocks, int64_t block_size, int64_t window, float scale) {
  const int64_t G = H / KV, W = Vec::size(), chunks = CH ? CH : (D + W - 1) / W;
  auto width = [&](int64_t c) { return CH ? W : std::min(W, D - c * W); };  // the last chunk may be short
#pragma omp parallel
  {
    std::vector<float> scores;  // [G, keys] of the current task
    std::vector<int64_t> rows;  // [keys]: where each key's row of this KV head starts in the pool
    std::vector<Vec> qv(chunks), acc(chunks);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * KV; task++) {
      const int64_t b = task / KV, kv = task % KV, len = context_lens[b], seen = visible[b];
      const int64_t first = (window > 0 && len > window) ? len - window : 0;
      const int64_t* table = block_tables + b * max_blocks;
      rows.resize(len - first);
      int64_t n = 0;
      for (int64_t t = first, block = first / block_size, offset = first % block_size; t < len; t++) {
        const int64_t back = len - 1 - t;  // keys before the row's own
        if (seen == -1 || back >= 63 || ((seen >> back) & 1)) rows[n++] = ((table[block] * block_size + offset) * KV + kv) * D;
        if (++offset == block_size) offset = 0, block++;
      }
      scores.resize(G * n);
      // One query head at a time: its row of q stays in registers while the keys stream by (the
      // task's keys are re-read from the CPU's cache for the next head of the group, not from memory).
      for (int64_t g = 0; g < G; g++) {
        const float* qg = q + (b * H + kv * G + g) * D;
        for (int64_t c = 0; c < chunks; c++) qv[c] = load_as_float(qg + c * W, width(c)) * Vec(scale);
        float* s = scores.data() + g * n;
        for (int64_t t = 0; t < n; t++) {
          const T* key = k_pool + rows[t];
          Vec dot(0.f);
          for (int64_t c = 0; c < chunks; c++) dot = at::vec::fmadd(qv[c], load_as_float(key + c * W, width(c)), dot);
          s[t] = dot.reduce_add();
        }
        // softmax over the keys, in place
        const float top = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, s, s, n);
        const float inv = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, s, s, n);
      }
      for (int64_t g = 0; g < G; g++) {  // out = Σ p · v
        const float* s = scores.data() + g * n;
        for (int64_t c = 0; c < chunks; c++) acc[c] = Vec(0.f);
        for (int64_t t = 0; t < n; t++) {
          const T* value = v_pool + rows[t];
          const Vec p(s[t]);
          for (int64_t c = 0; c < chunks; c++) acc[c] = at::vec::fmadd(p, load_as_float(value + c * W, width(c)), acc[c]);
        }
        float* o = out + (b * H + kv * G + g) * D;
        for (int64_t c = 0; c < chunks; c++) acc[c].store(o + c * W, width(c));
      }
    }
  }
}

// Head sizes that are 2, 4, 8 or 16 SIMD vectors (32-256 with AVX-512) get unrolled loops.
template <typename T>
static void paged_decode_any(const float* q, const T* k_pool, const T* v_pool, const int64_t* block_tables,
                             const int64_t* context_lens, const int64_t* visible, float* out, int64_t B, int64_t H, int64_t KV, int64_t D,
                             int64_t max_blocks, int64_t block_size, int64_t window, float scale) {
  const int64_t W = Vec::size(), chunks = D % W ? 0 : D / W;
  auto run = chunks == 2    ? paged_decode<T, 2>
             : chunks == 4  ? paged_decode<T, 4>
             : chunks == 8  ? paged_decode<T, 8>
             : chunks == 16 ? paged_decode<T, 16>
                            : paged_decode<T, 0>;
  run(q, k_pool, v_pool, block_tables, context_lens, visible, out, B, H, KV, D, max_blocks, block_size, window, scale);
}

#define MINILLM_PAGED_DECODE(NAME, T)                                                                          \
  extern "C" void NAME(const float* q, const T* k_pool, const T* v_pool, const int64_t* block_tables,         \
                       const int64_t* context_lens, const int64_t* visible, float* out, int64_t B, int64_t H, int64_t KV, int64_t D, \
                       int64_t max_blocks, int64_t block_size, int64_t window, float scale) {                \
    paged_decode_any<T>(q, k_pool, v_pool, block_tables, context_lens, visible, out, B, H, KV, D, max_blocks, block_size, \
                        window, scale);                                                                          \
  }

MINILLM_PAGED_DECODE(paged_decode_float32, float)
MINILLM_PAGED_DECODE(paged_decode_bfloat16, at::BFloat16)
MINILLM_PAGED_DECODE(paged_decode_float16, at::Half)
