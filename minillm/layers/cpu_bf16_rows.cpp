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
// Each task owns NT column blocks for all M rows (up to 12 at a time: 12 × 2 accumulators fit
// the 32 vector registers), so the weights stream from memory once and rows re-read them from
// the cache. Sums are fp32, rounded to bf16 once at the end (as PyTorch's bf16 matmul does).

#include <immintrin.h>
#include <cstdint>
#include <cstring>

#define MINILLM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int MB, int NT>
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

// All M rows of the NT column blocks from n0, up to 12 rows per pass over the blocks' weights.
template <int NT>
static void column_blocks(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t M, int64_t K,
                          int64_t N, int64_t n0) {
  for (int64_t m0 = 0; m0 < M; m0 += 12) {
    const uint16_t* xs = x + m0 * K;
    uint16_t* os = out + m0 * N;
    switch (M - m0 < 12 ? M - m0 : 12) {
      case 1: rows_tile<1, NT>(xs, packed, os, K, N, n0); break;
      case 2: rows_tile<2, NT>(xs, packed, os, K, N, n0); break;
      case 3: rows_tile<3, NT>(xs, packed, os, K, N, n0); break;
      case 4: rows_tile<4, NT>(xs, packed, os, K, N, n0); break;
      case 5: rows_tile<5, NT>(xs, packed, os, K, N, n0); break;
      case 6: rows_tile<6, NT>(xs, packed, os, K, N, n0); break;
      case 7: rows_tile<7, NT>(xs, packed, os, K, N, n0); break;
      case 8: rows_tile<8, NT>(xs, packed, os, K, N, n0); break;
      case 9: rows_tile<9, NT>(xs, packed, os, K, N, n0); break;
      case 10: rows_tile<10, NT>(xs, packed, os, K, N, n0); break;
      case 11: rows_tile<11, NT>(xs, packed, os, K, N, n0); break;
      default: rows_tile<12, NT>(xs, packed, os, K, N, n0); break;
    }
  }
}

// x[M, K], packed[N/16][K/2][16][2], out[M, N]: bf16 as raw 16-bit values, contiguous. K even,
// N a multiple of 16 (the Python side checks both).
extern "C" void linear_bf16_rows(const uint16_t* x, const uint16_t* packed, uint16_t* out, int64_t M, int64_t K,
                                 int64_t N) {
  constexpr int NT = 2;
  const int64_t pairs = N / (16 * NT);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; p++) column_blocks<NT>(x, packed, out, M, K, N, p * 16 * NT);
  if (N % (16 * NT)) column_blocks<1>(x, packed, out, M, K, N, pairs * 16 * NT);
}
