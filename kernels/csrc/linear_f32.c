/* y = x @ W.T (+ bias), float32, for CPU: the engine's linear layers.
 *
 * Why our own: at the row counts a serving step has (one row per decoding sequence, tens of
 * rows) oneDNN and MKL stayed well below the CPU's FMA peak; this kernel is faster than both
 * on a whole decoder's projections at 16 rows and streams the weights at DRAM
 * bandwidth for a single row (docs/benchmarks.md). ``backend/cpu_linear.py`` keeps F.linear
 * as the reference it is tested against.
 *
 * Layout: the weight [n, k] (row-major, as in checkpoints) is packed once, in Python
 * (cpu_linear.py), into panels of NR = 16 output columns, [ceil(n / 16)][k][16], zero-padded
 * past n, so the inner loop reads 64 contiguous bytes per k. A tile of up to MR = 6 rows x 16
 * columns keeps its 12 accumulators in AVX2 registers: per k, two loads of the panel, six
 * broadcasts of x and twelve FMAs. Panels are shared out to OpenMP threads (torch's pool: the
 * library links the libgomp torch already loaded). At decode row counts a panel's k goes in
 * blocks of KB and every row tile runs over a block before the next block starts (the tiles'
 * sums wait in an L1 scratch between blocks): the first tile reads the block from memory, the
 * others from L1, and the second requests the next block's lines, so the weights stream during
 * the whole panel's compute, not during the first tile only (faster at 8-32 rows than
 * whole-k tiles, docs/benchmarks.md). Rows are taken MC at a time so that a long prefill's rows stay in cache
 * while the weights stream past. Accumulation is sequential in k with FMA: float32 throughout,
 * like F.linear up to summation order.
 *
 * Built only where the compiler targets AVX2 and FMA (``-march=native``); elsewhere
 * linear_f32_supported() returns 0 and the engine uses oneDNN or F.linear.
 */
#include <stdint.h>
#include <string.h>

#define NR 16
#define MR 6
#define MC 48
#define MIN_EVEN_ROWS 5
/* k per block: 64 k of a panel are 4 KB, well inside L1 with the rows' x. 32 measured within
 * noise of it, 128 and 256 slower at 16 rows (docs/benchmarks.md). */
#ifndef KB
#define KB 64
#endif
/* Up to this many rows a panel's k goes in blocks (decode steps: faster at 8-32 rows); more
 * rows (prefill) run whole-k tiles, which measured as fast or slightly faster at 512. */
#ifndef BLOCK_MAX_ROWS
#define BLOCK_MAX_ROWS 32
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int linear_f32_supported(void) { return 1; }

/* Rows of the row tile that starts at r0 of mc: tiles as even as their count allows (16 rows:
 * 6 + 5 + 5) while each keeps at least 5 rows; else MR at a time and the rest (8 rows: 6 + 2,
 * not 4 + 4). A 4-row tile's 8 accumulators are exactly the FMA units' latency x throughput, and
 * measured slower than a 6-row tile beside a small one. */
static inline int64_t tile_rows(int64_t r0, int64_t mc) {
    const int64_t tiles = (mc + MR - 1) / MR, even = mc / tiles, extra = mc % tiles;
    if (even < MIN_EVEN_ROWS) return mc - r0 < MR ? mc - r0 : MR;
    return r0 < extra * (even + 1) ? even + 1 : even;     /* the first ``extra`` tiles take one more */
}

/* mr rows (<= MR) of x times one panel over k in [k0, k1). The sums start at zero when k0 is 0,
 * else from ``sums`` (mr rows of NR floats), where they are left. A line of ``prefetch`` (or
 * none: NULL) is requested per k. Inlined with a constant mr, so the accumulator arrays become
 * registers (the unroll pragmas make gcc unroll before it decides; without them it spilled
 * every accumulator each k). */
