/* y = x @ W.T (+ bias) from bfloat16 x and W, for CPU: every projection of a bfloat16 model
 * (bfloat16 out, linear_bf16) and its LM head (float32 out, linear_bf16_f32).
 *
 * Why our own: at the row counts a decode step runs (1-64), oneDNN's prepacked bfloat16 matmul
 * read the weights well below the memory's bandwidth (SmolLM2's 121 matmuls at 16 rows); this
 * kernel streams the weights with a prefetch ahead of the dot products and does them in less
 * time (docs/benchmarks.md, "CPU linear layers by ISA and dtype").
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
 * the model's projections: at 16 rows one tile x 1 panel beat tiles of 8 x 3; at 64 rows 8 x 3
 * beat 16 x 1, whose 17 loads per 16 dot products then bound it.)
 * Groups of panels are shared out to OpenMP threads (torch's pool) in contiguous ranges, so each
 * thread streams one stretch of the packed weight; the first row tile of a group prefetches
 * PREFETCH_LINES cache lines ahead in each panel (faster at 16 rows in 8 x 3 tiles; the
 * hardware prefetcher alone does not keep three streams per core ahead). The distance covers the
 * memory latency at 16 rows, where a line of a panel (one pair of k) feeds 16 dot products, ~10
 * cycles: at 16 rows the model's 121 matmuls got faster from 16 lines ahead to 64, and no faster
 * at 96; at 1 row they ran at the memory's pace at every distance (docs/benchmarks.md, "bfloat16:
 * our AVX512_BF16 kernel").
 * Accumulation is float32 over the whole k loop; a bfloat16 output is rounded once, to nearest
 * even. x is read in pairs, so k must be even (the caller checks; every hidden size in use is).
 *
 * Built where the compiler targets AVX512_BF16 (-march=native on such a CPU). Elsewhere, with AVX2
 * and FMA, the same functions widen the packed bfloat16 to float32 in registers (below: the
 * version for CPUs without bfloat16 arithmetic). Where the compiler also targets AMX, calls of 2
 * rows and more run on AMX tiles (the last section). linear_bf16_isa() says which version was
 * built: 3 (AMX), 2, 1, or 0 without AVX2, where the engine uses oneDNN or F.linear.
 * Each function returns 0, or -1 when its scratch memory could not be had (or nothing was built).
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

#define NR 16               /* output columns per packed panel (one 512-bit register of float32) */
#define MR 8                /* rows per tile, beyond ONE_TILE_ROWS rows */
#define NP 3                /* panels per tile, beyond ONE_TILE_ROWS rows */
#define ONE_TILE_ROWS 16    /* up to this many rows: one tile of all rows x one panel */
#define PREFETCH_LINES 64   /* how far ahead the first row tile prefetches, per panel */

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define LINEAR_BF16_BASE_ISA 2

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

/* Panels per group and rows per tile for m rows (the blocking described at the top). */
static int64_t panel_group(const int64_t m) { return m <= ONE_TILE_ROWS ? 1 : NP; }

/* Rows [0, m) times panels [p0, p1) into y (row stride ldy), on the calling thread. */
static int panel_range(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       const float *bias, int64_t p0, int64_t p1, float *yf, uint16_t *yb, int64_t ldy) {
    const int64_t pairs = (k + 1) / 2, panel_stride = pairs * 2 * NR;
    const int64_t group = panel_group(m), tile_rows = m <= ONE_TILE_ROWS ? m : MR;
    for (int64_t q = p0; q < p1; q += group) {
        const int np = p1 - q < group ? (int)(p1 - q) : (int)group;
        const int64_t column = q * NR;
        for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
            const int mr = m - r0 < tile_rows ? (int)(m - r0) : (int)tile_rows;
            const int64_t at = r0 * ldy + column;
            tile_any(mr, np, pairs, x + r0 * ldx, ldx, packed + q * panel_stride, panel_stride,
                     bias ? bias + column : NULL, yf ? yf + at : NULL, yb ? yb + at : NULL, ldy, n - column, r0 == 0);
        }
    }
    return 0;
}

static int linear_base(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       const float *bias, float *yf, uint16_t *yb, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, group = panel_group(m), groups = (panels + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t p0 = g * group, p1 = p0 + group < panels ? p0 + group : panels;
        panel_range(x, m, k, ldx, packed, n, bias, p0, p1, yf, yb, n);
    }
    return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
/* Without AVX512_BF16 (AVX2 CPUs, AVX-512 ones without BF16): the same packed weight, widened to
 * float32 in registers. A packed pair of k is one 32-bit lane per column, the even k in its low
 * half: the lane shifted left by 16 is that bfloat16 as a float32, the lane with its low half
 * cleared is the odd one (both exact). So a 256-bit load of a pair gives 8 columns of two k as
 * float32 for 2 ALU operations, and the products are FMAs of float32 values that are exactly the
 * operands' (the same products as the dot product's; sums in float32, another order). x is
 * widened once per call into a float32 copy (rows x k, a small share of the matmul's work), so a
 * row's pair is two broadcast loads. A tile is AVX2_MR rows x 16 columns: 2 * AVX2_MR accumulators,
 * the two widened halves of a pair (4 registers) and a broadcast in the 16 ymm registers. The
 * weight stays where it is read from DRAM once: half float32's bytes (docs/benchmarks.md, "bfloat16
 * on AVX2"). Rows are taken AVX2_MC at a time, so a prefill's widened rows stay in L2 while the
 * panels pass; at decode row counts a panel's k goes in blocks, as in linear_f32.c. */
#include <immintrin.h>
#include <stdlib.h>

#ifndef AVX2_MR
#define AVX2_MR 4    /* rows per tile (at most 6; -DAVX2_MR=... to measure another) */
#endif
#define AVX2_MC 48
/* Pairs per k block at decode row counts (64 k: 2 KB of a panel), and up to how many rows k is
 * blocked, as in linear_f32.c (docs/benchmarks.md). */
#ifndef AVX2_KB
#define AVX2_KB 32
#endif
#ifndef AVX2_BLOCK_MAX_ROWS
#define AVX2_BLOCK_MAX_ROWS 32
#endif

#define LINEAR_BF16_BASE_ISA 1

/* mr rows (<= 6) of the widened x times one panel over pairs [p0, p1). The sums start at zero
 * when p0 is 0, else from ``sums`` (mr rows of NR floats), where they are left. A line of
 * ``prefetch`` (or none: NULL) is requested per pair. */
static inline __attribute__((always_inline)) void tile(const int mr, const int64_t p0, const int64_t p1,
                                                       const float *restrict x, const int64_t ldx,
                                                       const uint16_t *restrict panel, float *restrict sums,
                                                       const uint16_t *prefetch) {
    __m256 lo[6], hi[6];
    _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
        lo[r] = p0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(sums + r * NR);
        hi[r] = p0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(sums + r * NR + 8);
    }
    const __m256i odd_half = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t kk = p0; kk < p1; ++kk) {
        const uint16_t *at = panel + kk * 2 * NR;
        if (prefetch != NULL) _mm_prefetch((const char *)(prefetch + (kk - p0) * 2 * NR), _MM_HINT_T0);
        const __m256i cols_lo = _mm256_loadu_si256((const __m256i *)at);
        const __m256i cols_hi = _mm256_loadu_si256((const __m256i *)(at + NR));
        const __m256 even_lo = _mm256_castsi256_ps(_mm256_slli_epi32(cols_lo, 16));
        const __m256 even_hi = _mm256_castsi256_ps(_mm256_slli_epi32(cols_hi, 16));
        const __m256 odd_lo = _mm256_castsi256_ps(_mm256_and_si256(cols_lo, odd_half));
        const __m256 odd_hi = _mm256_castsi256_ps(_mm256_and_si256(cols_hi, odd_half));
        /* Every row's even k, then every row's odd k: an accumulator's two FMAs of a pair are a
         * row tile's worth of FMAs apart, which covers the FMA's latency. */
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + 2 * kk);
            lo[r] = _mm256_fmadd_ps(xv, even_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, even_hi, hi[r]);
        }
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + 2 * kk + 1);
            lo[r] = _mm256_fmadd_ps(xv, odd_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, odd_hi, hi[r]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
        _mm256_store_ps(sums + r * NR, lo[r]);
        _mm256_store_ps(sums + r * NR + 8, hi[r]);
    }
}

