/* y = x @ W.T (+ bias), float32, for CPU: the engine's linear layers.
 *
 * Why our own: at the row counts a serving step has (one row per decoding sequence, tens of
 * rows) oneDNN and MKL reached 40-60% of this CPU's FMA peak; this kernel reaches ~1.4x their
 * speed on a whole decoder's projections at 16 rows and streams the weights at DRAM
 * bandwidth for a single row (docs/benchmarks.md). ``backend/cpu_linear.py`` keeps F.linear
 * as the reference it is tested against.
 *
 * Layout: the weight [n, k] (row-major, as in checkpoints) is packed once, in Python
 * (cpu_linear.py), into panels of NR = 16 output columns, [ceil(n / 16)][k][16], zero-padded
 * past n, so the inner loop reads 64 contiguous bytes per k. A tile of MR = 6 rows x 16 columns keeps its 12 accumulators in
 * AVX2 registers for the whole k loop: per k, two loads of the panel, six broadcasts of x and
 * twelve FMAs. Panels are shared out to OpenMP threads (torch's pool: the library links the
 * libgomp torch already loaded); every tile of a panel reuses it from L2. Rows are taken MC
 * at a time so that a long prefill's rows stay in cache while the weights stream past.
 * Accumulation is sequential in k with FMA: float32 throughout, like F.linear up to
 * summation order.
 *
 * Built only where the compiler targets AVX2 and FMA (``-march=native``); elsewhere
 * linear_f32_supported() returns 0 and the engine uses oneDNN or F.linear.
 */
#include <stdint.h>
#include <string.h>

#define NR 16
#define MR 6
#define MC 48

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int linear_f32_supported(void) { return 1; }

/* mr rows (<= MR) of x times one panel; ncols (<= NR) columns of y are written; a line of
 * ``prefetch`` (the next panel, or NULL) is requested per k. Inlined
 * with a constant mr, so the accumulator arrays become registers (the unroll pragmas make
 * gcc unroll before it decides; without them it spilled every accumulator each k). */
static inline __attribute__((always_inline)) void tile(const int mr, int64_t k, const float *restrict x,
                                                       int64_t ldx, const float *restrict panel,
                                                       const float *restrict bias, float *restrict y,
                                                       int64_t ldy, int64_t ncols, const float *prefetch) {
    __m256 lo[MR], hi[MR];
    _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
        lo[r] = _mm256_setzero_ps();
        hi[r] = _mm256_setzero_ps();
    }
    for (int64_t kk = 0; kk < k; ++kk) {
        if (prefetch != NULL) _mm_prefetch((const char *)(prefetch + kk * NR), _MM_HINT_T0);
        const __m256 w_lo = _mm256_loadu_ps(panel + kk * NR), w_hi = _mm256_loadu_ps(panel + kk * NR + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
            lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
        }
    }
    if (bias != NULL) {
        float padded[NR] = {0};
        memcpy(padded, bias, sizeof(float) * ncols);
        const __m256 b_lo = _mm256_loadu_ps(padded), b_hi = _mm256_loadu_ps(padded + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
            lo[r] = _mm256_add_ps(lo[r], b_lo);
            hi[r] = _mm256_add_ps(hi[r], b_hi);
        }
    }
    if (ncols == NR) {
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
            _mm256_storeu_ps(y + r * ldy, lo[r]);
            _mm256_storeu_ps(y + r * ldy + 8, hi[r]);
        }
    } else {
        float row[NR];
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
            _mm256_storeu_ps(row, lo[r]);
            _mm256_storeu_ps(row + 8, hi[r]);
            memcpy(y + r * ldy, row, sizeof(float) * ncols);
        }
    }
}

/* x: [m, k] with row stride ldx; packed: [ceil(n / NR)][k][NR]; bias: [n] or NULL;
 * y: [m, n] contiguous. Returns 0 (the status the bfloat16 kernels share). */
int linear_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                const float *bias, float *y, int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mc = m - m0 < MC ? m - m0 : MC;
        /* guided: large contiguous runs of panels first (as fast as static here), smaller ones at
         * the end, so that a thread the OS preempts (a served step shares 2 cores with Triton's
         * and the client's threads) does not leave the other waiting at the barrier; dynamic
         * chunks of 1-8 panels measured 7-30% slower. nowait: row blocks write disjoint rows,
         * so a thread may start the next one early. */
#pragma omp for schedule(guided) nowait
        for (int64_t p = 0; p < panels; ++p) {
            const float *panel = packed + p * k * NR;
            const float *panel_bias = bias != NULL ? bias + p * NR : NULL;
            const int64_t ncols = n - p * NR < NR ? n - p * NR : NR;
            /* With more than one tile per panel, the first one requests the next panel, so that
             * it arrives from DRAM while the other tiles compute from cache (measured 8-12%
             * faster at 16 rows; with one tile it only competed with the stream and was slower). */
            const float *next = mc > MR && p + 1 < panels ? panel + k * NR : NULL;
            for (int64_t r0 = 0; r0 < mc; r0 += MR) {
                const float *xr = x + (m0 + r0) * ldx;
                float *yr = y + (m0 + r0) * n + p * NR;
                const float *pf = r0 == 0 ? next : NULL;
                switch (mc - r0 < MR ? mc - r0 : MR) {
                    case 6: tile(6, k, xr, ldx, panel, panel_bias, yr, n, ncols, pf); break;
                    case 5: tile(5, k, xr, ldx, panel, panel_bias, yr, n, ncols, pf); break;
                    case 4: tile(4, k, xr, ldx, panel, panel_bias, yr, n, ncols, pf); break;
                    case 3: tile(3, k, xr, ldx, panel, panel_bias, yr, n, ncols, pf); break;
                    case 2: tile(2, k, xr, ldx, panel, panel_bias, yr, n, ncols, pf); break;
                    default: tile(1, k, xr, ldx, panel, panel_bias, yr, n, ncols, pf); break;
                }
            }
        }
    }
    return 0;
}

#else

int linear_f32_supported(void) { return 0; }

int linear_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
               const float *bias, float *y, int num_threads) {
    (void)x, (void)m, (void)k, (void)ldx, (void)packed, (void)n, (void)bias, (void)y, (void)num_threads;
    return -1;
}

#endif
