/* Decode attention over the paged KV cache, float32, for CPU.
 *
 * One query token per sequence (the decode rows of a step). Each sequence is one task: it
 * walks its blocks through the block table and reads every K and V element exactly once,
 * straight from the cache, in address order: no gathered copy, no K/V repeated per query
 * head (the query heads of a GQA group read the same K/V row). Tasks run on OpenMP threads; the
 * library links libgomp.so.1, which resolves to the runtime torch already loaded, so it
 * shares torch's thread pool instead of starting a second one.
 *
 * Layout (kernels/reference.py is the spec):
 *   query, out:   [num_tokens, num_heads, head_dim]; sequence i's row is rows[i]
 *   key/value:    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables: [num_seqs, block_table_stride] int32
 * Scores and softmax in float32, like the reference.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* One sequence, all its heads: tokens are visited in cache order, so each token's K (then
 * V) row of num_kv_heads * head_dim floats is read contiguously, a block at a time. */
static void attend_sequence(const float *restrict q, float *restrict out, const int32_t *restrict table,
                            int64_t seq_len, const float *restrict key_cache, const float *restrict value_cache,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, float *restrict scores /* [num_heads * seq_len] */) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    for (int64_t t = 0; t < seq_len; ++t) {
        const float *k = key_cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h)
            scores[h * seq_len + t] = dot(q + h * head_dim, k + (h / group) * head_dim, head_dim) * scale;
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        float *s = scores + h * seq_len;
        float max = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < seq_len; ++t) max = s[t] > max ? s[t] : max;
        for (int64_t t = 0; t < seq_len; ++t) {
            s[t] = expf(s[t] - max);
            total += s[t];
        }
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < seq_len; ++t) s[t] *= inv;
        memset(out + h * head_dim, 0, sizeof(float) * head_dim);
    }
    for (int64_t t = 0; t < seq_len; ++t) {
        const float *v = value_cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
            const float p = scores[h * seq_len + t];
            const float *vh = v + (h / group) * head_dim;
            float *o = out + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) o[i] += p * vh[i];
        }
    }
}

/* Returns 0, or -1 when a scratch allocation failed (the caller raises). */
int paged_decode_attention_f32(const float *query, float *out, const int64_t *rows, const int64_t *seq_lens,
                               const int32_t *block_tables, int64_t block_table_stride, const float *key_cache,
                               const float *value_cache, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t seq_len = seq_lens[s];
        float *scores = malloc(sizeof(float) * num_heads * seq_len);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const int64_t offset = rows[s] * num_heads * head_dim;
        attend_sequence(query + offset, out + offset, block_tables + s * block_table_stride, seq_len, key_cache,
                        value_cache, num_heads, num_kv_heads, head_dim, block_size, scale, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