/* mc (<= AVX2_MC) widened rows times one panel into ncols (<= NR) columns of yf or yb (+ bias).
 * At decode row counts the pairs go in blocks of AVX2_KB, every row tile over a block before the
 * next, the second tile requesting the next block's lines: the weights stream through the whole
 * panel's compute (as in linear_f32.c); above AVX2_BLOCK_MAX_ROWS, whole-k tiles. ``next``: the
 * lines to request after the last block (the next panel's first block), or NULL. */
static void panel_rows(const int64_t mc, const int64_t pairs, const float *restrict x, const int64_t ldx,
                       const uint16_t *restrict panel, const uint16_t *next, const float *restrict bias,
                       float *restrict yf, uint16_t *restrict yb, const int64_t ldy, const int64_t ncols) {
    float sums[AVX2_MC * NR] __attribute__((aligned(32)));
    if (pairs == 0) memset(sums, 0, sizeof(sums));  /* no block runs: the sums are empty */
    const int64_t block = mc <= AVX2_BLOCK_MAX_ROWS ? AVX2_KB : pairs;
    for (int64_t p0 = 0; p0 < pairs; p0 += block) {
        const int64_t p1 = pairs - p0 < block ? pairs : p0 + block;
        const uint16_t *ahead = p1 < pairs ? panel + p1 * 2 * NR : next;
        for (int64_t r0 = 0, t = 0; r0 < mc; r0 += AVX2_MR, ++t) {
            const float *xr = x + r0 * ldx;
            const uint16_t *pf = t == 1 ? ahead : NULL;
            float *sr = sums + r0 * NR;
            switch (mc - r0 < AVX2_MR ? mc - r0 : AVX2_MR) {
                case 6: tile(6, p0, p1, xr, ldx, panel, sr, pf); break;
                case 5: tile(5, p0, p1, xr, ldx, panel, sr, pf); break;
                case 4: tile(4, p0, p1, xr, ldx, panel, sr, pf); break;
                case 3: tile(3, p0, p1, xr, ldx, panel, sr, pf); break;
                case 2: tile(2, p0, p1, xr, ldx, panel, sr, pf); break;
                default: tile(1, p0, p1, xr, ldx, panel, sr, pf); break;
            }
        }
    }
    for (int64_t r = 0; r < mc; ++r)
        for (int64_t c = 0; c < ncols; ++c) {
            const float out = sums[r * NR + c] + (bias ? bias[c] : 0.0f);
            if (yb) yb[r * ldy + c] = f32_to_bf16(out);
            else yf[r * ldy + c] = out;
        }
}

static int linear_base(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       const float *bias, float *yf, uint16_t *yb, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR, pairs = (k + 1) / 2, panel_stride = pairs * 2 * NR;
    float *wide = malloc(sizeof(float) * (size_t)(m * pairs * 2));
    if (wide == NULL) return -1;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < k; ++c) wide[r * pairs * 2 + c] = bf16_to_f32(x[r * ldx + c]);
        for (int64_t m0 = 0; m0 < m; m0 += AVX2_MC) {
            const int64_t mc = m - m0 < AVX2_MC ? m - m0 : AVX2_MC;
            /* guided and nowait as in linear_f32.c (a preempted thread; disjoint rows). */
#pragma omp for schedule(guided) nowait
            for (int64_t p = 0; p < panels; ++p) {
                const uint16_t *panel = packed + p * panel_stride;
                const int64_t column = p * NR, at = m0 * n + column;
                panel_rows(mc, pairs, wide + m0 * pairs * 2, pairs * 2, panel,
                           p + 1 < panels ? panel + panel_stride : NULL, bias ? bias + column : NULL,
                           yf ? yf + at : NULL, yb ? yb + at : NULL, n, n - column < NR ? n - column : NR);
            }
        }
    }
    free(wide);
    return 0;
}

/* Rows [0, m) times panels [p0, p1) into y (row stride ldy), on the calling thread: the rows
 * widened for this call alone. */
static int panel_range(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       const float *bias, int64_t p0, int64_t p1, float *yf, uint16_t *yb, int64_t ldy) {
    const int64_t pairs = (k + 1) / 2, panel_stride = pairs * 2 * NR;
    float *wide = malloc(sizeof(float) * (size_t)(m * pairs * 2 + 1));
    if (wide == NULL) return -1;
    for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < k; ++c) wide[r * pairs * 2 + c] = bf16_to_f32(x[r * ldx + c]);
    for (int64_t m0 = 0; m0 < m; m0 += AVX2_MC) {
        const int64_t mc = m - m0 < AVX2_MC ? m - m0 : AVX2_MC;
        for (int64_t p = p0; p < p1; ++p) {
            const uint16_t *panel = packed + p * panel_stride;
            const int64_t column = p * NR, at = m0 * ldy + column;
            panel_rows(mc, pairs, wide + m0 * pairs * 2, pairs * 2, panel, p + 1 < p1 ? panel + panel_stride : NULL,
                       bias ? bias + column : NULL, yf ? yf + at : NULL, yb ? yb + at : NULL, ldy,
                       n - column < NR ? n - column : NR);
        }
    }
    free(wide);
    return 0;
}
#else

#define LINEAR_BF16_BASE_ISA 0

static int panel_range(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       const float *bias, int64_t p0, int64_t p1, float *yf, uint16_t *yb, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)p0, (void)p1, (void)yf, (void)yb;
    (void)ldy;
    return -1;
}

static int linear_base(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       const float *bias, float *yf, uint16_t *yb, int num_threads) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)yf, (void)yb, (void)num_threads;
    return -1;
}

#endif

