/* The small per-layer ops of a decoder step, fused, float32 or bfloat16, for CPU.
 *
 * Why: at serving batch sizes each of these touches a few tens of KB, so as torch ops they
 * cost their dispatch and thread fork/join (even an rms_norm of 16 x 576), not their
 * arithmetic; a 16-sequence SmolLM2 step spent a noticeable share of its time in them. Each
 * function here does in one single-threaded pass what took 2-6 torch ops. The references
 * they are tested against are torch code: RMSNorm and apply_rope in backend/model.py,
 * reshape_and_cache_reference in kernels/reference.py (tests/test_layer_ops.py).
 *
 * The bfloat16 versions round where the torch ops they replace round (each bfloat16 op of
 * torch computes in float32 and rounds its result to nearest even): the residual add, the
 * normalised value before the weight, the product with the weight, and in RoPE each of the
 * two products and their sum. So they give torch's bits, but for the float32 sum of squares,
 * whose order differs, and SiLU's exp (a polynomial within 2 ulp of expf, where torch uses
 * Sleef's): its float32 result may differ in the last bits, so a bfloat16 one rarely.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "bf16.h"
#include "vec_exp.h"

/* float32 -> bfloat16 -> float32: what a bfloat16 torch op's result holds. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* residual += delta (when delta != NULL), then out = residual * rsqrt(mean(residual^2) + eps)
 * * weight, row by row. residual, delta and out: [rows, hidden] contiguous. */
void add_rms_norm_f32(float *restrict residual, const float *restrict delta, const float *restrict weight,
                      float *restrict out, int64_t rows, int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        float *h = residual + r * hidden;
        if (delta != NULL) {
            const float *d = delta + r * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) h[i] += d[i];
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += h[i] * h[i];
        const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = h[i] * scale * weight[i];
    }
}

/* One packed qkv row per token, [q heads | k heads | v heads] x head_dim, row stride
 * qkv_stride. Rotates q and k in place (rotate-half RoPE, HF layout: cos/sin [tokens,
 * head_dim] with both halves equal) and writes k and v to their cache slot (slot < 0:
 * skipped). key/value cache: [num_slots, num_kv_heads, head_dim]. */
/* No FMA contraction: the same roundings as torch's separate multiplies and add. */
__attribute__((optimize("fp-contract=off"))) void rope_and_cache_f32(float *restrict qkv, int64_t qkv_stride, const float *restrict cos,
                        const float *restrict sin, const int64_t *restrict slots, float *restrict key_cache,
                        float *restrict value_cache, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        float *row = qkv + t * qkv_stride;
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
            float *x = row + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        if (slots[t] < 0) continue;
        const int64_t kv_size = num_kv_heads * head_dim;
        const float *k = row + num_heads * head_dim, *v = k + kv_size;
        float *kc = key_cache + slots[t] * kv_size, *vc = value_cache + slots[t] * kv_size;
        for (int64_t i = 0; i < kv_size; ++i) {
            kc[i] = k[i];
            vc[i] = v[i];
        }
    }
}

/* add_rms_norm_f32 for bfloat16 tensors (weight bfloat16 too): the residual add rounds to
 * bfloat16; the norm is computed in float32 from the rounded residual, as transformers'
 * LlamaRMSNorm does, rounded, then multiplied by the weight and rounded again. */
void add_rms_norm_bf16(bf16_t *restrict residual, const bf16_t *restrict delta, const bf16_t *restrict weight,
                       bf16_t *restrict out, int64_t rows, int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        bf16_t *h = residual + r * hidden;
        if (delta != NULL) {
            const bf16_t *d = delta + r * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(d[i]));
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; ++i) sum += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
        const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        bf16_t *o = out + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i)
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(h[i]) * scale));
    }
}

/* rope_and_cache_f32 for bfloat16 qkv, cos/sin and caches. */
void rope_and_cache_bf16(bf16_t *restrict qkv, int64_t qkv_stride, const bf16_t *restrict cos,
                         const bf16_t *restrict sin, const int64_t *restrict slots, bf16_t *restrict key_cache,
                         bf16_t *restrict value_cache, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; ++t) {
        bf16_t *row = qkv + t * qkv_stride;
        const bf16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
            bf16_t *x = row + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                x[i] = f32_to_bf16(round_bf16(x1 * bf16_to_f32(c[i])) - round_bf16(x2 * bf16_to_f32(s[i])));
                x[i + half] = f32_to_bf16(round_bf16(x2 * bf16_to_f32(c[i + half])) +
                                          round_bf16(x1 * bf16_to_f32(s[i + half])));
            }
        }
        if (slots[t] < 0) continue;
        const int64_t kv_size = num_kv_heads * head_dim;
        const bf16_t *k = row + num_heads * head_dim, *v = k + kv_size;
        memcpy(key_cache + slots[t] * kv_size, k, sizeof(bf16_t) * kv_size);
        memcpy(value_cache + slots[t] * kv_size, v, sizeof(bf16_t) * kv_size);
    }
}

