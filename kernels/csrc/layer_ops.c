/* The small per-layer ops of a decoder step, fused, float32, for CPU.
 *
 * Why: at serving batch sizes each of these touches a few tens of KB, so as torch ops they
 * cost their dispatch and thread fork/join (~50 us for an rms_norm of 16 x 576), not their
 * arithmetic; a 16-sequence SmolLM2 step spent ~8 ms in them. Each function here does in
 * one single-threaded pass what took 2-6 torch ops. The references they are tested against
 * are torch code: RMSNorm and apply_rope in backend/model.py, reshape_and_cache_reference in
 * kernels/reference.py (tests/test_layer_ops.py).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

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