/* Float32 FMAs over the same packed weight, for prompt-sized calls (many rows) on AVX-512F CPUs.
 * Why: on some CPUs vdpbf16ps is the slower instruction. On the 2-core Emerald Rapids Xeon the
 * dot products peak at 183 GFLOP/s and 512-bit float32 FMAs at 358 (docs/benchmarks.md, "Prompt
 * attention on the Intel Xeon"), so a prefill's projections, which are compute-bound, ran at
 * the dot products' ceiling. Decode (a few rows) streams the weight from memory: bfloat16 is what
 * makes it fast, so this runs only from fma_min_rows rows (linear_bf16_use_fma), which the engine
 * sets from a timing of both on the model's shapes at start-up (backend/model/cpu_linear_tuning.py),
 * and is off (0) until then.
 * The weight stays bfloat16 and packed as above; a 512-bit load of a pair of k gives 16 columns,
 * widened in registers as the AVX2 version does (the lane shifted left by 16 is the even k, the
 * lane with its low half cleared the odd one; both exact). x is widened once per call into a
 * float32 copy, k-major within each tile of rows (x[tile][k][FMA_MR]), so a row's k is one
 * broadcast at a fixed offset from one pointer (with a row stride, the 8 rows' pointers did not
 * fit the general registers and spilled). A tile is FMA_MR rows x FMA_NP panels (8 x 48 columns):
 * 24 accumulators, 3 widened weights and a broadcast of the 32 zmm registers. Widening in
 * registers costs, per pair of k, 3 weight loads and 6 ALU operations (on the FMAs' ports) for
 * 48 FMAs; so where a row block has FMA_WIDE_MIN_TILES tiles or more, each thread first widens
 * its panel group to float32 once (fma_widen_group) and the tiles only load and multiply
 * (fma_tile_wide; FMA_WIDE_PANELS=0 builds without it). The odd k of a pair is added
 * first, then the even one: the order of Intel's pseudocode for vdpbf16ps, whose two additions
 * are each rounded as an FMA's, so the sums can be the dot products' bit for bit (they were on
 * the Emerald Rapids Xeon: tests/test_linear_fma.py prints it), denormals apart, which vdpbf16ps
 * flushes to zero. Groups of panels go to the threads in contiguous ranges, as
 * in the dot-product version; rows go in blocks whose widened copy fits FMA_X_BYTES (in L2 while
 * a thread's panels pass). Where there are fewer groups than threads, the threads split the rows.
 * Measured there (benchmarks/cpu_linear.py --per-shape, SmolLM2-135M's projections, 2 threads):
 * ~300 GFLOP/s at 64 and 512 rows against the dot products' ~190 (the group widened once:
 * docs/benchmarks.md, "Where a long prompt's prefill goes").
 * Built where the compiler targets AVX-512F (with the AVX512_BF16 version, or the AVX2 one on
 * AVX-512 CPUs without BF16); elsewhere linear_bf16_use_fma answers 0 and nothing changes. */
#if LINEAR_BF16_BASE_ISA >= 1 && defined(__AVX512F__)
#define FMA_PATH 1
#include <immintrin.h>
#include <stdlib.h>

#define FMA_MR 8                  /* rows per tile */
#define FMA_NP 3                  /* panels per tile */
/* Calls TILE(R, P), defined by the caller, with mr and np as constants (1-8 rows, 1-3 panels):
 * each (rows, panels) pair its own fully unrolled tile. */
#define FMA_ROWS_1_TO_8(P) case 8: TILE(8, P); break; case 7: TILE(7, P); break; case 6: TILE(6, P); break; \
                           case 5: TILE(5, P); break; case 4: TILE(4, P); break; case 3: TILE(3, P); break; \
                           case 2: TILE(2, P); break; default: TILE(1, P); break;
#define FMA_TILE_DISPATCH(mr, np) \
    if ((np) == 3) {                          \
        switch (mr) { FMA_ROWS_1_TO_8(3) }    \
    } else if ((np) == 2) {                   \
        switch (mr) { FMA_ROWS_1_TO_8(2) }    \
    } else {                                  \
        switch (mr) { FMA_ROWS_1_TO_8(1) }    \
    }
#ifndef FMA_X_BYTES
#define FMA_X_BYTES (1 << 20)     /* a row block's widened x, at most (bytes; -DFMA_X_BYTES=... to measure) */
#endif
#ifndef FMA_WIDE_PANELS
#define FMA_WIDE_PANELS 1         /* a panel group widened to float32 once per row block (below) */
#endif
#ifndef FMA_WIDE_MIN_TILES
#define FMA_WIDE_MIN_TILES 4      /* ... where the block has at least this many row tiles */
#endif
#ifndef LINEAR_BF16_FMA_ROWS
#define LINEAR_BF16_FMA_ROWS 0    /* fma_min_rows at load (0: off; -D...=1 builds for benchmarks) */
#endif

/* 16 float32 rounded to bfloat16 (to nearest even, NaN to 0x7FC0): f32_to_bf16's bits. */
static inline __m256i fma_to_bf16(const __m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);     /* the dot-product version's rounding */
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
#endif
}

/* Rows [0, mr) of a tile of the widened x (k-major: x[c * FMA_MR + r] is row r's k c) times np
 * panels from `panel` into columns [0, ncols) of y, as tile() above. prefetch: request lines
 * PREFETCH_LINES pairs ahead. */
static inline __attribute__((always_inline)) void fma_tile(const int mr, const int np, const int64_t pairs,
                                                           const float *restrict x,
                                                           const uint16_t *restrict panel,
                                                           const int64_t panel_stride, const float *restrict bias,
                                                           float *restrict yf, uint16_t *restrict yb,
                                                           const int64_t ldy, const int64_t ncols, const int prefetch) {
    __m512 acc[FMA_MR][FMA_NP];
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r)
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_setzero_ps();
    const __m512i odd_half = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t kk = 0; kk < pairs; ++kk) {
        __m512 w[FMA_NP];
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
            const uint16_t *at = panel + p * panel_stride + kk * 2 * NR;
            if (prefetch) _mm_prefetch((const char *)(at + PREFETCH_LINES * 2 * NR), _MM_HINT_T0);
            w[p] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(at), odd_half));
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 xv = _mm512_set1_ps(x[(2 * kk + 1) * FMA_MR + r]);
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
        }
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
            const __m512i pair = _mm512_loadu_si512(panel + p * panel_stride + kk * 2 * NR);
            w[p] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 xv = _mm512_set1_ps(x[2 * kk * FMA_MR + r]);
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
        }
    }
    _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
        const int64_t left = ncols - p * NR;
        const __mmask16 keep = left >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + p * NR) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 out = _mm512_add_ps(acc[r][p], b);
            if (yb) _mm256_mask_storeu_epi16(yb + r * ldy + p * NR, keep, fma_to_bf16(out));
            else _mm512_mask_storeu_ps(yf + r * ldy + p * NR, keep, out);
        }
    }
}

/* A panel group (np <= FMA_NP panels of 16 columns) widened to float32 once, for every row tile
 * of a block: per pair of k, the odd k's FMA_NP vectors, then the even k's (wt[(2 * kk + odd?0:1)
 * * FMA_NP * NR + p * NR]). The tile then loads float32 weights and does no widening of its own:
 * per pair 6 loads and 48 FMAs instead of 3 loads, 6 ALU operations and 48 FMAs, the ALU
 * operations competing with the FMAs for the same two ports. Same products, same order of
 * additions: the same sums bit for bit. */
