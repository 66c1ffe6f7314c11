/* y = x @ W.T (+ bias) from bfloat16 x and W, for CPU: every projection of a bfloat16 model
 * (bfloat16 out, linear_bf16) and its LM head (float32 out, linear_bf16_f32).
 *
 * Why our own: at the row counts a decode step runs (1-64), oneDNN's prepacked bfloat16 matmul
 * reached ~20 GB/s of weights (10.2 ms for SmolLM2's 121 matmuls at 16 rows on a 2-core
 * AVX-512 BF16 EPYC) where the machine reads ~50; this kernel streams the weights with a
 * prefetch ahead of the dot products and does them in ~7 ms (docs/benchmarks.md, "CPU linear
 * layers by ISA and dtype").
 *
 * Why a float32-out head: logits rounded to bfloat16 (8 significant bits: steps of 0.125 at 20)
 * tie and reorder the top tokens; transformers' float32 greedy choice was kept for 7 of 12 test
 * prompts with bfloat16 logits and 11 of 12 with float32 ones (docs/benchmarks.md, "bfloat16
 * agreement"). Each product of two bfloat16 values is exact in float32, so this computes what a
 * float32 matmul of the widened operands would, without widening the 56 MB weight.
 *
 * Layout: W [n, k] is packed once (backend/model/cpu_linear.pack_pairs) into panels of NR = 16
 * output columns holding k in pairs, [ceil(n / 16)][ceil(k / 2)][16][2], zero-padded: the operand
 * layout of AVX512_BF16's dot product, which multiplies a pair of bfloat16 per 32-bit lane and
 * adds both products to a float32 accumulator. Up to 16 rows (decode steps of up to 16
 * sequences) a tile is all rows x 1 panel: the weight is read once, as one stream per thread,
 * with one accumulator per row. Beyond, a tile is MR rows x NP panels (8 x 48 columns): 24
 * accumulators, and per pair of k 3 weight loads and 8 broadcasts for 24 dot products, so the
 * loads keep up with the arithmetic; later row tiles read the panels from cache. (Measured on
 * the model's projections: at 16 rows 8.0 ms one tile x 1 panel, 8.8 ms tiles of 8 x 3; at 64
 * rows 22.5 ms 8 x 3, 28.1 ms 16 x 1, whose 17 loads per 16 dot products then bound it.)
 * Groups of panels are shared out to OpenMP threads (torch's pool) in contiguous ranges, so each
 * thread streams one stretch of the packed weight; the first row tile of a group prefetches
 * PREFETCH_LINES cache lines ahead in each panel (16 rows, 8 x 3 tiles: 8.6 -> 7.1 ms; the
 * hardware prefetcher alone does not keep three streams per core ahead). The distance covers the
 * memory latency at 16 rows, where a line of a panel (one pair of k) feeds 16 dot products, ~10
 * cycles: on the 2-core AVX512_BF16 EPYC the model's 121 matmuls at 16 rows took 7.9 ms 16 lines
 * ahead, 6.9 at 48, 6.6 at 64 and at 96; at 1 row 5.7-5.9 ms (the memory's pace) at every distance
 * (docs/benchmarks.md, "bfloat16: our AVX512_BF16 kernel").
 * Accumulation is float32 over the whole k loop; a bfloat16 output is rounded once, to nearest
 * even. x is read in pairs, so k must be even (the caller checks; every hidden size in use is).
 *
 * Built where the compiler targets AVX512_BF16 (-march=native on such a CPU); elsewhere
 * linear_bf16_supported() returns 0 and the engine uses oneDNN or F.linear.
 */
#include <stdint.h>
#include <string.h>

#define NR 16               /* output columns per packed panel (one 512-bit register of float32) */
#define MR 8                /* rows per tile, beyond ONE_TILE_ROWS rows */
#define NP 3                /* panels per tile, beyond ONE_TILE_ROWS rows */
#define ONE_TILE_ROWS 16    /* up to this many rows: one tile of all rows x one panel */
#define PREFETCH_LINES 64   /* how far ahead the first row tile prefetches, per panel */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int linear_bf16_supported(void) { return 1; }

/* Rows [0, mr) of x times np panels from `panel` (panel_stride elements apart) into columns
 * [0, ncols) of y: float32 (yf) or bfloat16 (yb), row stride ldy; bias: float32 or NULL. */
