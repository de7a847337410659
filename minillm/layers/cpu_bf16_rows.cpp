// A bf16 matrix product for a few rows, y[M, N] = x[M, K] · Wᵀ, on CPUs with AVX-512 BF16 and no
// AMX (AMD Zen 4 and later; Intel Cooper Lake). Compiled at first use by
// minillm/layers/cpu_bf16_rows.py with PyTorch's own C++ toolchain (minillm/native_build.py).
//
// Why: a decode step of a few rows (a speculative verify step: the last token and its k guesses;
// a batch of 8) must read every weight once, like a single row, and multiply it by each row. The
// compiled step's own GEMMs there either compute in fp32 (bf16 converted lane by lane, then one
// fused multiply-add per weight per row) or call oneDNN, whose small-M path reads the weights at
// half the machine's bandwidth. VDPBF16PS multiplies 32 bf16 pairs and adds them into 16 fp32
// sums in one instruction, straight from bf16: the row count costs little until it is ~8.
//
// Layout: the weight is packed once (in the graph, folded into a constant by the compiler) as
// packed[N/16][K/2][16][2]: for each block of 16 output columns, for each pair of inputs k, k+1,
// the 16 columns' two weights side by side — one 64-byte load per (column block, input pair),
// the operand VDPBF16PS wants. A row's pair x[m][k], x[m][k+1] is one 32-bit value, broadcast.
// Each task owns NT column blocks for all M rows (up to 12 at a time), so the weights stream from
// memory once and rows re-read them from the cache. NT follows M so that MB × NT accumulators and
// NT weight registers fit the 32 vector registers while each weight load feeds as many products
// as it can: NT = 4 up to 6 rows, 3 up to 8, 2 beyond (12 × 2). Sums are fp32, rounded to bf16
// once at the end (as PyTorch's bf16 matmul does).
//
// With 7 or more rows the products take about as long as reading the weights, and the hardware
// prefetcher alone left the two waiting on each other: the weights are prefetched PF bytes ahead
// of their use (at 1-6 rows it gained nothing in trials, so they do without). The two changes
// together, on an AMD EPYC Zen 4 with 2 cores: one step's products of SmolLM2-135M 1.02-1.16×
// faster at 1-16 rows, 14.9 → 13.0 ms at 11 (benchmarks/probe_bf16_tiles.py).

#include <immintrin.h>
#include <cstdint>
#include <cstring>

#define MINILLM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int MB, int NT, int PF>
MINILLM_BF16_TARGET static inline void rows_tile(const uint16_t* x, const uint16_t* packed, uint16_t* out,
                                                 int64_t K, int64_t N, int64_t n0) {
  __m512 acc[MB][NT];
  for (int m = 0; m < MB; m++)
    for (int t = 0; t < NT; t++) acc[m][t] = _mm512_setzero_ps();
  const int64_t block_stride = K * 16;  // bf16 values per block of 16 columns
  const uint16_t* w = packed + (n0 / 16) * block_stride;
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh b[NT];
    for (int t = 0; t < NT; t++) b[t] = (__m512bh)_mm512_loadu_si512(w + t * block_stride + k * 16);
    if constexpr (PF > 0)  // one 64-byte line per block per pair of inputs: one prefetch each
      for (int t = 0; t < NT; t++) _mm_prefetch(reinterpret_cast<const char*>(w + t * block_stride + k * 16) + PF, _MM_HINT_T0);
    for (int m = 0; m < MB; m++) {
      int32_t pair;  // x[m][k], x[m][k+1] as one 32-bit value (memcpy: any alignment, no aliasing)
      std::memcpy(&pair, x + m * K + k, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NT; t++) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], a, b[t]);
    }
  }
  for (int m = 0; m < MB; m++)
    for (int t = 0; t < NT; t++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + n0 + t * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][t]));
}

// Rows per pass over a task's weights: as many as leave registers for NT column blocks.
template <int NT>
constexpr int rows_per_pass() {
  return NT >= 4 ? 6 : NT == 3 ? 8 : 12;
}

// rows_tile for `rows` (1 … rows_per_pass<NT>()) rows, the tile's size a template argument.
template <int NT, int PF, int MB = 1>
static inline void tile_of(int64_t rows, const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t K,
                           int64_t N, int64_t n0) {
  if constexpr (MB < rows_per_pass<NT>()) {
    if (rows != MB) return tile_of<NT, PF, MB + 1>(rows, x, packed, out, K, N, n0);
  }
  rows_tile<MB, NT, PF>(x, packed, out, K, N, n0);
}

// All M rows of the NT column blocks from n0, a pass over the blocks' weights per rows_per_pass rows.
template <int NT, int PF>
static void column_blocks(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t M, int64_t K,
                          int64_t N, int64_t n0) {
  constexpr int64_t R = rows_per_pass<NT>();
  for (int64_t m0 = 0; m0 < M; m0 += R)
    tile_of<NT, PF>(M - m0 < R ? M - m0 : R, x + m0 * K, packed, out + m0 * N, K, N, n0);
}

// The M rows' products over every column block: NT blocks per task, and the blocks left over
// (N need not be a multiple of 16 × NT) one per task, in the same parallel loop.
template <int NT, int PF>
static void all_blocks(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / 16, full = blocks / NT, tasks = full + blocks % NT;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < tasks; p++) {
    if (p < full)
      column_blocks<NT, PF>(x, packed, out, M, K, N, p * 16 * NT);
    else
      column_blocks<1, PF>(x, packed, out, M, K, N, (full * NT + p - full) * 16);
  }
}

// x[M, K], packed[N/16][K/2][16][2], out[M, N]: bf16 as raw 16-bit values, contiguous. K even,
// N a multiple of 16 (the Python side checks both).
extern "C" void linear_bf16_rows(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t M, int64_t K,
                                 int64_t N) {
  if (M <= 6)
    all_blocks<4, 0>(x, packed, out, M, K, N);
  else if (M <= 8)
    all_blocks<3, 512>(x, packed, out, M, K, N);
  else
    all_blocks<2, 1024>(x, packed, out, M, K, N);
}