static void fma_widen_group(const int np, const int64_t pairs, const uint16_t *restrict panel,
                            const int64_t panel_stride, float *restrict wt) {
    const __m512i odd_half = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t kk = 0; kk < pairs; ++kk) {
        float *to = wt + kk * 2 * FMA_NP * NR;
        for (int p = 0; p < FMA_NP; ++p) {
            if (p < np) {
                const __m512i pair = _mm512_loadu_si512(panel + p * panel_stride + kk * 2 * NR);
                _mm512_store_ps(to + p * NR, _mm512_castsi512_ps(_mm512_and_si512(pair, odd_half)));
                _mm512_store_ps(to + (FMA_NP + p) * NR, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
            } else {
                _mm512_store_ps(to + p * NR, _mm512_setzero_ps());
                _mm512_store_ps(to + (FMA_NP + p) * NR, _mm512_setzero_ps());
            }
        }
    }
}

/* fma_tile over a widened panel group (fma_widen_group). */
static inline __attribute__((always_inline)) void fma_tile_wide(const int mr, const int np, const int64_t pairs,
                                                                const float *restrict x, const float *restrict wt,
                                                                const float *restrict bias, float *restrict yf,
                                                                uint16_t *restrict yb, const int64_t ldy,
                                                                const int64_t ncols) {
    __m512 acc[FMA_MR][FMA_NP];
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r)
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; ++kk) {
        const float *w_at = wt + kk * 2 * FMA_NP * NR;
        __m512 w[FMA_NP];
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) w[p] = _mm512_load_ps(w_at + p * NR);
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 xv = _mm512_set1_ps(x[(2 * kk + 1) * FMA_MR + r]);
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
        }
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) w[p] = _mm512_load_ps(w_at + (FMA_NP + p) * NR);
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 xv = _mm512_set1_ps(x[2 * kk * FMA_MR + r]);
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
        }
    }
    _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
        const int64_t left = ncols - p * NR;
        const __mmask16 keep = left >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + p * NR) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 out = _mm512_add_ps(acc[r][p], b);
            if (yb) _mm256_mask_storeu_epi16(yb + r * ldy + p * NR, keep, fma_to_bf16(out));
            else _mm512_mask_storeu_ps(yf + r * ldy + p * NR, keep, out);
        }
    }
}

static void fma_tile_wide_any(const int mr, const int np, const int64_t pairs, const float *x, const float *wt,
                              const float *bias, float *yf, uint16_t *yb, const int64_t ldy, const int64_t ncols) {
#define TILE(R, P) fma_tile_wide(R, P, pairs, x, wt, bias, yf, yb, ldy, ncols)
    FMA_TILE_DISPATCH(mr, np)
#undef TILE
}

static void fma_tile_any(const int mr, const int np, const int64_t pairs, const float *x, const uint16_t *panel,
                         const int64_t panel_stride, const float *bias, float *yf, uint16_t *yb, const int64_t ldy,
                         const int64_t ncols, const int prefetch) {
#define TILE(R, P) fma_tile(R, P, pairs, x, panel, panel_stride, bias, yf, yb, ldy, ncols, prefetch)
    FMA_TILE_DISPATCH(mr, np)
#undef TILE
}

/* Rows [r0, r1) (r0 a multiple of FMA_MR) of the widened x, in tiles of FMA_MR rows of
 * 2 * pairs k each, times panel groups [g0, g1) into y. ``wt``: a thread's scratch for a widened
 * panel group (fma_widen_group), used where the block has FMA_WIDE_MIN_TILES tiles or more;
 * NULL: the tiles widen the weights in registers. */
static void fma_block(const float *wide, const int64_t r0, const int64_t r1, const int64_t g0, const int64_t g1,
                      const int64_t pairs, const uint16_t *packed, const int64_t n, const float *bias, float *yf,
                      uint16_t *yb, float *wt) {
    const int64_t panels = (n + NR - 1) / NR, panel_stride = pairs * 2 * NR;
    const int use_wt = wt != NULL && (r1 - r0) >= FMA_WIDE_MIN_TILES * FMA_MR;
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t q = g * FMA_NP, column = q * NR;
        const int np = panels - q < FMA_NP ? (int)(panels - q) : FMA_NP;
        if (use_wt) fma_widen_group(np, pairs, packed + q * panel_stride, panel_stride, wt);
        for (int64_t r = r0; r < r1; r += FMA_MR) {
            const int mr = r1 - r < FMA_MR ? (int)(r1 - r) : FMA_MR;
            const int64_t at = r * n + column;
            if (use_wt)
                fma_tile_wide_any(mr, np, pairs, wide + r * pairs * 2, wt, bias ? bias + column : NULL,
                                  yf ? yf + at : NULL, yb ? yb + at : NULL, n, n - column);
            else
                fma_tile_any(mr, np, pairs, wide + r * pairs * 2, packed + q * panel_stride, panel_stride,
                             bias ? bias + column : NULL, yf ? yf + at : NULL, yb ? yb + at : NULL, n, n - column,
                             r == r0);
        }
    }
}

/* Rows per block for m rows whose converted copy takes row_bytes each: as many as FMA_X_BYTES
 * holds (whole tiles), in blocks of equal size (no short last block that would stream the panels
 * again for a few rows). */
static int64_t fma_row_block(const int64_t m, const int64_t row_bytes) {
    int64_t block = FMA_X_BYTES / (row_bytes > 0 ? row_bytes : 1) / FMA_MR * FMA_MR;
    if (block < FMA_MR) block = FMA_MR;
    const int64_t blocks = (m + block - 1) / block;
    if (blocks > 1) block = ((m + blocks - 1) / blocks + FMA_MR - 1) / FMA_MR * FMA_MR;
    return block;
}