/* SiLU(x) = x / (1 + exp(-x)) on n float32 values in place. exp(-|x|) keeps the polynomial's
 * argument <= 0: for x < 0, SiLU(x) = x e / (1 + e) with e = exp(x). Below EXP_LOWEST (-87.3) e
 * is 0 (the polynomial would clamp it to exp(-87.3) and give x * 1e-38: -3.7 at x = -3e38), so
 * SiLU there is -0.0, and NaN at -inf, as torch's; from -87.3 to -104 torch's exp still gives a
 * denormal, so torch's SiLU is a negative value below 4e-36 in magnitude there. */
static void silu_in_place(float *restrict v, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        const __m512 neg_abs = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x));
        const __mmask16 underflow = _mm512_cmp_ps_mask(neg_abs, _mm512_set1_ps(EXP_LOWEST), _CMP_LT_OQ);
        const __m512 e = _mm512_maskz_mov_ps(~underflow, exp_ps512(neg_abs));
        const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 numerator = _mm512_mask_mul_ps(x, negative, x, e);
        _mm512_storeu_ps(v + i, _mm512_div_ps(numerator, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        const __m256 neg_abs = _mm256_or_ps(x, sign);
        const __m256 underflow = _mm256_cmp_ps(neg_abs, _mm256_set1_ps(EXP_LOWEST), _CMP_LT_OQ);
        const __m256 e = _mm256_andnot_ps(underflow, exp_ps256(neg_abs));
        const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 numerator = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), negative);
        _mm256_storeu_ps(v + i, _mm256_div_ps(numerator, _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    }
#endif
    for (; i < n; ++i) v[i] = v[i] / (1.0f + expf(-v[i]));
}

/* The MLP's activation on the fused gate_up projection, in place: for each of `rows` rows
 * (row stride ld) of [gate (inter) | up (inter)], gate = SiLU(gate) * up; the result is the gate
 * half, the down projection's input. What F.silu(gate, inplace=True).mul_(up) did in two
 * passes (and, in bfloat16, two dispatches with a conversion each) over the step's activations. */
static void silu_and_mul_row_f32(float *restrict gate, int64_t inter) {
    const float *up = gate + inter;
    silu_in_place(gate, inter);
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) gate[i] *= up[i];
}

/* bfloat16: SiLU rounded to bfloat16, then the product rounded (torch's two ops' roundings). */
#define SILU_CHUNK 256
static void silu_and_mul_row_bf16(bf16_t *restrict gate, int64_t inter) {
    const bf16_t *up = gate + inter;
    float wide[SILU_CHUNK];
    for (int64_t c0 = 0; c0 < inter; c0 += SILU_CHUNK) {
        const int64_t n = inter - c0 < SILU_CHUNK ? inter - c0 : SILU_CHUNK;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) wide[i] = bf16_to_f32(gate[c0 + i]);
        silu_in_place(wide, n);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) gate[c0 + i] = f32_to_bf16(round_bf16(wide[i]) * bf16_to_f32(up[c0 + i]));
    }
}

/* A prefill's rows are shared out to torch's OpenMP threads. A decode step's few stay on this
 * thread outside any parallel region (an `if (0)` region still has libgomp start a team of one,
 * between the matmuls' teams of every thread). One definition for both dtypes: */
#define SILU_PARALLEL_ELEMENTS (1 << 16)
#define DEFINE_SILU_AND_MUL(SUFFIX, T)                                                                   \
    void silu_and_mul_##SUFFIX(T *restrict x, int64_t rows, int64_t inter, int64_t ld, int num_threads) { \
        if (rows * inter < SILU_PARALLEL_ELEMENTS || num_threads <= 1) {                                 \
            for (int64_t r = 0; r < rows; ++r) silu_and_mul_row_##SUFFIX(x + r * ld, inter);             \
            return;                                                                                      \
        }                                                                                                \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                            \
        for (int64_t r = 0; r < rows; ++r) silu_and_mul_row_##SUFFIX(x + r * ld, inter);                 \
    }
DEFINE_SILU_AND_MUL(f32, float)
DEFINE_SILU_AND_MUL(bf16, bf16_t)
