/* Greedy sampling on CPU: the argmax of each row of float32 logits.
 *
 * Why: torch's CPU argmax reads a row one element at a time; over a decode step's logits (16
 * rows x 49,152 tokens, 3 MB) it took many times as long as torch's amax of the same rows,
 * which this about matches (docs/benchmarks.md, "Sampling a token on CPU"). Here each row is two
 * vector passes: its maximum, then the first position holding it (the second pass stops there,
 * usually early in the row).
 *
 * The answer is torch.argmax's, which the tests check it against (tests/test_sampler.py):
 * the first index of the maximum; a row holding NaN answers its first NaN (torch treats NaN
 * as larger than everything); a row of -inf answers 0.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The first index of row[0:n]'s maximum, or of its first NaN. */
static int64_t argmax_row(const float *restrict row, int64_t n) {
    float max = -INFINITY;
    int has_nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(v, vmax);     /* a NaN lane of v keeps vmax's: NaN is found apart */
    }
    max = _mm512_reduce_max_ps(vmax);
    has_nan = nan != 0;
#elif defined(__AVX2__)
    __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(v, vmax);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; ++j) max = lanes[j] > max ? lanes[j] : max;
    has_nan = _mm256_movemask_ps(nan) != 0;
#endif
    for (; i < n; ++i) {
        if (row[i] != row[i]) has_nan = 1;
        else if (row[i] > max) max = row[i];
    }
    if (has_nan) {
        for (i = 0; i < n; ++i)
            if (row[i] != row[i]) return i;
    }
    i = 0;
#if defined(__AVX512F__)
    for (const __m512 target = _mm512_set1_ps(max); i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    for (const __m256 target = _mm256_set1_ps(max); i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; ++i)
        if (row[i] == max) return i;
    return 0;   /* not reached: max is one of the row's values, or -inf for a row of -inf (found at 0) */
}

/* out[r] = argmax of logits[r * stride : r * stride + n], rows split between up to num_threads
 * threads once the work is large enough to pay for them. */
void argmax_rows_f32(const float *restrict logits, int64_t rows, int64_t n, int64_t stride, int64_t *restrict out,
                     int num_threads) {
    if (rows * n < (int64_t)1 << 17) num_threads = 1;   /* ~0.5 MB: less than a fork and join costs */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(logits + r * stride, n);
}