static int linear_fma(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                      const float *bias, float *yf, uint16_t *yb, int num_threads) {
    const int64_t pairs = (k + 1) / 2, panels = (n + NR - 1) / NR, groups = (panels + FMA_NP - 1) / FMA_NP;
    const int threads = num_threads > 0 ? num_threads : 1;
    const int64_t tiles = (m + FMA_MR - 1) / FMA_MR;
    float *wide = malloc(sizeof(float) * (size_t)(tiles * FMA_MR * pairs * 2 + 1));
    if (wide == NULL) return -1;
    const int64_t block = fma_row_block(m, (int64_t)sizeof(float) * 2 * pairs);
#pragma omp parallel num_threads(threads)
    {
        /* this thread's widened panel group (fma_block), where the row blocks are tall enough */
        float *wt = NULL;
        if (FMA_WIDE_PANELS && groups >= threads && block >= FMA_WIDE_MIN_TILES * FMA_MR)
            wt = aligned_alloc(64, sizeof(float) * (size_t)(pairs * 2 * FMA_NP * NR));
        /* x widened tile by tile, k-major within a tile (a pair's broadcasts at fixed offsets from
         * one pointer); the last tile's missing rows are zeros. */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            float *to = wide + t * FMA_MR * pairs * 2;
            const int rows = m - t * FMA_MR < FMA_MR ? (int)(m - t * FMA_MR) : FMA_MR;
            const uint16_t *from = x + t * FMA_MR * ldx;
            for (int64_t c = 0; c < 2 * pairs; ++c, to += FMA_MR)
                for (int r = 0; r < FMA_MR; ++r) to[r] = r < rows && c < k ? bf16_to_f32(from[r * ldx + c]) : 0.0f;
        }
        if (groups >= threads) {
            /* Each thread the same groups in every row block (static schedule, same count), so
             * the blocks need no barrier between them: its panels stay in its cache. */
            for (int64_t r0 = 0; r0 < m; r0 += block) {
                const int64_t r1 = m - r0 < block ? m : r0 + block;
#pragma omp for schedule(static) nowait
                for (int64_t g = 0; g < groups; ++g)
                    fma_block(wide, r0, r1, g, g + 1, pairs, packed, n, bias, yf, yb, wt);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; ++t) {
                const int64_t r0 = t * FMA_MR, r1 = m - r0 < FMA_MR ? m : r0 + FMA_MR;
                fma_block(wide, r0, r1, 0, groups, pairs, packed, n, bias, yf, yb, NULL);
            }
        }
        free(wt);
    }
    free(wide);
    return 0;
}
#endif

/* Float16 FMAs over the same packed weight (AVX512-FP16 builds; from fp16_min_rows rows, which the
 * engine times at start-up against the float32 FMAs and the dot products; -DLINEAR_BF16_FP16_ROWS=N
 * sets it at load for benchmarks/cpu_linear.py --variant). Why: on the Emerald Rapids Xeon a
 * 512-bit float16 FMA issues as often as a float32 one and does twice the products. A thread
 * narrows its panel group to float16 once per row block (a pair of k per 32-bit lane, the even k
 * in the low half, as packed); x is scaled per row by a power of 2 to a largest magnitude under 1
 * and narrowed once per call, k-major per tile of rows, a pair per 32-bit lane; a broadcast of a
 * row's pair times the narrowed panel gives each lane one k's product. The lanes accumulate in
 * float16 over FP16_KC pairs, then are added into float32 partial sums; the even and odd lanes of
 * a column are added at the end and the row's scale undone. Range: with weights under 1024 in
 * magnitude (the engine checks) a float16 partial sum stays under 32 x 1024. A float32 output
 * asked for the logits' sake (linear_bf16_logits) never runs it. */
#if defined(FMA_PATH) && defined(__AVX512FP16__)
#define FP16_PATH 1
#ifndef FP16_KC
#define FP16_KC 32                /* pairs of k accumulated in float16 before the float32 sums */
#endif
#ifndef LINEAR_BF16_FP16_ROWS
#define LINEAR_BF16_FP16_ROWS 0   /* fp16_min_rows at load (0: off) */
#endif

static inline uint16_t fp16_bits(const float value) {
    const _Float16 h = (_Float16)value;
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
}

/* A panel group narrowed to float16: wh[(kk * FMA_NP + p) * NR + c] is column c's pair kk of
 * panel p (zeros past np). */
static void fp16_narrow_group(const int np, const int64_t pairs, const uint16_t *restrict panel,
                              const int64_t panel_stride, uint32_t *restrict wh) {
    const __m512i odd_half = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t kk = 0; kk < pairs; ++kk)
        for (int p = 0; p < FMA_NP; ++p) {
            uint32_t *to = wh + (kk * FMA_NP + p) * NR;
            if (p >= np) {
                _mm512_store_si512(to, _mm512_setzero_si512());
                continue;
            }
            const __m512i pair = _mm512_loadu_si512(panel + p * panel_stride + kk * 2 * NR);
            const __m256i even = (__m256i)_mm512_cvtxps_ph(_mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
            const __m256i odd = (__m256i)_mm512_cvtxps_ph(_mm512_castsi512_ps(_mm512_and_si512(pair, odd_half)));
            _mm512_store_si512(to, _mm512_or_si512(_mm512_cvtepu16_epi32(even),
                                                   _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16)));
        }
}

static inline __attribute__((always_inline)) void fp16_tile(const int mr, const int np, const int64_t pairs,
                                                            const uint32_t *restrict x, const uint32_t *restrict wh,
                                                            const float *restrict scale,
                                                            const float *restrict bias, float *restrict yf,
                                                            uint16_t *restrict yb, const int64_t ldy,
                                                            const int64_t ncols) {
    float sums[FMA_MR][FMA_NP][2 * NR] __attribute__((aligned(64)));
    _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r)
        _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
            _mm512_store_ps(sums[r][p], _mm512_setzero_ps());
            _mm512_store_ps(sums[r][p] + NR, _mm512_setzero_ps());
        }
    for (int64_t k0 = 0; k0 < pairs; k0 += FP16_KC) {
        const int64_t k1 = pairs - k0 < FP16_KC ? pairs : k0 + FP16_KC;
        __m512h acc[FMA_MR][FMA_NP];
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r)
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_setzero_ph();
        for (int64_t kk = k0; kk < k1; ++kk) {
            __m512h w[FMA_NP];
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p)
                w[p] = _mm512_castsi512_ph(_mm512_load_si512(wh + (kk * FMA_NP + p) * NR));
            _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
                const __m512h xv = _mm512_castsi512_ph(_mm512_set1_epi32((int)x[kk * FMA_MR + r]));
                _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) acc[r][p] = _mm512_fmadd_ph(xv, w[p], acc[r][p]);
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r)
            _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
                const __m512i bits = _mm512_castph_si512(acc[r][p]);
                const __m512 lo = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_castsi512_si256(bits)));
                const __m512 hi = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_extracti64x4_epi64(bits, 1)));
                _mm512_store_ps(sums[r][p], _mm512_add_ps(_mm512_load_ps(sums[r][p]), lo));
                _mm512_store_ps(sums[r][p] + NR, _mm512_add_ps(_mm512_load_ps(sums[r][p] + NR), hi));
            }
    }
    /* lane 2c: column c's even k, 2c + 1 its odd k (lanes 0-15 in lo, 16-31 in hi) */
    const __m512i even_lanes = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd_lanes = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    _Pragma("GCC unroll 3") for (int p = 0; p < np; ++p) {
        const int64_t left = ncols - p * NR;
        const __mmask16 keep = left >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + p * NR) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; ++r) {
            const __m512 lo = _mm512_load_ps(sums[r][p]), hi = _mm512_load_ps(sums[r][p] + NR);
            const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(lo, odd_lanes, hi),
                                             _mm512_permutex2var_ps(lo, even_lanes, hi));
            const __m512 out = _mm512_fmadd_ps(sum, _mm512_set1_ps(scale[r]), b);
            if (yb) _mm256_mask_storeu_epi16(yb + r * ldy + p * NR, keep, fma_to_bf16(out));
            else _mm512_mask_storeu_ps(yf + r * ldy + p * NR, keep, out);
        }
    }
}

