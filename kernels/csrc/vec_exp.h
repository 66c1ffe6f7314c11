/* exp(x) on a vector of float32, x <= 0, for the CPU kernels: softmax inputs after the max is
 * subtracted (paged_attention.c) and the sigmoid of SiLU written with exp(-|x|) (layer_ops.c).
 * Include after <immintrin.h>. */
#ifndef LLM_KERNELS_VEC_EXP_H
#define LLM_KERNELS_VEC_EXP_H

/* exp(x) on a vector, x <= 0 (softmax inputs after the max is subtracted): x = n ln2 + r,
 * |r| <= ln2 / 2, exp(r) by Cephes' degree-7 polynomial, times 2^n. Within 2 ulp of expf
 * (tests/test_cpu_attention.py checks the kernel against torch). Scalar expf was a large share
 * of the kernel at 650-token contexts. */
#define EXP_LOWEST -87.3f   /* below it exp underflows float32; clamped so 2^n stays finite */
#if defined(__AVX512F__)
static inline __m512 exp_ps512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LOWEST));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#if defined(__AVX2__) && defined(__FMA__)   /* AVX-512 builds too: the AVX2 attention functions use it */
static inline __m256 exp_ps256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOWEST));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n built in the exponent field: n >= -126 after the clamp. */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#endif