static inline __attribute__((always_inline)) void tile(const int mr, int64_t k0, int64_t k1,
                                                       const float *restrict x, int64_t ldx,
                                                       const float *restrict panel, float *restrict sums,
                                                       const float *prefetch) {
    __m256 lo[MR], hi[MR];
    _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
        lo[r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(sums + r * NR);
        hi[r] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(sums + r * NR + 8);
    }
    for (int64_t kk = k0; kk < k1; ++kk) {
        if (prefetch != NULL) _mm_prefetch((const char *)(prefetch + (kk - k0) * NR), _MM_HINT_T0);
        const __m256 w_lo = _mm256_loadu_ps(panel + kk * NR), w_hi = _mm256_loadu_ps(panel + kk * NR + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
            lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
        }
    }
    _Pragma("GCC unroll 6") for (int r = 0; r < mr; ++r) {
        _mm256_store_ps(sums + r * NR, lo[r]);
        _mm256_store_ps(sums + r * NR + 8, hi[r]);
    }
}

/* mc (<= MC) rows of x times one panel into ncols (<= NR) columns of y (+ bias). ``next``: the
 * lines to request after the panel's last block (the next panel's first block), or NULL. Above
 * BLOCK_MAX_ROWS the one block is the whole of k, and the second tile requests the whole next
 * panel (the whole-k tiles before the blocks had the first tile do it: measured alike at 512
 * rows). */
static void panel_rows(int64_t mc, int64_t k, const float *restrict x, int64_t ldx, const float *restrict panel,
                       const float *next, const float *restrict bias, float *restrict y, int64_t ldy,
                       int64_t ncols) {
    float sums[MC * NR] __attribute__((aligned(32)));
    if (k == 0) memset(sums, 0, sizeof(sums));      /* no block runs: the sums are empty */
    const int64_t kb = mc <= BLOCK_MAX_ROWS ? KB : k;
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
        const int64_t k1 = k - k0 < kb ? k : k0 + kb;
        /* The second tile requests what the first will read next: one line (a k of the panel)
         * per k. With one tile there is none: a request then only competed with the stream. */
        const float *ahead = k1 < k ? panel + k1 * NR : next;
        for (int64_t r0 = 0, mr = 0, t = 0; r0 < mc; r0 += mr, ++t) {
            mr = tile_rows(r0, mc);
            const float *xr = x + r0 * ldx, *pf = t == 1 ? ahead : NULL;
            float *sr = sums + r0 * NR;
            switch (mr) {
                case 6: tile(6, k0, k1, xr, ldx, panel, sr, pf); break;
                case 5: tile(5, k0, k1, xr, ldx, panel, sr, pf); break;
                case 4: tile(4, k0, k1, xr, ldx, panel, sr, pf); break;
                case 3: tile(3, k0, k1, xr, ldx, panel, sr, pf); break;
                case 2: tile(2, k0, k1, xr, ldx, panel, sr, pf); break;
                default: tile(1, k0, k1, xr, ldx, panel, sr, pf); break;
            }
        }
    }
    for (int64_t r = 0; r < mc; ++r)
        /* No "+ 0.0f" without a bias: it would turn a -0.0 sum into +0.0 (the whole-k tiles
         * before these blocks wrote the sums as they were). */
        for (int64_t c = 0; c < ncols; ++c)
            y[r * ldy + c] = bias != NULL ? sums[r * NR + c] + bias[c] : sums[r * NR + c];
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
         * chunks of 1-8 panels measured slower. nowait: row blocks write disjoint rows,
         * so a thread may start the next one early. */
#pragma omp for schedule(guided) nowait
        for (int64_t p = 0; p < panels; ++p) {
            const float *panel = packed + p * k * NR;
            const int64_t ncols = n - p * NR < NR ? n - p * NR : NR;
            panel_rows(mc, k, x + m0 * ldx, ldx, panel, p + 1 < panels ? panel + k * NR : NULL,
                       bias != NULL ? bias + p * NR : NULL, y + m0 * n + p * NR, n, ncols);
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