static void fp16_tile_any(const int mr, const int np, const int64_t pairs, const uint32_t *x, const uint32_t *wh,
                          const float *scale, const float *bias, float *yf, uint16_t *yb, const int64_t ldy,
                          const int64_t ncols) {
#define TILE(R, P) fp16_tile(R, P, pairs, x, wh, scale, bias, yf, yb, ldy, ncols)
    FMA_TILE_DISPATCH(mr, np)
#undef TILE
}

/* Returns -2 where it does not run (fewer panel groups than threads): the caller runs another. */
static int linear_fp16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       const float *bias, float *yf, uint16_t *yb, int num_threads) {
    const int64_t pairs = (k + 1) / 2, panels = (n + NR - 1) / NR, groups = (panels + FMA_NP - 1) / FMA_NP;
    const int threads = num_threads > 0 ? num_threads : 1;
    if (groups < threads) return -2;
    const int64_t tiles = (m + FMA_MR - 1) / FMA_MR, panel_stride = pairs * 2 * NR;
    uint32_t *narrow = malloc(sizeof(uint32_t) * (size_t)(tiles * FMA_MR * pairs + 1));
    float *scale = malloc(sizeof(float) * (size_t)(tiles * FMA_MR));
    if (narrow == NULL || scale == NULL) {
        free(narrow);
        free(scale);
        return -1;
    }
    const int64_t block = fma_row_block(m, (int64_t)sizeof(uint32_t) * pairs);
#pragma omp parallel num_threads(threads)
    {
        uint32_t *wh = aligned_alloc(64, sizeof(uint32_t) * (size_t)(pairs * FMA_NP * NR));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            uint32_t *to = narrow + t * FMA_MR * pairs;
            const int rows = m - t * FMA_MR < FMA_MR ? (int)(m - t * FMA_MR) : FMA_MR;
            const uint16_t *from = x + t * FMA_MR * ldx;
            /* each row scaled by a power of 2 to a largest magnitude under 1 (exact; undone in
             * float32 at the end): no row overflows float16, however large its values */
            float up[FMA_MR];
            for (int r = 0; r < FMA_MR; ++r) {
                float largest = 0.0f;
                for (int64_t c = 0; r < rows && c < k; ++c) {
                    const float v = fabsf(bf16_to_f32(from[r * ldx + c]));
                    largest = v > largest ? v : largest;
                }
                int exponent = 0;
                frexpf(largest, &exponent);
                up[r] = ldexpf(1.0f, -exponent);
                scale[t * FMA_MR + r] = ldexpf(1.0f, exponent);
            }
            for (int64_t kk = 0; kk < pairs; ++kk, to += FMA_MR)
                for (int r = 0; r < FMA_MR; ++r) {
                    const int in = r < rows;
                    const float even = in ? bf16_to_f32(from[r * ldx + 2 * kk]) * up[r] : 0.0f;
                    const float odd = in && 2 * kk + 1 < k ? bf16_to_f32(from[r * ldx + 2 * kk + 1]) * up[r] : 0.0f;
                    to[r] = (uint32_t)fp16_bits(even) | (uint32_t)fp16_bits(odd) << 16;
                }
        }
        for (int64_t r0 = 0; r0 < m; r0 += block) {
            const int64_t r1 = m - r0 < block ? m : r0 + block;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t q = g * FMA_NP, column = q * NR;
                const int np = panels - q < FMA_NP ? (int)(panels - q) : FMA_NP;
                fp16_narrow_group(np, pairs, packed + q * panel_stride, panel_stride, wh);
                for (int64_t r = r0; r < r1; r += FMA_MR) {
                    const int mr = r1 - r < FMA_MR ? (int)(r1 - r) : FMA_MR;
                    const int64_t at = r * n + column;
                    fp16_tile_any(mr, np, pairs, narrow + r * pairs, wh, scale + r, bias ? bias + column : NULL,
                                  yf ? yf + at : NULL, yb ? yb + at : NULL, n, n - column);
                }
            }
        }
        free(wh);
    }
    free(narrow);
    free(scale);
    return 0;
}
#endif

/* From how many rows a call runs the float16 version (0: never; the engine times it at start-up). */
static int64_t fp16_min_rows =
#ifdef FP16_PATH
    LINEAR_BF16_FP16_ROWS;
#else
    0;
#endif


/* From how many rows a call runs the float32-FMA version (0: never). */
static int64_t fma_min_rows =
#ifdef FMA_PATH
    LINEAR_BF16_FMA_ROWS;
#else
    0;
#endif

/* Whether this build has the float32-FMA version (AVX-512F). */
int linear_bf16_fma_built(void) {
#ifdef FMA_PATH
    return 1;
#else
    return 0;
#endif
}

/* Calls of min_rows rows and more run the float32-FMA version (0, or a negative count: none);
 * returns the threshold now in effect, 0 where the version is not built. For the whole process
 * (the engine sets it once, at start-up), like linear_bf16_use_amx; AMX tiles, where on, come first. */
int64_t linear_bf16_use_fma(int64_t min_rows) {
#ifdef FMA_PATH
    fma_min_rows = min_rows > 0 ? min_rows : 0;
#else
    (void)min_rows;
#endif
    return fma_min_rows;
}

/* The threshold now in effect (what the last linear_bf16_use_fma left). */
int64_t linear_bf16_fma_rows(void) { return fma_min_rows; }

/* Calls of min_rows rows and more run the float16 version (0: none; before the float32-FMA one,
 * which runs where it does not); returns the threshold now in effect, 0 where it is not built. */
int64_t linear_bf16_use_fp16(int64_t min_rows) {
#ifdef FP16_PATH
    fp16_min_rows = min_rows > 0 ? min_rows : 0;
#else
    (void)min_rows;
#endif
    return fp16_min_rows;
}

/* The threshold now in effect (what the last linear_bf16_use_fp16 left). */
int64_t linear_bf16_fp16_rows(void) { return fp16_min_rows; }

/* Whether this build has the float16 version (AVX512-FP16). */
int linear_bf16_fp16_built(void) {
#ifdef FP16_PATH
    return 1;
#else
    return 0;
#endif
}

/* AMX (Intel Sapphire Rapids and later), for 2 rows and more. Why: on a CPU with AMX the
 * AVX512_BF16 version above is bound by its dot products at 16 rows (SmolLM2's 121 matmuls took
 * far longer than at one row, which runs at the memory's pace; docs/benchmarks.md, "Served
 * on the Xeon with AMX"). One TDPBF16PS multiplies 16 rows x 32 k of x by 32 k x 16 columns of W:
 * 8,192 products, against a dot product's 32.
 * The packed weight needs no layout of its own: 16 consecutive pairs of a panel, [16 pairs][16
 * columns][2] bfloat16, are 16 contiguous rows of 64 bytes, which is the B operand TDPBF16PS
 * reads. An A tile is 16 rows of x by 32 k (64 bytes a row at x's row stride); a C tile is 16 x 16
 * float32. Tiles 0-3 hold C (up to AMX_PANELS panels), 4 holds A, 5 and 6 take B in turn.
 * Rows go in blocks of 16, read in place; a last partial block is copied into a zeroed one.
 * k must be a multiple of 32 (every hidden size in use is); otherwise, below AMX_MIN_ROWS, and
 * until the engine turns it on (linear_bf16_use_amx: with cpu_linear=native), the version above
 * runs. With one block of rows (a decode step) a group is one panel, so the
 * weight's one pass is split evenly between the threads; with more, a group of 2-4 panels shares
 * each A tile load and later blocks read its panels from cache.
 * Tile registers are per thread (each OpenMP thread loads the configuration, then releases it),
 * and Linux lets a process use them only once asked (arch_prctl ARCH_REQ_XCOMP_PERM): refused,
 * linear_bf16_use_amx says so and the version above runs.
 * LINEAR_BF16_EMULATE_AMX (tests) builds this same code over tiles in plain C, on any CPU with
 * the AVX2 version: the blocking, padding, grouping and epilogue are then checked everywhere, and
 * only the four tile instructions and the configuration differ on the hardware. */
