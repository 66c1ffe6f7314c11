/* y = x @ W.T in float32 from bfloat16 x and W, for CPU: the LM head of a bfloat16 engine.
 *
 * Why: logits rounded to bfloat16 (8 significant bits: steps of 0.125 at 20) tie and reorder
 * the top tokens; transformers' float32 greedy choice was kept for 7 of 12 test prompts with
 * bfloat16 logits and 11 of 12 with float32 ones (docs/benchmarks.md, "bfloat16 agreement").
 * Each product of two bfloat16 values is exact in float32, so this computes what a float32
 * matmul of the widened operands would, without widening the 56 MB weight to 113 MB.
 *
 * Layout: W [n, k] is packed once (backend/model/cpu_linear.py) into panels of NR = 16 output
 * columns holding k in pairs, [ceil(n / 16)][ceil(k / 2)][16][2], zero-padded: the operand
 * layout of AVX512_BF16's dot product, which multiplies a pair of bfloat16 per 32-bit lane
 * and adds both products to a float32 accumulator. A tile of MR rows x 16 columns keeps one
 * accumulator register per row over the whole k loop; panels are shared out to OpenMP
 * threads (torch's pool). x is read in pairs too, so k must be even (the caller checks;
 * every hidden size in use is).
 *
 * Against oneDNN's bfloat16-out matmul of the same weights (2-core AVX-512 BF16 EPYC): 0.80 vs
 * 0.93 ms at 1 row, 2.5 vs 1.6 ms at 16, 6.6 vs 4.4 at 64 (16-row tiles measured no faster);
 * the ~0.9 ms a 16-sequence step pays buys float32 logits.
 *
 * Built where the compiler targets AVX512_BF16 (-march=native on such a CPU); elsewhere
 * linear_bf16_supported() returns 0 and the engine keeps a float32 copy of the head.
 */
#include <stdint.h>
#include <string.h>

#define NR 16
#define MR 8

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int linear_bf16_supported(void) { return 1; }

static inline __attribute__((always_inline)) void tile(const int mr, int64_t pairs, const uint16_t *restrict x,
                                                       int64_t ldx, const uint16_t *restrict panel,
                                                       float *restrict y, int64_t ldy, int64_t ncols) {
    __m512 acc[MR];
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; ++kk) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + kk * 2 * NR);
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * kk, sizeof pair);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    if (ncols == NR) {
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
    } else {
        const __mmask16 keep = (__mmask16)((1u << ncols) - 1);
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
    }
}

/* x: [m, k] bfloat16, row stride ldx, k even; packed as above; y: [m, n] float32 contiguous. */
void linear_bf16_f32(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                     float *y, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, pairs = (k + 1) / 2;
#pragma omp parallel for schedule(guided) num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        const uint16_t *panel = packed + p * pairs * 2 * NR;
        const int64_t ncols = n - p * NR < NR ? n - p * NR : NR;
        for (int64_t r0 = 0; r0 < m; r0 += MR) {
            const uint16_t *xr = x + r0 * ldx;
            float *yr = y + r0 * n + p * NR;
            switch (m - r0 < MR ? m - r0 : MR) {
                case 8: tile(8, pairs, xr, ldx, panel, yr, n, ncols); break;
                case 7: tile(7, pairs, xr, ldx, panel, yr, n, ncols); break;
                case 6: tile(6, pairs, xr, ldx, panel, yr, n, ncols); break;
                case 5: tile(5, pairs, xr, ldx, panel, yr, n, ncols); break;
                case 4: tile(4, pairs, xr, ldx, panel, yr, n, ncols); break;
                case 3: tile(3, pairs, xr, ldx, panel, yr, n, ncols); break;
                case 2: tile(2, pairs, xr, ldx, panel, yr, n, ncols); break;
                default: tile(1, pairs, xr, ldx, panel, yr, n, ncols); break;
            }
        }
    }
}

#else

int linear_bf16_supported(void) { return 0; }

void linear_bf16_f32(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                     float *y, int num_threads) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)y, (void)num_threads;
}

#endif