static inline __attribute__((always_inline)) void tile(const int mr, const int np, const int64_t pairs,
                                                       const uint16_t *restrict x, const int64_t ldx,
                                                       const uint16_t *restrict panel, const int64_t panel_stride,
                                                       const float *restrict bias, float *restrict yf,
                                                       uint16_t *restrict yb, const int64_t ldy, const int64_t ncols,
                                                       const int prefetch) {
    __m512 acc[ONE_TILE_ROWS][NP];   /* at most 16 x 1 or 8 x 3 of them are used (tile_any) */
    _Pragma("GCC unroll 16") for (int r = 0; r < mr; ++r)
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; ++kk) {
        __m512bh w[NP];
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
            const uint16_t *at = panel + p * panel_stride + kk * 2 * NR;
            w[p] = (__m512bh)_mm512_loadu_si512(at);
            if (prefetch) _mm_prefetch((const char *)(at + PREFETCH_LINES * 2 * NR), _MM_HINT_T0);
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < mr; ++r) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * kk, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xb, w[p]);
        }
    }
    _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
        const int64_t left = ncols - p * NR;
        const __mmask16 keep = left >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + p * NR) : _mm512_setzero_ps();
        _Pragma("GCC unroll 16") for (int r = 0; r < mr; ++r) {
            const __m512 out = _mm512_add_ps(acc[r][p], b);
            if (yb) _mm256_mask_storeu_epi16(yb + r * ldy + p * NR, keep, (__m256i)_mm512_cvtneps_pbh(out));
            else _mm512_mask_storeu_ps(yf + r * ldy + p * NR, keep, out);
        }
    }
}

/* One tile with mr and np as compile-time constants (the switch lets the compiler unroll). Only
 * one-panel tiles hold more than MR rows (the one-tile path up to ONE_TILE_ROWS); tiles of 2-3
 * panels have at most MR, so only those shapes are instantiated. */
static void tile_any(const int mr, const int np, const int64_t pairs, const uint16_t *x, const int64_t ldx,
                     const uint16_t *panel, const int64_t panel_stride, const float *bias, float *yf, uint16_t *yb,
                     const int64_t ldy, const int64_t ncols, const int prefetch) {
#define TILE(R, P) tile(R, P, pairs, x, ldx, panel, panel_stride, bias, yf, yb, ldy, ncols, prefetch)
#define ROWS_9_TO_16(P) case 16: TILE(16, P); break; case 15: TILE(15, P); break; case 14: TILE(14, P); break; \
                        case 13: TILE(13, P); break; case 12: TILE(12, P); break; case 11: TILE(11, P); break; \
                        case 10: TILE(10, P); break; case 9: TILE(9, P); break;
#define ROWS_1_TO_8(P) case 8: TILE(8, P); break; case 7: TILE(7, P); break; case 6: TILE(6, P); break; \
                       case 5: TILE(5, P); break; case 4: TILE(4, P); break; case 3: TILE(3, P); break; \
                       case 2: TILE(2, P); break; default: TILE(1, P); break;
    if (np == 3) {
        switch (mr) { ROWS_1_TO_8(3) }
    } else if (np == 2) {
        switch (mr) { ROWS_1_TO_8(2) }
    } else {
        switch (mr) { ROWS_9_TO_16(1) ROWS_1_TO_8(1) }
    }
#undef ROWS_1_TO_8
#undef ROWS_9_TO_16
#undef TILE
}

static void linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                   const float *bias, float *yf, uint16_t *yb, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, pairs = (k + 1) / 2, panel_stride = pairs * 2 * NR;
    const int one_tile = m <= ONE_TILE_ROWS;
    const int64_t group = one_tile ? 1 : NP, tile_rows = one_tile ? m : MR;
    const int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t p0 = g * group, column = p0 * NR;
        const int np = panels - p0 < group ? (int)(panels - p0) : (int)group;
        for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
            const int mr = m - r0 < tile_rows ? (int)(m - r0) : (int)tile_rows;
            const int64_t at = r0 * n + column;
            tile_any(mr, np, pairs, x + r0 * ldx, ldx, packed + p0 * panel_stride, panel_stride,
                     bias ? bias + column : NULL, yf ? yf + at : NULL, yb ? yb + at : NULL, n, n - column, r0 == 0);
        }
    }
}

/* x: [m, k] bfloat16, row stride ldx, k even; packed as above; y: [m, n] float32 contiguous. */
void linear_bf16_f32(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                     float *y, int num_threads) {
    linear(x, m, k, ldx, packed, n, NULL, y, NULL, num_threads);
}

/* The same with a bfloat16 y [m, n] contiguous, rounded once; bias: float32 [n] or NULL. */
void linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                 const float *bias, uint16_t *y, int num_threads) {
    linear(x, m, k, ldx, packed, n, bias, NULL, y, num_threads);
}

#else

int linear_bf16_supported(void) { return 0; }

void linear_bf16_f32(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                     float *y, int num_threads) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)y, (void)num_threads;
}

void linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                 const float *bias, uint16_t *y, int num_threads) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)y, (void)num_threads;
}

#endif