#if LINEAR_BF16_BASE_ISA == 2 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(LINEAR_BF16_EMULATE_AMX)
#define AMX_PATH 3
#elif LINEAR_BF16_BASE_ISA >= 1 && defined(LINEAR_BF16_EMULATE_AMX)
#define AMX_PATH 4
#endif

#ifdef AMX_PATH
#include <stdlib.h>

#define AMX_ROWS 16          /* rows of an A and a C tile */
#define AMX_K 32             /* k of an A tile: 16 pairs, 64 bytes */
#define AMX_PANELS 4         /* C tiles, so panels of a group at most */
#define AMX_TILE_ELEMS 512   /* bfloat16 of one B tile: 16 pairs x 16 columns x 2 */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 2       /* one row streams the weight at the memory's pace without tiles */
#endif
#ifndef AMX_PREFETCH_TILES
#define AMX_PREFETCH_TILES 4 /* B tiles prefetched ahead in a panel, on the first block of rows (0: none) */
#endif

#if AMX_PATH == 4
/* Faults for the tests of the start-up probe (kernels/amx_probe.py), which runs the tiles in a
 * child process before the engine turns them on. LINEAR_BF16_EMULATED_FAULT in the environment
 * (read at each use; emulated builds only): 1 a tile instruction that kills the process (SIGILL,
 * as a bad configuration would on the hardware), 2 sums missing the odd k of each pair, 3 a call
 * that never returns, 4 the OS refusing the AMX state. */
#include <signal.h>
#include <unistd.h>
static int emulated_fault(void) {
    const char *fault = getenv("LINEAR_BF16_EMULATED_FAULT");
    return fault == NULL ? 0 : atoi(fault);
}
/* Plain C tiles with TDPBF16PS's arithmetic: C[m][n] += A[m][2i] B[i][2n], then += A[m][2i+1]
 * B[i][2n+1] (the hardware also flushes denormals, which this does not). */
static __thread uint8_t emulated_tiles[8][AMX_ROWS * 64];
static void emulated_load(int t, const void *base, int64_t stride) {
    for (int r = 0; r < AMX_ROWS; ++r) memcpy(emulated_tiles[t] + r * 64, (const uint8_t *)base + r * stride, 64);
}
static void emulated_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < AMX_ROWS; ++r) memcpy((uint8_t *)base + r * stride, emulated_tiles[t] + r * 64, 64);
}
static int64_t emulated_tile_products;   /* TDPBF16PS emulated so far (tests: did the tiles run?) */
int64_t linear_bf16_emulated_tile_products(void) { return emulated_tile_products; }
static void emulated_dp(int c, int a, int b) {
#pragma omp atomic
    ++emulated_tile_products;
    const int fault = emulated_fault();
    if (fault == 1) raise(SIGILL);
    if (fault == 3) for (;;) pause();
    float acc[AMX_ROWS][16];
    uint16_t lhs[AMX_ROWS][32], rhs[16][32];
    memcpy(acc, emulated_tiles[c], sizeof acc);
    memcpy(lhs, emulated_tiles[a], sizeof lhs);
    memcpy(rhs, emulated_tiles[b], sizeof rhs);
    for (int r = 0; r < AMX_ROWS; ++r)
        for (int col = 0; col < 16; ++col)
            for (int i = 0; i < 16; ++i) {   /* one product at a time, as Intel's pseudocode adds them */
                acc[r][col] += bf16_to_f32(lhs[r][2 * i]) * bf16_to_f32(rhs[i][2 * col]);
                if (fault != 2)
                    acc[r][col] += bf16_to_f32(lhs[r][2 * i + 1]) * bf16_to_f32(rhs[i][2 * col + 1]);
            }
    memcpy(emulated_tiles[c], acc, sizeof acc);
}
#define TILE_LOAD(t, base, stride) emulated_load(t, base, stride)
#define TILE_STORE(t, base, stride) emulated_store(t, base, stride)
#define TILE_ZERO(t) memset(emulated_tiles[t], 0, sizeof emulated_tiles[t])
#define TILE_DP(c, a, b) emulated_dp(c, a, b)
#define PREFETCH_TILE(at) ((void)(at))
static int amx_granted(void) { return emulated_fault() != 4; }
static void amx_configure(void) {}
static void amx_release(void) {}
#else
#include <sys/syscall.h>
#include <unistd.h>
/* The tile number is an immediate: these take literal 0-6 only. */
/* gcc's tile intrinsics are asm statements that declare no memory operands: a compiler barrier
 * after the stores keeps the epilogue's reads of `out` after them. */
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) do { _tile_stored(t, base, stride); __asm__ volatile("" ::: "memory"); } while (0)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define PREFETCH_TILE(at) do { for (int line = 0; line < 16; ++line) \
    _mm_prefetch((const char *)(at) + line * 64, _MM_HINT_T0); } while (0)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int amx_granted(void) {
    static int state;    /* 0: not asked yet, 1: granted, -1: refused (asking again is harmless) */
    /* (an ordinary int: a race would only ask twice) */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}
struct tile_config {     /* LDTILECFG's 64-byte operand, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];  /* bytes a row, per tile */
    uint8_t rows[16];
};
static void amx_configure(void) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 7; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = AMX_ROWS;
    }
    __asm__ volatile("" ::: "memory");   /* every byte of the configuration written first */
    _tile_loadconfig(&config);
}
static void amx_release(void) { _tile_release(); }
#endif

/* One block of 16 rows of x (row stride ldx) times np panels over the whole k, into out
 * [16][np * 16] float32 (row stride np * 16). prefetch: also fetch B tiles ahead. */
static inline __attribute__((always_inline)) void amx_block(const int np, const int64_t chunks, const uint16_t *x,
                                                            const int64_t ldx, const uint16_t *panel,
                                                            const int64_t panel_stride, float *out,
                                                            const int prefetch) {
    TILE_ZERO(0);
    if (np > 1) TILE_ZERO(1);
    if (np > 2) TILE_ZERO(2);
    if (np > 3) TILE_ZERO(3);
    for (int64_t c = 0; c < chunks; ++c) {
        TILE_LOAD(4, x + c * AMX_K, ldx * 2);
#define PANEL(P, B) if (np > P) { \
            const uint16_t *at = panel + P * panel_stride + c * AMX_TILE_ELEMS; \
            if (prefetch && AMX_PREFETCH_TILES > 0) PREFETCH_TILE(at + AMX_PREFETCH_TILES * AMX_TILE_ELEMS); \
            TILE_LOAD(B, at, 64); \
            TILE_DP(P, 4, B); \
        }
        PANEL(0, 5)
        PANEL(1, 6)
        PANEL(2, 5)
        PANEL(3, 6)
#undef PANEL
    }
    const int64_t stride = (int64_t)np * 16 * sizeof(float);
    TILE_STORE(0, out, stride);
    if (np > 1) TILE_STORE(1, out + 16, stride);
    if (np > 2) TILE_STORE(2, out + 32, stride);
    if (np > 3) TILE_STORE(3, out + 48, stride);
}

/* Panels per group beyond one block of rows: the most (up to AMX_PANELS) whose groups still
 * split evenly over the threads, or are many enough for the remainder not to matter. */
static int64_t amx_group(const int64_t panels, const int64_t blocks, const int threads) {
    if (blocks == 1) return 1;
    for (int64_t group = AMX_PANELS; group > 1; group /= 2) {
        const int64_t groups = (panels + group - 1) / group;
        if (groups % threads == 0 || groups >= 8 * threads) return group;
    }
    return 1;
}

/* Off until the engine asks (linear_bf16_use_amx): the tiles run where cpu_linear chose our
 * kernel, not for the LM head of a model whose projections go to oneDNN. */
static int amx_enabled;

/* 0 done, -2 not for this call (the version above runs). */
static int linear_amx(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                      const float *bias, float *yf, uint16_t *yb, int num_threads) {
    if (!amx_enabled || m < AMX_MIN_ROWS || k % AMX_K != 0) return -2;
    const int64_t panels = (n + NR - 1) / NR, panel_stride = k * NR, chunks = k / AMX_K;
    const int64_t blocks = (m + AMX_ROWS - 1) / AMX_ROWS, full_blocks = m / AMX_ROWS;
    uint16_t *tail = NULL;      /* a tile reads 16 rows: the last block's missing ones are zeros */
    if (full_blocks < blocks) {
        tail = calloc((size_t)(AMX_ROWS * k), sizeof *tail);
        if (tail == NULL) return -2;
        for (int64_t r = full_blocks * AMX_ROWS; r < m; ++r)
            memcpy(tail + (r - full_blocks * AMX_ROWS) * k, x + r * ldx, (size_t)k * sizeof *tail);
    }
    const int threads = num_threads > 0 ? num_threads : 1;
    const int64_t group = amx_group(panels, blocks, threads), groups = (panels + group - 1) / group;
#pragma omp parallel num_threads(threads)
    {
        float out[AMX_ROWS * AMX_PANELS * NR];
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t p0 = g * group, column = p0 * NR;
            const int np = panels - p0 < group ? (int)(panels - p0) : (int)group;
            const int64_t ncols = n - column < np * NR ? n - column : np * NR;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint16_t *block_rows = b < full_blocks ? x + b * AMX_ROWS * ldx : tail;
                amx_block(np, chunks, block_rows, b < full_blocks ? ldx : k, packed + p0 * panel_stride,
                          panel_stride, out, b == 0);
                const int64_t r0 = b * AMX_ROWS, mr = m - r0 < AMX_ROWS ? m - r0 : AMX_ROWS;
                for (int64_t r = 0; r < mr; ++r)
                    for (int64_t c = 0; c < ncols; ++c) {
                        const float value = out[r * np * NR + c] + (bias ? bias[column + c] : 0.0f);
                        if (yb) yb[(r0 + r) * n + column + c] = f32_to_bf16(value);
                        else yf[(r0 + r) * n + column + c] = value;
                    }
            }
        }
        amx_release();
    }
    free(tail);
    return 0;
}
#endif

/* Which version this build runs: 4 AMX emulated (test builds), 3 AMX, 2 AVX512_BF16, 1 AVX2,
 * 0 none (the functions below then return -1). */
int linear_bf16_isa(void) {
#ifdef AMX_PATH
    return AMX_PATH;
#else
    return LINEAR_BF16_BASE_ISA;
#endif
}

/* Turn the AMX version on (on != 0) or off for this process; returns whether it now runs (0 where
 * it is not built, or where the kernel refused the process AMX state). */
int linear_bf16_use_amx(int on) {
#ifdef AMX_PATH
    amx_enabled = on && amx_granted();
    return amx_enabled;
#else
    (void)on;
    return 0;
#endif
}

/* Whether the AMX version runs now (what the last linear_bf16_use_amx left). */
int linear_bf16_amx_on(void) {
#ifdef AMX_PATH
    return amx_enabled;
#else
    return 0;
#endif
}

static int linear(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                  const float *bias, float *yf, uint16_t *yb, int num_threads, int may_use_fp16) {
#ifdef AMX_PATH
    const int done = linear_amx(x, m, k, ldx, packed, n, bias, yf, yb, num_threads);
    if (done != -2) return done;
#endif
#ifdef FP16_PATH
    if (may_use_fp16 && fp16_min_rows > 0 && m >= fp16_min_rows) {
        const int done = linear_fp16(x, m, k, ldx, packed, n, bias, yf, yb, num_threads);
        if (done != -2) return done;
    }
#endif
#ifdef FMA_PATH
    if (fma_min_rows > 0 && m >= fma_min_rows) return linear_fma(x, m, k, ldx, packed, n, bias, yf, yb, num_threads);
#endif
    return linear_base(x, m, k, ldx, packed, n, bias, yf, yb, num_threads);
}

/* x: [m, k] bfloat16, row stride ldx, k even; packed as above; y: [m, n] float32 contiguous. */
int linear_bf16_f32(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                    float *y, int num_threads) {
    return linear(x, m, k, ldx, packed, n, NULL, y, NULL, num_threads, 1);
}

/* The same, never through the float16 version: a caller that asks float32 out for the logits'
 * sake (their top tokens) gets products exact and float32 sums whatever fp16_min_rows says. */
int linear_bf16_logits(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       float *y, int num_threads) {
    return linear(x, m, k, ldx, packed, n, NULL, y, NULL, num_threads, 0);
}

/* The same with a bfloat16 y [m, n] contiguous, rounded once; bias: float32 [n] or NULL. */
int linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                const float *bias, uint16_t *y, int num_threads) {
    return linear(x, m, k, ldx, packed, n, bias, NULL, y, num_threads, 1);
}

/* A piece of one matmul for a caller that shares the work out itself (moe.c: the experts of a
 * layer in one parallel region): rows [0, m) of x times panels [p0, p1) of packed, float32 (yf)
 * or bfloat16 (yb) out with row stride ldy, no bias, on the calling thread (no OpenMP, no AMX:
 * the dot products, or the AVX2 version). */
int linear_bf16_panels(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       int64_t p0, int64_t p1, float *yf, uint16_t *yb, int64_t ldy) {
    return panel_range(x, m, k, ldx, packed, n, NULL, p0, p1, yf, yb, ldy);
}
