/* Decode attention over the paged KV cache, float32 or bfloat16, for CPU.
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
 *
 * bfloat16 (query, out and caches all bfloat16) runs the same arithmetic in float32, as the
 * reference does after its .float(): a bfloat16 is the top half of a float32, so widening is
 * a 16-bit shift, exact and cheap. The query is widened once per sequence, K is widened in
 * registers inside the q.k product, each V row is widened into a small buffer before the
 * heads accumulate it, and the output is rounded back once, to nearest even like torch's
 * .to(bfloat16). Reading the pages directly matters most here: the fallback this replaces
 * gathered every sequence's whole context into a float32 copy per layer and step.
 *
 * The bfloat16 q.k product has AVX-512F and AVX2 versions (whichever the compiler targets,
 * -march=native) and a plain C loop for anything else and for head_dim tails. With gcc's
 * own vectorisation of that loop instead, the whole bfloat16 kernel took clearly longer; the
 * AVX2 version measured close to the AVX-512 one.
 * Where the compiler targets AVX512_BF16 (the CPUs where dtype=auto picks bfloat16) and
 * head_dim is 32, 64 or 128, bfloat16 decode takes attend_sequence_dp below instead: dot
 * products on the bfloat16 values as stored, 16 tokens' sums reduced at once and the V rows of
 * a GQA group widened once (much faster than this path with the cache in L3, less so from
 * DRAM). Swapping _mm512_dpbf16_ps into this path alone had measured only slightly faster:
 * the per-score horizontal sums and per-head re-reads, not the products, were the cost.
 * Every build with AVX2 + FMA (AVX-512 ones too, where the dot-product path does not apply)
 * takes attend_sequence_avx2 instead, both dtypes, where head_dim is a
 * multiple of 8: 8 tokens' scores reduced at once and outputs kept in registers over the tokens
 * (faster than attend_sequence in both dtypes with the cache in L3; streaming 30 layers' caches
 * from DRAM, faster in bfloat16 and no change in float32, which is held by the memory side:
 * docs/benchmarks.md).
 * attention_path() says which function a build runs.
 *
 * Sliding windows and attention sinks (decode and prefill, every path): a query at position p
 * with a window of W keys (W > 0; 0 = no window) sees keys p - W + 1 .. p. Key loops start at
 * the first key in the window, never before it: the engine releases the KV blocks wholly
 * before a sequence's window, and their block-table entries then point at a block that may
 * hold anything (NaN included), so even a masked read could leak into the sums. A sink (one
 * float32 logit per query head, or sinks NULL) joins each row's softmax beside its scaled
 * scores (it is not scaled) and has no value vector: it adds exp(sink - max) to the
 * denominator only. With window 0 and sinks NULL every path does exactly the arithmetic it
 * did before it took them.
 *
 * Logit soft-capping (Gemma 2; decode and prefill, every path): with softcap != 0 each scaled
 * score s becomes softcap * tanh(s / softcap) before the mask, the sinks and the maximum;
 * softcap 0 is off, and then every path runs the code it ran before (soft_cap below says how).
 * The exported functions of before keep their arguments (decoder.c calls them) and run
 * uncapped; paged_{decode,prefill}_attention_softcap_{f32,bf16} take softcap before num_threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "bf16.h"
#include "vec_exp.h"

/* Builds with AVX2 + FMA have decode and prefill functions of their own; a build with
 * -DLLM_GENERIC_ATTENTION keeps only the generic ones (benchmarks/cpu_attention.py compares the
 * two builds). AVX-512 builds take them too, for float32 and for bfloat16 without AVX512_BF16:
 * on a CPU with AVX-512 their prefill ran well ahead of the generic function's 512-bit code,
 * and their decode about even with it (a little ahead in float32, a little behind in
 * bfloat16; docs/benchmarks.md).
 * attention_path() below is the one rule for which function runs. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(LLM_GENERIC_ATTENTION)
#define AVX2_ATTENTION 1
#else
#define AVX2_ATTENTION 0
#endif

/* How far ahead of the token being read its K or V row is prefetched. A sequence's blocks
 * can sit anywhere in the cache (they do once a server has freed and reused blocks for a
 * while), and the hardware prefetcher loses the stream at every block boundary: with
 * scattered blocks, asking for the row 8 tokens ahead made the kernel much faster at
 * 300-1000-token contexts (4, 8 and 16 within noise of each other);
 * with consecutive blocks it changes nothing. */
#define PREFETCH_TOKENS 8

static inline __attribute__((always_inline)) void widen(const bf16_t *restrict src, float *restrict dst, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

/* Forced inline (as dot_bf16, widen and attend_sequence): with both dtypes in one
 * attend_sequence gcc stopped inlining it, and a call per token and head cost noticeably. */
static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* Floats per vector in dot_bf16 as compiled: 16 (AVX-512F), 8 (AVX2 + FMA) or 1 (plain C).
 * Lets the tests check that each build they make was compiled as they mean. Which decode and
 * prefill functions run is attention_path()'s answer: on AVX-512 builds the generic ones (and
 * so this dot_bf16) only for head sizes that are not a multiple of 8. */
int decode_attention_bf16_vector_width(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 1;
#endif
}

/* q . k over n elements: q float32, k bfloat16 straight from the page, widened in registers
 * (zero-extend each 16-bit value to 32 bits, shift it into the top half). */
static inline __attribute__((always_inline)) float dot_bf16(const float *restrict q, const bf16_t *restrict k,
                                                            int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + i))), 16);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_castsi512_ps(bits), acc);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(k + i))), 16);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_castsi256_ps(bits), acc);
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    sum = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#else
    /* No vector version for this target: the whole product is the loop below, which gcc
     * vectorises when told it may reorder the sum. (Elsewhere it is a short scalar tail.) */
#pragma omp simd reduction(+ : sum)
#endif
    for (int64_t j = i; j < n; ++j) sum += q[j] * bf16_to_f32(k[j]);
    return sum;
}

/* exp_ps512 / exp_ps256: vec_exp.h. */

/* s <- softmax(s), in place, float32. ``sink``: NULL, or a logit that joins the maximum and the
 * denominator but has no entry in s (an attention sink: probability mass with no value). */
static inline __attribute__((always_inline)) void softmax(float *restrict s, int64_t n, const float *sink) {
    float max = -INFINITY, total = 0.0f;
    int64_t t = 0;
#if defined(__AVX512F__)
    /* The maximum is exact in any order; gcc leaves the scalar loop scalar. A NaN score is
     * passed over as there (max_ps returns its second operand when either is NaN). */
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(_mm512_loadu_ps(s + t), vmax);
    max = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__) && defined(__FMA__)
    /* The same in 8 lanes: the scalar loop is one dependent compare a score (a measurable
     * share of a decode call at 512-token contexts). */
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(s + t), vmax);
    float lane_max[8];
    _mm256_storeu_ps(lane_max, vmax);
    for (int i = 0; i < 8; ++i) max = lane_max[i] > max ? lane_max[i] : max;
#endif
    for (; t < n; ++t) max = s[t] > max ? s[t] : max;
    if (sink != NULL && *sink > max) max = *sink;
    t = 0;
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        const __m512 e = exp_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(max)));
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 sum = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp_ps256(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(max)));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; ++i) total += lanes[i];
#endif
    for (; t < n; ++t) {
        s[t] = expf(s[t] - max);
        total += s[t];
    }
    if (sink != NULL) total += expf(*sink - max);
    const float inv = 1.0f / total;
    for (t = 0; t < n; ++t) s[t] *= inv;
}

/* ---- logit soft-capping (Gemma 2): s <- softcap * tanh(s / softcap) ----------------------
 *
 * On the scaled scores, before the mask, the sinks and the maximum (kernels/reference.py), only
 * where softcap != 0 (0: off). Every caller asks that once, outside its loops over keys: the
 * decode functions cap the whole score array between the q.k pass and the softmax, and the
 * prefill task functions are compiled twice, capped and not, with the choice a constant
 * (CAPPED), so without a cap each path does exactly the arithmetic (and runs the very code) it
 * did before it took one.
 *
 * tanh as vector code, Cephes' tanhf: for |x| < 0.625 x + x^3 P(x^2) (degree 4 in x^2),
 * otherwise (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.29 (no cancellation; exp_ps*'s clamp at
 * -87.3 makes it exactly 1 from |x| ~ 44 on, where tanhf is 1 in float32 too), the sign of x put
 * back: within a few ulp of tanhf (tests/test_attention_softcap.py checks it against torch.tanh
 * over the whole range). A NaN stays NaN (it takes the polynomial). s / softcap is taken as
 * s * (1 / softcap) there (one rounding more). Builds without AVX2 + FMA call tanhf per score
 * (correct, slower). */
#define TANH_SMALL 0.625f
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 tanh_ps512(__m512 x) {
    const __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    const __m512 e = exp_ps512(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    const __m512 signed_large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(large), sign));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(TANH_SMALL), _CMP_GE_OQ), small, signed_large);
}

/* softcap * tanh(s * inv), inv = 1 / softcap: one vector of scores capped. */
static inline __attribute__((always_inline)) __m512 cap_ps512(__m512 s, __m512 inv, __m512 softcap) {
    return _mm512_mul_ps(softcap, tanh_ps512(_mm512_mul_ps(s, inv)));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)   /* AVX-512 builds too: the AVX2 prefill function uses it */
static inline __attribute__((always_inline)) __m256 tanh_ps256(__m256 x) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign_bit, x), z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 e = exp_ps256(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 large = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                                      _mm256_and_ps(x, sign_bit));
    return _mm256_blendv_ps(small, large, _mm256_cmp_ps(a, _mm256_set1_ps(TANH_SMALL), _CMP_GE_OQ));
}

static inline __attribute__((always_inline)) __m256 cap_ps256(__m256 s, __m256 inv, __m256 softcap) {
    return _mm256_mul_ps(softcap, tanh_ps256(_mm256_mul_ps(s, inv)));
}
#endif

/* s[0:n] <- softcap * tanh(s / softcap), in place (softcap != 0). */
static inline void soft_cap(float *restrict s, int64_t n, float softcap) {
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 inv = _mm512_set1_ps(1.0f / softcap), cap = _mm512_set1_ps(softcap);
    for (; t + 16 <= n; t += 16) _mm512_storeu_ps(s + t, cap_ps512(_mm512_loadu_ps(s + t), inv, cap));
    if (t < n) {   /* the tail through the same function, masked */
        const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
        _mm512_mask_storeu_ps(s + t, tail, cap_ps512(_mm512_maskz_loadu_ps(tail, s + t), inv, cap));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 inv = _mm256_set1_ps(1.0f / softcap), cap = _mm256_set1_ps(softcap);
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, cap_ps256(_mm256_loadu_ps(s + t), inv, cap));
    if (t < n) {   /* the tail through the same function, via a buffer */
        float tail[8] = {0};
        memcpy(tail, s + t, sizeof(float) * (size_t)(n - t));
        _mm256_storeu_ps(tail, cap_ps256(_mm256_loadu_ps(tail), inv, cap));
        memcpy(s + t, tail, sizeof(float) * (size_t)(n - t));
    }
#else
    for (; t < n; ++t) s[t] = softcap * tanhf(s[t] / softcap);   /* scalar tanhf: no vector version here */
#endif
}

/* soft_cap as this build compiled it, for the tests (its accuracy over the whole range). */
void attention_soft_cap(float *s, int64_t n, float softcap) { soft_cap(s, n, softcap); }

/* Element offset of token t's row (num_kv_heads * head_dim elements) in a K or V cache. */
/* The keys of a prefill block (keys j0 .. j0 + keys - 1) that tile row r may see: [*hidden,
 * *visible), from its query's position (row r is query i0 + r / group, after context_len cached
 * tokens; rows past real_rows see none), causality and its window (0: every key). */
static inline void row_key_range(int64_t r, int64_t real_rows, int64_t group, int64_t context_len, int64_t i0,
                                 int64_t j0, int64_t keys, int64_t window, int *visible, int *hidden) {
    int64_t v = r < real_rows ? context_len + i0 + r / group - j0 + 1 : 0;
    v = v < 0 ? 0 : v > keys ? keys : v;
    int64_t before = r < real_rows && window > 0 ? context_len + i0 + r / group - window + 1 - j0 : 0;
    before = before < 0 ? 0 : before > v ? v : before;
    *visible = (int)v;
    *hidden = (int)before;
}

static inline int64_t token_offset(const int32_t *table, int64_t t, int64_t block_size, int64_t token_stride) {
    return ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride;
}

/* offsets[t - first] = token_offset(table, t, ...) for tokens first .. end - 1 of a sequence (the
 * keys a decode query sees), without a division per token: the decode functions below look a
 * row up several times (once per pass over the heads, once more to prefetch it), and a 64-bit
 * division by the runtime block size costs more than the row's arithmetic at short contexts. */
static inline void row_offsets(const int32_t *restrict table, int64_t first, int64_t end, int64_t block_size,
                               int64_t token_stride, int64_t *restrict offsets) {
    for (int64_t t = first, block = first / block_size, slot = first % block_size; t < end; ++t) {
        offsets[t - first] = ((int64_t)table[block] * block_size + slot) * token_stride;
        if (++slot == block_size) slot = 0, ++block;
    }
}

static inline void prefetch_token(const void *cache, int64_t element_size, const int32_t *table, int64_t t,
                                  int64_t seq_len, int64_t block_size, int64_t token_stride) {
    if (t >= seq_len) return;     /* the table holds nothing readable past the sequence */
    const char *row = (const char *)cache + token_offset(table, t, block_size, token_stride) * element_size;
    for (int64_t byte = 0; byte < token_stride * element_size; byte += 64) __builtin_prefetch(row + byte);
}

#if defined(__AVX512F__)
#define MAX_HEAD_VECTORS 8   /* head_dim up to 128 in registers */
/* out[0:head_dim] = sum over t in [first, seq_len) of p[t - first] * V[t] (one head; V at
 * ``head_offset`` in each token's row): the head's output stays in registers for the whole pass,
 * where the generic loop below reloads and stores it for every token. */
static inline __attribute__((always_inline)) void weighted_values_avx512(
        const float *restrict p, float *restrict out, const int32_t *restrict table, int64_t first, int64_t seq_len,
        const void *value_cache, int is_bf16, int64_t head_offset, int64_t head_dim, int64_t block_size,
        int64_t token_stride) {
    __m512 acc[MAX_HEAD_VECTORS];
    const int64_t vectors = head_dim / 16;
    for (int64_t j = 0; j < MAX_HEAD_VECTORS; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t t = first; t < seq_len; ++t) {
        const int64_t row = token_offset(table, t, block_size, token_stride) + head_offset;
        const __m512 weight = _mm512_set1_ps(p[t - first]);
        for (int64_t j = 0; j < vectors; ++j) {
            __m512 v;
            if (is_bf16) {
                const bf16_t *src = (const bf16_t *)value_cache + row + 16 * j;
                v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
            } else {
                v = _mm512_loadu_ps((const float *)value_cache + row + 16 * j);
            }
            acc[j] = _mm512_fmadd_ps(weight, v, acc[j]);
        }
    }
    for (int64_t j = 0; j < vectors; ++j) _mm512_storeu_ps(out + 16 * j, acc[j]);
}
#endif

/* One sequence, all its heads: tokens are visited in cache order, so each token's K (then
 * V) row of num_kv_heads * head_dim elements is read contiguously, a block at a time. Keys
 * ``first`` .. seq_len - 1 (the window; 0 without one); ``sinks``: NULL or one per query head.
 * q and out: [num_heads * head_dim] float32 (widened / still to be rounded for bfloat16).
 * ``is_bf16`` is a constant at each call site below, so the compiler keeps one branch-free
 * copy per dtype; the float32 one does exactly the arithmetic it did before bfloat16. */
static inline __attribute__((always_inline)) void attend_sequence(
        const float *restrict q, float *restrict out, const int32_t *restrict table, int64_t first, int64_t seq_len,
        const void *key_cache, const void *value_cache, int is_bf16, int64_t num_heads, int64_t num_kv_heads,
        int64_t head_dim, int64_t block_size, float scale, const float *sinks, float softcap,
        float *restrict scores /* [num_heads * (seq_len - first)] */,
        float *restrict v_row /* [num_kv_heads * head_dim], bfloat16 only */) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t element_size = is_bf16 ? sizeof(bf16_t) : sizeof(float);
    const int64_t n = seq_len - first;                 /* keys seen; score t - first is key t's */
    for (int64_t t = first; t < seq_len; ++t) {
        prefetch_token(key_cache, element_size, table, t + PREFETCH_TOKENS, seq_len, block_size, token_stride);
        const int64_t row = token_offset(table, t, block_size, token_stride);
        for (int64_t h = 0; h < num_heads; ++h) {
            const int64_t k = row + (h / group) * head_dim;
            const float qk = is_bf16 ? dot_bf16(q + h * head_dim, (const bf16_t *)key_cache + k, head_dim)
                                     : dot(q + h * head_dim, (const float *)key_cache + k, head_dim);
            scores[h * n + t - first] = qk * scale;
        }
    }
    if (softcap != 0.0f) soft_cap(scores, num_heads * n, softcap);
    for (int64_t h = 0; h < num_heads; ++h) softmax(scores + h * n, n, sinks == NULL ? NULL : sinks + h);
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && head_dim <= 16 * MAX_HEAD_VECTORS) {
        for (int64_t h = 0; h < num_heads; ++h)
            weighted_values_avx512(scores + h * n, out + h * head_dim, table, first, seq_len, value_cache, is_bf16,
                                   (h / group) * head_dim, head_dim, block_size, token_stride);
        return;
    }
#endif
    for (int64_t h = 0; h < num_heads; ++h) memset(out + h * head_dim, 0, sizeof(float) * head_dim);
    for (int64_t t = first; t < seq_len; ++t) {
        prefetch_token(value_cache, element_size, table, t + PREFETCH_TOKENS, seq_len, block_size, token_stride);
        const int64_t row = token_offset(table, t, block_size, token_stride);
        const float *v = (const float *)value_cache + row;
        if (is_bf16) {
            /* Widened once for the whole GQA group (num_heads / num_kv_heads heads read it). */
            widen((const bf16_t *)value_cache + row, v_row, token_stride);
            v = v_row;
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            const float p = scores[h * n + t - first];
            const float *vh = v + (h / group) * head_dim;
            float *o = out + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) o[i] += p * vh[i];
        }
    }
}

#if AVX2_ATTENTION
/* ---- decode on AVX2 + FMA builds (float32 or bfloat16 pages, head_dim a multiple of 8) ----------
 *
 * attend_sequence took a large share of a float32 decode step (16 sequences of ~512 tokens):
 * per token and head, a gcc-vectorised dot product ending in a horizontal sum, then an output
 * row loaded and stored again for every token. Here:
 *   - scores: K read row by row in memory order, each chunk of a KV head loaded once for the
 *     heads of its group; 8 tokens' lanes per head, then one transpose-and-add gives the 8
 *     scores in one vector (reduce_8; decode_scores_avx2 says why in this order);
 *   - P x V: per KV head, up to 3 of its query heads x 32 columns of output stay in 12
 *     registers for the whole pass over the tokens, each V vector loaded once for them.
 * Summation orders differ from attend_sequence's; both are float32 throughout. */
#define DECODE_TOKENS 8          /* tokens whose scores one reduce_8 gives */
#define DECODE_HEADS 3           /* query heads of a KV head accumulated together */
#define DECODE_VECTORS 4         /* 32 columns: 3 x 4 accumulators */

/* 8 floats from a K or V row, widened if bfloat16. */
static inline __attribute__((always_inline)) __m256 load8(const void *cache, int is_bf16, int64_t at) {
    if (!is_bf16) return _mm256_loadu_ps((const float *)cache + at);
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16_t *)cache + at)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Lane u of the result = the sum of the 8 lanes of a[u]. */
static inline __attribute__((always_inline)) __m256 reduce_8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [a0..a3 sums of lanes 0-3 | the same of lanes 4-7]; s4567 likewise for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* partial[h][u] (8 lanes) = the lanes of q_h[d0 : d0 + 8 * nv] * K_t[d0 : ...] summed over the
 * chunk (added to what earlier chunks of the head left, d0 > 0), for every query head of KV head
 * g: the chunk's nv K vectors are loaded once, into registers, for the group's heads. */
static inline __attribute__((always_inline)) void scores_chunk(
        const int nv, const float *restrict q, const void *key_cache, int is_bf16, int64_t at, int64_t h0,
        int64_t group, int64_t head_dim, int64_t d0, int u, float *restrict partial) {
    __m256 k[8];
    _Pragma("GCC unroll 8") for (int i = 0; i < nv; ++i) k[i] = load8(key_cache, is_bf16, at + 8 * i);
    for (int64_t h = h0; h < h0 + group; ++h) {
        const float *qh = q + h * head_dim + d0;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();   /* two chains: half the latency */
        _Pragma("GCC unroll 8") for (int i = 0; i < nv; ++i) {
            if (i % 2 == 0) even = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), k[i], even);
            else odd = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), k[i], odd);
        }
        float *lanes = partial + (h * DECODE_TOKENS + u) * 8;
        __m256 sum = _mm256_add_ps(even, odd);
        if (d0 > 0) sum = _mm256_add_ps(sum, _mm256_loadu_ps(lanes));
        _mm256_storeu_ps(lanes, sum);
    }
}

/* scores[h * seq_len + t] = scale * q_h . K_t, every head and token of one sequence; ``partial``:
 * scratch of num_heads * DECODE_TOKENS * 8 floats.
 *
 * The K rows are read whole, one after the other, in the order they lie in memory (and the row
 * PREFETCH_TOKENS ahead asked for whole): each row's KV heads in turn, each chunk of 8 vectors
 * of a KV head loaded once for the heads of its group, a head's 8 lanes per token kept in
 * ``partial`` until 8 tokens are done, then one transpose-and-add (reduce_8) gives their 8
 * scores. The version before walked 8 rows at once, head by head (the query loaded once for
 * them, the lanes summed in registers): per token it touched the row's first 256 bytes, then
 * the next 8 rows' first 256, and only later the rest, which kept the memory from streaming:
 * from DRAM it read K well below the pace of a plain read of the same rows (16 sequences x
 * ~650 tokens x 30 layers, blocks scattered). Read row by row it comes close to that pace; in
 * cache it is slower (more loads of q), where attention is a small share of a step
 * (docs/benchmarks.md, "Decode attention reading K row by row"). */
static inline __attribute__((always_inline)) void decode_scores_avx2(
        const float *restrict q, const int64_t *restrict offsets, int64_t seq_len, const void *key_cache, int is_bf16,
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale, float *restrict scores,
        float *restrict partial) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t element_size = is_bf16 ? sizeof(bf16_t) : sizeof(float);
    const __m256 scale_v = _mm256_set1_ps(scale);
    for (int64_t t0 = 0; t0 < seq_len; t0 += DECODE_TOKENS) {
        const int64_t n = seq_len - t0 < DECODE_TOKENS ? seq_len - t0 : DECODE_TOKENS;
        for (int u = 0; u < DECODE_TOKENS; ++u) {
            if (u >= n) {   /* past the sequence: lanes of zeros, their scores dropped below */
                for (int64_t h = 0; h < num_heads; ++h)
                    _mm256_storeu_ps(partial + (h * DECODE_TOKENS + u) * 8, _mm256_setzero_ps());
                continue;
            }
            const int64_t t = t0 + u;
            if (t + PREFETCH_TOKENS < seq_len) {
                const char *ahead = (const char *)key_cache + offsets[t + PREFETCH_TOKENS] * element_size;
                for (int64_t byte = 0; byte < token_stride * element_size; byte += 64) __builtin_prefetch(ahead + byte);
            }
            for (int64_t g = 0; g < num_kv_heads; ++g) {
                const int64_t at = offsets[t] + g * head_dim;
                int64_t d0 = 0;
                for (; d0 + 64 <= head_dim; d0 += 64)
                    scores_chunk(8, q, key_cache, is_bf16, at + d0, g * group, group, head_dim, d0, u, partial);
                for (; d0 < head_dim; d0 += 8)   /* head sizes that are not a multiple of 64 */
                    scores_chunk(1, q, key_cache, is_bf16, at + d0, g * group, group, head_dim, d0, u, partial);
            }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            __m256 lanes[DECODE_TOKENS];
            _Pragma("GCC unroll 8") for (int u = 0; u < DECODE_TOKENS; ++u)
                lanes[u] = _mm256_loadu_ps(partial + (h * DECODE_TOKENS + u) * 8);
            const __m256 sums = _mm256_mul_ps(reduce_8(lanes), scale_v);
            if (n == DECODE_TOKENS) {
                _mm256_storeu_ps(scores + h * seq_len + t0, sums);
            } else {   /* gcc turned a copy loop for every group into rep movs: the tail only */
                float tail[DECODE_TOKENS];
                _mm256_storeu_ps(tail, sums);
                for (int64_t u = 0; u < n; ++u) scores[h * seq_len + t0 + u] = tail[u];
            }
        }
    }
}

/* out[h][d0 : d0 + 8 * nv] = sum over t of p_h[t] * V_t for nh (<= 3) heads h0.. of KV head g. */
static inline __attribute__((always_inline)) void decode_values_avx2(
        const int nh, const int nv, const float *restrict scores, float *restrict out, int64_t h0,
        const int64_t *restrict offsets, int64_t seq_len, const void *value_cache, int is_bf16, int64_t head_offset,
        int64_t head_dim, int64_t d0) {
    const int64_t element_size = is_bf16 ? sizeof(bf16_t) : sizeof(float);
    __m256 acc[DECODE_HEADS][DECODE_VECTORS];
    _Pragma("GCC unroll 3") for (int i = 0; i < nh; ++i)
        _Pragma("GCC unroll 4") for (int j = 0; j < nv; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < seq_len; ++t) {
        if (t + PREFETCH_TOKENS < seq_len) {   /* this pass reads 8 * nv elements of each token's row */
            const char *ahead = (const char *)value_cache + (offsets[t + PREFETCH_TOKENS] + head_offset + d0) * element_size;
            for (int64_t byte = 0; byte < 8 * nv * element_size; byte += 64) __builtin_prefetch(ahead + byte);
        }
        const int64_t at = offsets[t] + head_offset + d0;
        /* The weights first, then one V vector at a time: 12 accumulators + 3 weights + 1 V
         * vector are the 16 registers. Holding the 4 V vectors instead needs 17, and gcc then
         * kept an accumulator on the stack: a store and reload on every token's critical path
         * (a noticeable share of a decode call at 512 tokens). */
        __m256 p[DECODE_HEADS];
        _Pragma("GCC unroll 3") for (int i = 0; i < nh; ++i) p[i] = _mm256_broadcast_ss(scores + (h0 + i) * seq_len + t);
        _Pragma("GCC unroll 4") for (int j = 0; j < nv; ++j) {
            const __m256 v = load8(value_cache, is_bf16, at + 8 * j);
            _Pragma("GCC unroll 3") for (int i = 0; i < nh; ++i) acc[i][j] = _mm256_fmadd_ps(p[i], v, acc[i][j]);
        }
    }
    _Pragma("GCC unroll 3") for (int i = 0; i < nh; ++i)
        _Pragma("GCC unroll 4") for (int j = 0; j < nv; ++j) _mm256_storeu_ps(out + (h0 + i) * head_dim + d0 + 8 * j, acc[i][j]);
}

/* attend_sequence for AVX2 + FMA builds: same inputs and outputs; scratch: the scores, ``partial``
 * [num_heads * DECODE_TOKENS * 8] and ``offsets`` [seq_len - first]. The functions it calls see
 * only the window's keys, through ``offsets``: their ``seq_len`` is the window's key count. */
static inline __attribute__((always_inline)) void attend_sequence_avx2(
        const float *restrict q, float *restrict out, const int32_t *restrict table, int64_t first, int64_t seq_len,
        const void *key_cache, const void *value_cache, int is_bf16, int64_t num_heads, int64_t num_kv_heads,
        int64_t head_dim, int64_t block_size, float scale, const float *sinks, float softcap, float *restrict scores,
        float *restrict partial, int64_t *restrict offsets) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    row_offsets(table, first, seq_len, block_size, token_stride, offsets);
    seq_len -= first;
    decode_scores_avx2(q, offsets, seq_len, key_cache, is_bf16, num_heads, num_kv_heads, head_dim, scale, scores,
                       partial);
    if (softcap != 0.0f) soft_cap(scores, num_heads * seq_len, softcap);
    for (int64_t h = 0; h < num_heads; ++h) softmax(scores + h * seq_len, seq_len, sinks == NULL ? NULL : sinks + h);
    for (int64_t g = 0; g < num_kv_heads; ++g) {
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += DECODE_HEADS) {
            const int64_t nh = (g + 1) * group - h0 < DECODE_HEADS ? (g + 1) * group - h0 : DECODE_HEADS;
            for (int64_t d0 = 0; d0 < head_dim;) {
                const int wide = head_dim - d0 >= 8 * DECODE_VECTORS;
#define VALUES(NH, NV) decode_values_avx2(NH, NV, scores, out, h0, offsets, seq_len, value_cache, is_bf16, g * head_dim, \
                                          head_dim, d0)
                if (nh == 3) { if (wide) VALUES(3, 4); else VALUES(3, 1); }
                else if (nh == 2) { if (wide) VALUES(2, 4); else VALUES(2, 1); }
                else { if (wide) VALUES(1, 4); else VALUES(1, 1); }
#undef VALUES
                d0 += wide ? 8 * DECODE_VECTORS : 8;
            }
        }
    }
}
#endif

#if defined(__AVX512F__)
/* Lane i of the result = the sum (or, with take_max, the maximum) of the 16 lanes of v[i]. */
static inline __attribute__((always_inline)) __m512 reduce_lanes_16(const __m512 v[16], const int take_max) {
#define COMBINE(a, b) (take_max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b))
    __m512 pairs[8], quads[4], octs[2];
    /* [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit lane for a = v[2i], b = v[2i+1] */
    for (int i = 0; i < 8; ++i)
        pairs[i] = COMBINE(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* one 128-bit lane's sum of each of v[4i .. 4i+3], in that lane */
    for (int i = 0; i < 4; ++i)
        quads[i] = COMBINE(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* 128-bit lanes 0+1 and 2+3 of quads[2i] (v[8i .. 8i+3]), then of quads[2i+1] */
    for (int i = 0; i < 2; ++i)
        octs[i] = COMBINE(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return COMBINE(_mm512_shuffle_f32x4(octs[0], octs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                   _mm512_shuffle_f32x4(octs[0], octs[1], _MM_SHUFFLE(3, 1, 3, 1)));
#undef COMBINE
}

/* One key block's step of 16 rows' running maxima (online softmax), the prefill functions' shared
 * piece: row i's maximum becomes the larger of row_max[i] and lane i of block_max, except where
 * that lane is -inf (the row sees no key of the block and keeps its state). The new maxima go to
 * row_max and to new_max, the factor each row's earlier sum and output are scaled by (exp(old -
 * new), 1 where the row keeps its state) to correction, and is returned. */
static inline __attribute__((always_inline)) __m512 online_max_step(const __m512 block_max, float *row_max,
                                                                    float *new_max, float *correction) {
    const __m512 old_max = _mm512_loadu_ps(row_max);
    const __mmask16 live = _mm512_cmp_ps_mask(block_max, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
    const __m512 top = _mm512_mask_max_ps(old_max, live, old_max, block_max);
    const __m512 scale_old = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), live, exp_ps512(_mm512_sub_ps(old_max, top)));
    _mm512_storeu_ps(row_max, top);
    _mm512_storeu_ps(new_max, top);
    _mm512_storeu_ps(correction, scale_old);
    return scale_old;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* ---- bfloat16 decode with AVX512_BF16 dot products ----------------------------------------
 *
 * attend_sequence spends most of its time on bookkeeping, not arithmetic: per token and query
 * head it widens the K row again, reduces a 16-lane vector to one score (a horizontal sum of ~8
 * dependent shuffles and adds), and finds the token's row with an integer division; the V pass
 * widens each V row again for every head of its group. Here:
 *   - each token's row offset is found once per sequence (a walk over the block table);
 *   - q.k takes the bfloat16 query and K as they are, 32 elements per _mm512_dpbf16_ps (each
 *     product of two bfloat16 is exact in float32, sums in float32, as the widening path);
 *   - the scores of 16 tokens are reduced together (reduce_lanes_16: 45 shuffles and adds for 16
 *     sums instead of ~8 per sum), a chunk at a time for every head, so a chunk's K rows are read
 *     from memory once and from L1 by the other heads;
 *   - the V pass runs the heads of a GQA group together: each V row is loaded and widened once
 *     (even and odd elements by a shift and a mask, no shuffles) for all of them.
 * The dot product treats bfloat16 subnormals (below ~1e-38) as zero; nothing else differs from
 * the reference's float32 arithmetic but the order of the sums. head_dim 32, 64 or 128 takes
 * this path; other sizes take attend_sequence. */
#define DP_MAX_VECTORS 4      /* 512-bit vectors of 32 bfloat16 per head row: head_dim <= 128 */
#define SCORE_CHUNK 16        /* tokens scored together: one vector of results */
/* Prefetch distances, in chunks for K and tokens for V. 16-token blocks scattered over the cache
 * (as a server's are once blocks are freed and reused) defeat the hardware prefetcher; these
 * were the best of 1-8 chunks and 16-128 tokens (and of L2 or non-temporal hints), all close to
 * each other but for no V prefetch (slower). */
#define PREFETCH_K_CHUNKS 2
#define PREFETCH_V_TOKENS 32

int decode_attention_bf16_dot_product(void) { return 1; }


/* scores[h * seq_len + t] = scale * q_h . K_t for every head h and token t. VEC: head_dim / 32,
 * a constant at each call site. */
static inline __attribute__((always_inline)) void scores_dp(
        const int VEC, const bf16_t *restrict q, const int64_t *restrict offsets, int64_t seq_len,
        const bf16_t *restrict key_cache, int64_t num_heads, int64_t group, int64_t head_dim, int64_t token_stride,
        float scale, float *restrict scores, bf16_t *restrict chunk /* [SCORE_CHUNK][token_stride] */) {
    for (int64_t t0 = 0; t0 < seq_len; t0 += SCORE_CHUNK) {
        const int64_t n = seq_len - t0 < SCORE_CHUNK ? seq_len - t0 : SCORE_CHUNK;
        const int64_t at = t0 + PREFETCH_K_CHUNKS * SCORE_CHUNK;
        const int64_t ahead = seq_len - at < SCORE_CHUNK ? seq_len - at : SCORE_CHUNK;
        for (int64_t i = 0; i < ahead; ++i) {          /* a later chunk's rows, every KV head */
            const char *row = (const char *)(key_cache + offsets[at + i]);
            for (int64_t byte = 0; byte < token_stride * (int64_t)sizeof(bf16_t); byte += 64)
                __builtin_prefetch(row + byte);
        }
        /* The heads below read a row 128 bytes at a time, KV head after KV head; copying the
         * chunk's rows first, in address order, made the K pass faster (the same copy of
         * V rows for the V pass measured no gain). */
        for (int64_t i = 0; i < n; ++i)
            memcpy(chunk + i * token_stride, key_cache + offsets[t0 + i], sizeof(bf16_t) * token_stride);
        for (int64_t h = 0; h < num_heads; ++h) {
            const bf16_t *k0 = chunk + (h / group) * head_dim;
            __m512bh qv[DP_MAX_VECTORS];
            for (int j = 0; j < VEC; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + h * head_dim + 32 * j);
            __m512 acc[SCORE_CHUNK];
            _Pragma("GCC unroll 16") for (int i = 0; i < SCORE_CHUNK; ++i) {
                acc[i] = _mm512_setzero_ps();
                if (i < n) {
                    const bf16_t *k = k0 + i * token_stride;
                    for (int j = 0; j < VEC; ++j)
                        acc[i] = _mm512_dpbf16_ps(acc[i], qv[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
                }
            }
            const __mmask16 keep = n == SCORE_CHUNK ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
            _mm512_mask_storeu_ps(scores + h * seq_len + t0, keep,
                                  _mm512_mul_ps(reduce_lanes_16(acc, 0), _mm512_set1_ps(scale)));
        }
    }
}

/* out[h] = sum over t of p_h[t] * V_t for HEADS heads of one KV group at once (p_h = scores
 * row h). A V row's 32-element vector j holds element pairs; as 32-bit lanes, a left shift by
 * 16 gives the even elements as float32 and a mask the odd ones: the sums are kept split that
 * way and put back in order at the end. */
static inline __attribute__((always_inline)) void values_dp(
        const int VEC, const int HEADS, const float *restrict p, int64_t seq_len, const int64_t *restrict offsets,
        const bf16_t *restrict v0, int64_t head_dim, float *restrict out, const bf16_t *prefetch_rows, int64_t row_bytes) {
    __m512 even[3][DP_MAX_VECTORS], odd[3][DP_MAX_VECTORS];
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int h = 0; h < HEADS; ++h)
        for (int j = 0; j < VEC; ++j) even[h][j] = odd[h][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < seq_len; ++t) {
        if (prefetch_rows && t + PREFETCH_V_TOKENS < seq_len) {
            const char *row = (const char *)(prefetch_rows + offsets[t + PREFETCH_V_TOKENS]);
            for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte);
        }
        const bf16_t *v = v0 + offsets[t];
        for (int j = 0; j < VEC; ++j) {
            const __m512i pair = _mm512_loadu_si512(v + 32 * j);
            const __m512 e = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
            const __m512 o = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
            for (int h = 0; h < HEADS; ++h) {
                const __m512 weight = _mm512_set1_ps(p[h * seq_len + t]);
                even[h][j] = _mm512_fmadd_ps(weight, e, even[h][j]);
                odd[h][j] = _mm512_fmadd_ps(weight, o, odd[h][j]);
            }
        }
    }
    for (int h = 0; h < HEADS; ++h)
        for (int j = 0; j < VEC; ++j) {
            float e[16], o[16];
            _mm512_storeu_ps(e, even[h][j]);
            _mm512_storeu_ps(o, odd[h][j]);
            for (int i = 0; i < 16; ++i) {
                out[h * head_dim + 32 * j + 2 * i] = e[i];
                out[h * head_dim + 32 * j + 2 * i + 1] = o[i];
            }
        }
}

/* values_dp for VEC in {1, 2, 4} and up to 3 heads (2 at VEC 4: 16 accumulators and 8 widened
 * vectors fill the 32 registers), with both as constants so the accumulators stay in registers. */
static void values_dp_any(int vec, int heads, const float *p, int64_t seq_len, const int64_t *offsets,
                          const bf16_t *v0, int64_t head_dim, float *out, const bf16_t *prefetch_rows,
                          int64_t row_bytes) {
#define VALUES(V, H) values_dp(V, H, p, seq_len, offsets, v0, head_dim, out, prefetch_rows, row_bytes)
    if (vec == 1) {
        if (heads == 3) VALUES(1, 3); else if (heads == 2) VALUES(1, 2); else VALUES(1, 1);
    } else if (vec == 2) {
        if (heads == 3) VALUES(2, 3); else if (heads == 2) VALUES(2, 2); else VALUES(2, 1);
    } else {
        if (heads == 2) VALUES(4, 2); else VALUES(4, 1);
    }
#undef VALUES
}

static int dp_path_fits(int64_t head_dim) {
    return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

/* Scratch attend_sequence_dp needs beside the scores, in bytes: row offsets, then one chunk of rows. */
static int64_t dp_scratch_bytes(int64_t seq_len, int64_t token_stride) {
    return sizeof(int64_t) * seq_len + sizeof(bf16_t) * SCORE_CHUNK * token_stride;
}

/* One sequence, all heads, through the dot-product path: keys ``first`` .. seq_len - 1 (as
 * attend_sequence_avx2, the functions below see only those, through ``offsets``). q: bfloat16
 * [num_heads * head_dim]; out: float32, rounded by the caller; scores: [num_heads * (seq_len -
 * first)]; scratch: dp_scratch_bytes(seq_len - first, ...), 8-byte aligned. */
static void attend_sequence_dp(const bf16_t *restrict q, float *restrict out, const int32_t *restrict table,
                               int64_t first, int64_t seq_len, const bf16_t *key_cache, const bf16_t *value_cache,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, const float *sinks, float softcap, float *restrict scores,
                               void *restrict scratch) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    int64_t *offsets = scratch;
    row_offsets(table, first, seq_len, block_size, token_stride, offsets);
    seq_len -= first;
    bf16_t *chunk = (bf16_t *)(offsets + seq_len);
    const int vec = (int)(head_dim / 32);
    if (vec == 1) scores_dp(1, q, offsets, seq_len, key_cache, num_heads, group, head_dim, token_stride, scale, scores,
              chunk);
    else if (vec == 2) scores_dp(2, q, offsets, seq_len, key_cache, num_heads, group, head_dim, token_stride, scale, scores,
                   chunk);
    else scores_dp(4, q, offsets, seq_len, key_cache, num_heads, group, head_dim, token_stride, scale, scores,
                   chunk);
    if (softcap != 0.0f) soft_cap(scores, num_heads * seq_len, softcap);
    for (int64_t h = 0; h < num_heads; ++h) softmax(scores + h * seq_len, seq_len, sinks == NULL ? NULL : sinks + h);
    const int64_t per_pass = vec == 4 ? 2 : 3;
    for (int64_t h = 0; h < num_heads;) {
        const int64_t in_group = group - h % group, heads = in_group < per_pass ? in_group : per_pass;
        values_dp_any(vec, (int)heads, scores + h * seq_len, seq_len, offsets, value_cache + (h / group) * head_dim,
                      head_dim, out + h * head_dim, h == 0 ? value_cache : NULL,
                      token_stride * (int64_t)sizeof(bf16_t));
        h += heads;
    }
}
#else
int decode_attention_bf16_dot_product(void) { return 0; }

static int64_t dp_scratch_bytes(int64_t seq_len, int64_t token_stride) {
    (void)seq_len, (void)token_stride;
    return 0;
}
#endif

/* Which function this build runs for decode and for prefill rows of this dtype and head size
 * (the same rule for both): the AVX512_BF16 dot-product ones for bfloat16 at head sizes 32, 64
 * and 128 where the compiler targets AVX512_BF16, the AVX2 ones at head sizes that are a
 * multiple of 8 on builds with AVX2 + FMA, the generic ones otherwise. The dispatchers below ask it, and
 * the tests, so what they report is what runs. */
enum attention_path { ATTENTION_GENERIC = 0, ATTENTION_AVX2 = 1, ATTENTION_AVX512_BF16 = 2 };

int attention_path(int is_bf16, int64_t head_dim) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (is_bf16 && dp_path_fits(head_dim)) return ATTENTION_AVX512_BF16;
#endif
    if (AVX2_ATTENTION && head_dim % 8 == 0) return ATTENTION_AVX2;
    (void)is_bf16;
    return ATTENTION_GENERIC;
}

/* The first key a decode query (at position seq_len - 1) sees under ``window`` (0: none). */
static inline int64_t decode_first_key(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* ``window``: keys each query sees (0 or less: all); ``sinks``: NULL or [num_heads] float32;
 * ``softcap``: 0 or the scores' soft cap (the file's first comment). Returns 0, or -1 when a
 * scratch allocation failed (the caller raises). The exported functions below call this and
 * decode_bf16. */
static int decode_f32(const float *query, float *out, const int64_t *rows, const int64_t *seq_lens,
                      const int32_t *block_tables, int64_t block_table_stride, const float *key_cache,
                      const float *value_cache, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, float scale, int64_t window, const float *sinks,
                      float softcap, int num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t seq_len = seq_lens[s], first = decode_first_key(seq_len, window), n = seq_len - first;
        /* The scores, the AVX2 path's lanes of 8 tokens per head (decode_scores_avx2), then (at a
         * multiple of 8 bytes) its row offsets. */
        const int64_t floats = (num_heads * n + num_heads * 64 + 1) / 2 * 2;
        float *scores = malloc(sizeof(float) * floats + sizeof(int64_t) * n);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const int64_t offset = rows[s] * num_heads * head_dim;
#if AVX2_ATTENTION
        if (attention_path(0, head_dim) == ATTENTION_AVX2) {
            attend_sequence_avx2(query + offset, out + offset, block_tables + s * block_table_stride, first, seq_len,
                                 key_cache, value_cache, 0, num_heads, num_kv_heads, head_dim, block_size, scale,
                                 sinks, softcap, scores, scores + num_heads * n, (int64_t *)(scores + floats));
            free(scores);
            continue;
        }
#endif
        attend_sequence(query + offset, out + offset, block_tables + s * block_table_stride, first, seq_len,
                        key_cache, value_cache, 0, num_heads, num_kv_heads, head_dim, block_size, scale, sinks,
                        softcap, scores, NULL);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The same over bfloat16 query, output and caches (float32 inside). Returns 0 or -1 as above. */
static int decode_bf16(const bf16_t *query, bf16_t *out, const int64_t *rows, const int64_t *seq_lens,
                       const int32_t *block_tables, int64_t block_table_stride, const bf16_t *key_cache,
                       const bf16_t *value_cache, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, float scale, int64_t window, const float *sinks,
                       float softcap, int num_threads) {
    int failed = 0;
    const int64_t width = num_heads * head_dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t seq_len = seq_lens[s], first = decode_first_key(seq_len, window), n = seq_len - first;
        /* One allocation: scores, the float32 query, output and V row, the AVX2 path's lanes of 8
         * tokens per head, then the dot-product path's scratch or the AVX2 path's (at a multiple
         * of 8 bytes: both start with int64 row offsets). */
        const int64_t floats = (num_heads * n + 2 * width + num_kv_heads * head_dim + num_heads * 64 + 1) / 2 * 2;
        const int64_t dp_bytes = dp_scratch_bytes(n, num_kv_heads * head_dim);
        const int64_t offsets_bytes = (int64_t)sizeof(int64_t) * n;
        float *scores = malloc(sizeof(float) * floats + (dp_bytes > offsets_bytes ? dp_bytes : offsets_bytes));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        float *q = scores + num_heads * n, *o = q + width, *v_row = o + width;
        const int64_t offset = rows[s] * width;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        if (attention_path(1, head_dim) == ATTENTION_AVX512_BF16) {
            attend_sequence_dp(query + offset, o, block_tables + s * block_table_stride, first, seq_len, key_cache,
                               value_cache, num_heads, num_kv_heads, head_dim, block_size, scale, sinks, softcap,
                               scores, scores + floats);
        } else
#endif
        {
            widen(query + offset, q, width);
#if AVX2_ATTENTION
            if (attention_path(1, head_dim) == ATTENTION_AVX2)
                attend_sequence_avx2(q, o, block_tables + s * block_table_stride, first, seq_len, key_cache,
                                     value_cache, 1, num_heads, num_kv_heads, head_dim, block_size, scale, sinks,
                                     softcap, scores, v_row + num_kv_heads * head_dim, (int64_t *)(scores + floats));
            else
#endif
            attend_sequence(q, o, block_tables + s * block_table_stride, first, seq_len, key_cache, value_cache, 1,
                            num_heads, num_kv_heads, head_dim, block_size, scale, sinks, softcap, scores, v_row);
        }
        for (int64_t i = 0; i < width; ++i) out[offset + i] = f32_to_bf16(o[i]);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The exported decode functions. paged_decode_attention_{f32,bf16} keep the arguments they had
 * before soft-capping (kernels/csrc/decoder.c calls them, with no cap: its layer loop declines
 * capped families) and run uncapped; the _softcap ones take ``softcap`` (0: off, the same
 * results bit for bit) before num_threads. */
int paged_decode_attention_f32(const float *query, float *out, const int64_t *rows, const int64_t *seq_lens,
                               const int32_t *block_tables, int64_t block_table_stride, const float *key_cache,
                               const float *value_cache, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int64_t window, const float *sinks,
                               int num_threads) {
    return decode_f32(query, out, rows, seq_lens, block_tables, block_table_stride, key_cache, value_cache, num_seqs,
                      num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, 0.0f, num_threads);
}

int paged_decode_attention_softcap_f32(const float *query, float *out, const int64_t *rows, const int64_t *seq_lens,
                                       const int32_t *block_tables, int64_t block_table_stride,
                                       const float *key_cache, const float *value_cache, int64_t num_seqs,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                       float scale, int64_t window, const float *sinks, float softcap,
                                       int num_threads) {
    return decode_f32(query, out, rows, seq_lens, block_tables, block_table_stride, key_cache, value_cache, num_seqs,
                      num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, softcap, num_threads);
}

int paged_decode_attention_bf16(const bf16_t *query, bf16_t *out, const int64_t *rows, const int64_t *seq_lens,
                                const int32_t *block_tables, int64_t block_table_stride, const bf16_t *key_cache,
                                const bf16_t *value_cache, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, float scale, int64_t window,
                                const float *sinks, int num_threads) {
    return decode_bf16(query, out, rows, seq_lens, block_tables, block_table_stride, key_cache, value_cache, num_seqs,
                       num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, 0.0f, num_threads);
}

int paged_decode_attention_softcap_bf16(const bf16_t *query, bf16_t *out, const int64_t *rows,
                                        const int64_t *seq_lens, const int32_t *block_tables,
                                        int64_t block_table_stride, const bf16_t *key_cache,
                                        const bf16_t *value_cache, int64_t num_seqs, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                        int64_t window, const float *sinks, float softcap, int num_threads) {
    return decode_bf16(query, out, rows, seq_lens, block_tables, block_table_stride, key_cache, value_cache, num_seqs,
                       num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, softcap, num_threads);
}

/* ---- prefill: sequences with several new tokens (prompts, prompt chunks) -----------------
 *
 * Flash-attention style, float32 arithmetic over float32 or bfloat16 pages: one task is one
 * KV head of one sequence and a tile of up to PREFILL_QUERY_TILE of its queries, with all the
 * query heads of that KV head's group as rows (GQA: they share every K and V row read). Keys
 * are taken PREFILL_KEY_BLOCK at a time: the block's K is transposed into a [head_dim][16]
 * buffer once and serves every row of the tile, so each row's 16 scores come from head_dim
 * multiply-adds over 16 lanes, no horizontal sums; a running max and sum per row rescale
 * the row's output as each block arrives (online softmax), and key blocks past the tile's
 * last query are never read (causal). torch's CPU flash attention, which this replaces,
 * needed float32 copies of the gathered K/V and took longer per layer for a 512-token
 * prompt. The inner loops are plain C that gcc vectorises for the
 * compiled ISA; exp is exp_ps512 / exp_ps256 above where there is one. prefill_task is the generic version
 * (builds without AVX2 + FMA, and odd head sizes); AVX2 + FMA builds take prefill_task_lanes
 * and AVX512_BF16 builds prefill_task_dp for bfloat16 (below); attention_path() says which one a
 * build runs. AVX-512F builds also have prefill_task_fma for bfloat16 (float32 FMAs on K and V
 * widened once per key block), AVX512-FP16 builds prefill_task_fp16 (float16 FMAs on K and V
 * narrowed once per key block), which run instead only where the process selected one
 * (prefill_attention_bf16_select: the engine's start-up timing); prefill_attention_bf16_path()
 * says which function bfloat16 prefills run now. */
#define PREFILL_KEY_BLOCK 16
#define PREFILL_QUERY_TILE 32
#define PREFILL_ROWS_AT_ONCE 8   /* rows whose scores are accumulated together (independent FMA chains) */

static inline float load_element(const void *base, int is_bf16, int64_t index) {
    return is_bf16 ? bf16_to_f32(((const bf16_t *)base)[index]) : ((const float *)base)[index];
}

/* p[t] = exp(s[t] - max) for t < PREFILL_KEY_BLOCK (masked lanes hold -inf and give 0). */
static inline void exp_block(const float *restrict s, float max, float *restrict p) {
#if defined(__AVX512F__)
    for (int t = 0; t < PREFILL_KEY_BLOCK; t += 16)
        _mm512_storeu_ps(p + t, exp_ps512(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(max))));
#elif defined(__AVX2__) && defined(__FMA__)
    for (int t = 0; t < PREFILL_KEY_BLOCK; t += 8)
        _mm256_storeu_ps(p + t, exp_ps256(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(max))));
#else
    for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) p[t] = expf(s[t] - max);
#endif
}

/* 1 / a prefill row's softmax denominator, from its online-softmax state (``sum``: the sum of
 * exp(score - ``max``) over its keys), with the row's sink (NULL: none) joining it: the output
 * is sum-of-weighted-V (relative to ``max``) times this. */
static inline float row_normaliser(float sum, float max, const float *sink) {
    if (sink == NULL) return 1.0f / sum;
    const float top = *sink > max ? *sink : max;
    const float keep = expf(max - top);      /* the keys' sum and output, rescaled from max to top */
    return keep / (sum * keep + expf(*sink - top));
}

/* The first key any query of a task sees: its first query is at ``position``. Key blocks start
 * there, so nothing before the window is read (the file's first comment). */
static inline int64_t prefill_first_key(int64_t position, int64_t window) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* Scratch floats one task needs. */
static int64_t prefill_scratch_floats(int64_t rows, int64_t head_dim) {
    return rows * (2 * head_dim + 2 + PREFILL_KEY_BLOCK) + 2 * head_dim * PREFILL_KEY_BLOCK + PREFILL_KEY_BLOCK;
}

/* Queries [i0, i1) of one sequence (packed row ``row0`` is its query 0, at absolute position
 * ``context_len``), the heads of KV head ``g``. ``rows`` = group * (i1 - i0) rounded up to
 * PREFILL_ROWS_AT_ONCE; row r is query i0 + r / group, head g * group + r % group. ``window``
 * (0: none), ``sinks`` (NULL: none) and ``softcap`` as the file's first comment says; CAPPED
 * (a constant: prefill_task below compiles this twice) is softcap != 0. */
static inline __attribute__((always_inline)) void prefill_task_any(
        const int CAPPED, const void *query, void *out, int is_bf16, int64_t row0, int64_t i0, int64_t i1,
        int64_t context_len, const int32_t *table, const void *key_cache, const void *value_cache, int64_t g,
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
        const float *sinks, float softcap, int64_t rows, float *restrict scratch) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t real_rows = group * (i1 - i0);
    float *restrict q = scratch;                       /* [rows][head_dim], scaled */
    float *restrict o = q + rows * head_dim;           /* [rows][head_dim] */
    float *restrict row_max = o + rows * head_dim;     /* [rows] */
    float *restrict row_sum = row_max + rows;          /* [rows] */
    float *restrict s = row_sum + rows;                /* [rows][KEY_BLOCK] */
    float *restrict kt = s + rows * PREFILL_KEY_BLOCK; /* [head_dim][KEY_BLOCK] */
    float *restrict vb = kt + head_dim * PREFILL_KEY_BLOCK;   /* [KEY_BLOCK][head_dim] */
    float *restrict p = vb + head_dim * PREFILL_KEY_BLOCK;    /* [KEY_BLOCK] */
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        for (int64_t d = 0; d < head_dim; ++d)
            q[r * head_dim + d] = r < real_rows ? scale * load_element(query, is_bf16, ((row0 + i) * num_heads + h) * head_dim + d) : 0.0f;
        memset(o + r * head_dim, 0, sizeof(float) * head_dim);
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    const int64_t last_key = context_len + i1 - 1;     /* the tile's last query sees keys 0..last_key */
    for (int64_t j0 = prefill_first_key(context_len + i0, window); j0 <= last_key; j0 += PREFILL_KEY_BLOCK) {
        const int64_t keys = last_key + 1 - j0 < PREFILL_KEY_BLOCK ? last_key + 1 - j0 : PREFILL_KEY_BLOCK;
        for (int64_t t = 0; t < PREFILL_KEY_BLOCK; ++t) {
            if (t < keys) {
                const int64_t at = token_offset(table, j0 + t, block_size, token_stride) + g * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) {
                    kt[d * PREFILL_KEY_BLOCK + t] = load_element(key_cache, is_bf16, at + d);
                    vb[t * head_dim + d] = load_element(value_cache, is_bf16, at + d);
                }
            } else {   /* past the keys: zeros (never NaN from memory), masked below */
                for (int64_t d = 0; d < head_dim; ++d) kt[d * PREFILL_KEY_BLOCK + t] = vb[t * head_dim + d] = 0.0f;
            }
        }
        /* scores: PREFILL_ROWS_AT_ONCE rows x 16 keys at a time */
        for (int64_t r0 = 0; r0 < rows; r0 += PREFILL_ROWS_AT_ONCE) {
            float acc[PREFILL_ROWS_AT_ONCE][PREFILL_KEY_BLOCK] = {{0}};
            for (int64_t d = 0; d < head_dim; ++d) {
                const float *k = kt + d * PREFILL_KEY_BLOCK;
                _Pragma("GCC unroll 8") for (int rr = 0; rr < PREFILL_ROWS_AT_ONCE; ++rr) {
                    const float qd = q[(r0 + rr) * head_dim + d];
#pragma omp simd
                    for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) acc[rr][t] += qd * k[t];
                }
            }
            memcpy(s + r0 * PREFILL_KEY_BLOCK, acc, sizeof acc);
        }
        for (int64_t r = 0; r < real_rows; ++r) {
            const int64_t position = context_len + i0 + r / group;
            const int64_t visible = position - j0 + 1;   /* keys j0.. this row may see */
            /* the block's first ``hidden`` keys are before this row's window (later rows of the
             * tile start their windows later than the tile's first key) */
            const int64_t hidden = window > 0 ? position - window + 1 - j0 : 0;
            if (visible <= 0) continue;      /* the whole block is in this row's future */
            if (hidden >= keys) continue;    /* ... or before this row's window */
            float *sr = s + r * PREFILL_KEY_BLOCK;
            if (CAPPED) soft_cap(sr, PREFILL_KEY_BLOCK, softcap);   /* before the mask, as the reference */
            float block_max = -INFINITY;
            for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) {
                if (t >= visible || t >= keys || t < hidden) sr[t] = -INFINITY;
                block_max = sr[t] > block_max ? sr[t] : block_max;
            }
            const float new_max = block_max > row_max[r] ? block_max : row_max[r];
            const float correction = expf(row_max[r] - new_max);   /* 0 on the first block */
            exp_block(sr, new_max, p);
            float block_sum = 0.0f;
            for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) block_sum += p[t];
            row_sum[r] = row_sum[r] * correction + block_sum;
            row_max[r] = new_max;
            float *orow = o + r * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) {
                float acc = orow[d] * correction;
                for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) acc += p[t] * vb[t * head_dim + d];
                orow[d] = acc;
            }
        }
    }
    for (int64_t r = 0; r < real_rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        const int64_t at = ((row0 + i) * num_heads + h) * head_dim;
        const float inv = row_normaliser(row_sum[r], row_max[r], sinks == NULL ? NULL : sinks + h);
        for (int64_t d = 0; d < head_dim; ++d) {
            const float value = o[r * head_dim + d] * inv;
            if (is_bf16) ((bf16_t *)out)[at + d] = f32_to_bf16(value);
            else ((float *)out)[at + d] = value;
        }
    }
}

static void prefill_task(const void *query, void *out, int is_bf16, int64_t row0, int64_t i0, int64_t i1,
                         int64_t context_len, const int32_t *table, const void *key_cache, const void *value_cache,
                         int64_t g, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         float scale, int64_t window, const float *sinks, float softcap, int64_t rows,
                         float *restrict scratch) {
#define TASK(CAPPED) prefill_task_any(CAPPED, query, out, is_bf16, row0, i0, i1, context_len, table, key_cache, \
                                      value_cache, g, num_heads, num_kv_heads, head_dim, block_size, scale, window, \
                                      sinks, softcap, rows, scratch)
    if (softcap != 0.0f) TASK(1);
    else TASK(0);
#undef TASK
}

#if AVX2_ATTENTION
/* prefill_task for AVX2 + FMA builds, float32 or bfloat16 pages, head_dim a multiple of 8
 * (attention_path). prefill_task reached a small fraction of the FMA peak on two threads: its
 * 8 rows x 16 keys of scores need all 16 ymm registers as accumulators (gcc spilled them each
 * step of d), and its online softmax is scalar, row by row. Here the rows of a task lie across
 * the 8 lanes of a vector instead:
 *   - the scaled queries are transposed once per task into [row group][head_dim][8 rows]; two
 *     row groups' scores for 4 keys are 8 accumulators, each step of d two query vector
 *     loads, 4 broadcasts of K and 8 multiply-adds (K as stored, widened to float32 per block);
 *   - the online softmax is vector code over 8 rows at once with no horizontal step: the
 *     block maximum is an elementwise max over the block's keys, the correction one exp_ps256,
 *     the causal mask a compare of each row's position with the key's;
 *   - P x V runs four rows at a time over 16 columns: 8 accumulators, each V vector loaded
 *     once for the four rows, each probability a broadcast.
 * Zen 3 issues at most two broadcasts a cycle: one per multiply-add (a group x 8 keys, or two
 * rows x 32 columns) left the FMA units idle more often: that first version of this path was
 * slower than this one (float32, 2 threads, 512-token prompt). Same flash-attention walk as
 * prefill_task (tasks, key blocks of 16, causal skip), and much faster than it on a 512-token
 * prompt (docs/benchmarks.md, "Prefill against the compute roofline"). */
#define LANES 8
#define SCORE_KEYS 4          /* keys whose scores accumulate together, for two row groups: 8 chains */
#define VALUE_VECTORS 2       /* 16 columns of four rows' outputs: 8 accumulators */

/* Scratch floats prefill_task_lanes needs for ``groups`` row groups. */
static int64_t prefill_lanes_scratch_floats(int64_t groups, int64_t head_dim) {
    return groups * LANES * (2 * head_dim + 3)                     /* queries, outputs, max, sum, positions */
           + 2 * PREFILL_KEY_BLOCK * head_dim                      /* the block's K and V rows, float32 */
           + PREFILL_KEY_BLOCK * LANES + LANES;                    /* probabilities [key][row], corrections */
}

/* One token's row of one KV head as float32 (bfloat16 widened by a shift: exact). */
static inline void load_head_row(const void *cache, int is_bf16, int64_t at, int64_t head_dim, float *restrict dst) {
    if (!is_bf16) {
        memcpy(dst, (const float *)cache + at, sizeof(float) * head_dim);
        return;
    }
    const bf16_t *src = (const bf16_t *)cache + at;
    for (int64_t d = 0; d < head_dim; d += LANES) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
}

/* Four rows' outputs (row r at o + r * head_dim), columns [d0, d0 + 8 * nv) <- o * correction
 * + sum over the block's keys of p[key][row] * V[key]; ``p`` points at the first row's lane of
 * [key][LANES]. Per key: nv V loads and 4 broadcasts for 4 * nv multiply-adds. */
static inline __attribute__((always_inline)) void values_four_rows(
        const int nv, float *restrict o, const float *restrict p, const float *restrict correction,
        const float *restrict vb, int64_t keys, int64_t head_dim, int64_t d0) {
    __m256 acc[4][VALUE_VECTORS];
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; ++r) {
        const __m256 c = _mm256_set1_ps(correction[r]);
        _Pragma("GCC unroll 2") for (int j = 0; j < nv; ++j)
            acc[r][j] = _mm256_mul_ps(_mm256_loadu_ps(o + r * head_dim + d0 + LANES * j), c);
    }
    for (int64_t t = 0; t < keys; ++t) {
        __m256 v[VALUE_VECTORS];
        _Pragma("GCC unroll 2") for (int j = 0; j < nv; ++j) {
            v[j] = _mm256_loadu_ps(vb + t * head_dim + d0 + LANES * j);
            /* keep v in a register: gcc otherwise folds the load into each of the four
             * multiply-adds, and four 256-bit loads per vector outrun the load ports */
            __asm__("" : "+x"(v[j]));
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; ++r) {
            const __m256 b = _mm256_broadcast_ss(p + t * LANES + r);
            _Pragma("GCC unroll 2") for (int j = 0; j < nv; ++j) acc[r][j] = _mm256_fmadd_ps(b, v[j], acc[r][j]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; ++r)
        _Pragma("GCC unroll 2") for (int j = 0; j < nv; ++j) _mm256_storeu_ps(o + r * head_dim + d0 + LANES * j, acc[r][j]);
}

/* s[k][t] = q . K[t] for ng (1 or 2) row groups k, the queries as [group][head_dim][LANES]
 * (scaled), K as the block's rows [KEY_BLOCK][head_dim]. Per step of d and 4 keys: ng query
 * vectors and 4 broadcasts of K for 4 * ng multiply-adds (broadcasts issue at most 2 a cycle
 * here, so 8 keys x 1 group, one broadcast per multiply-add, left the FMA units half idle). */
static inline __attribute__((always_inline)) void scores_of_groups(
        const int ng, const float *restrict q, const float *restrict kb, int64_t head_dim,
        __m256 s[2][PREFILL_KEY_BLOCK]) {
    for (int t0 = 0; t0 < PREFILL_KEY_BLOCK; t0 += SCORE_KEYS) {
        __m256 acc[2][SCORE_KEYS];
        _Pragma("GCC unroll 2") for (int k = 0; k < ng; ++k)
            _Pragma("GCC unroll 4") for (int u = 0; u < SCORE_KEYS; ++u) acc[k][u] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; ++d) {
            __m256 qv[2];
            _Pragma("GCC unroll 2") for (int k = 0; k < ng; ++k) {
                qv[k] = _mm256_loadu_ps(q + (k * head_dim + d) * LANES);
                __asm__("" : "+x"(qv[k]));   /* one load, not one folded into each multiply-add */
            }
            _Pragma("GCC unroll 4") for (int u = 0; u < SCORE_KEYS; ++u) {
                const __m256 b = _mm256_broadcast_ss(kb + (t0 + u) * head_dim + d);
                _Pragma("GCC unroll 2") for (int k = 0; k < ng; ++k) acc[k][u] = _mm256_fmadd_ps(qv[k], b, acc[k][u]);
            }
        }
        _Pragma("GCC unroll 2") for (int k = 0; k < ng; ++k)
            _Pragma("GCC unroll 4") for (int u = 0; u < SCORE_KEYS; ++u) s[k][t0 + u] = acc[k][u];
    }
}

/* CAPPED: softcap != 0, a constant (prefill_task_lanes below compiles this twice). */
static inline __attribute__((always_inline)) void prefill_task_lanes_any(
        const int CAPPED, const void *query, void *out, int is_bf16, int64_t row0, int64_t i0, int64_t i1,
        int64_t context_len, const int32_t *table, const void *key_cache, const void *value_cache, int64_t g,
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
        const float *sinks, float softcap, float *restrict scratch) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t real_rows = group * (i1 - i0), groups = (real_rows + LANES - 1) / LANES;
    float *restrict qt = scratch;                                   /* [groups][head_dim][LANES], scaled */
    float *restrict o = qt + groups * head_dim * LANES;             /* [groups * LANES][head_dim] */
    float *restrict row_max = o + groups * LANES * head_dim;        /* [groups * LANES] */
    float *restrict row_sum = row_max + groups * LANES;             /* [groups * LANES] */
    int32_t *restrict position = (int32_t *)(row_sum + groups * LANES);   /* each row's query position; -1: padding */
    float *restrict kb = (float *)(position + groups * LANES);     /* [KEY_BLOCK][head_dim] */
    float *restrict vb = kb + PREFILL_KEY_BLOCK * head_dim;         /* [KEY_BLOCK][head_dim] */
    float *restrict p = vb + PREFILL_KEY_BLOCK * head_dim;          /* [KEY_BLOCK][LANES] of one row group */
    float *restrict correction = p + PREFILL_KEY_BLOCK * LANES;     /* [LANES] */
    for (int64_t r = 0; r < groups * LANES; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        float *qr = qt + (r / LANES) * head_dim * LANES + r % LANES;
        for (int64_t d = 0; d < head_dim; ++d)
            qr[d * LANES] = r < real_rows ? scale * load_element(query, is_bf16, ((row0 + i) * num_heads + h) * head_dim + d) : 0.0f;
        memset(o + r * head_dim, 0, sizeof(float) * head_dim);
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
        position[r] = r < real_rows ? (int32_t)(context_len + i) : -1;
    }
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    const int64_t last_key = context_len + i1 - 1;     /* the tile's last query sees keys 0..last_key */
    for (int64_t j0 = prefill_first_key(context_len + i0, window); j0 <= last_key; j0 += PREFILL_KEY_BLOCK) {
        const int64_t keys = last_key + 1 - j0 < PREFILL_KEY_BLOCK ? last_key + 1 - j0 : PREFILL_KEY_BLOCK;
        for (int64_t t = 0; t < PREFILL_KEY_BLOCK; ++t) {
            if (t < keys) {
                const int64_t at = token_offset(table, j0 + t, block_size, token_stride) + g * head_dim;
                load_head_row(key_cache, is_bf16, at, head_dim, kb + t * head_dim);
                load_head_row(value_cache, is_bf16, at, head_dim, vb + t * head_dim);
            } else {   /* past the keys: zeros (never NaN from memory), masked below */
                memset(kb + t * head_dim, 0, sizeof(float) * head_dim);
                memset(vb + t * head_dim, 0, sizeof(float) * head_dim);
            }
        }
        /* Rows are in query order: the first groups may have the whole block in their future
         * (their last query is before j0); every group after the first that sees it does too. */
        int64_t first = 0;
        while (first < groups) {
            const int64_t last_row = (first + 1) * LANES < real_rows ? (first + 1) * LANES - 1 : real_rows - 1;
            if (context_len + i0 + last_row / group >= j0) break;
            ++first;
        }
        for (int64_t g0 = first; g0 < groups; g0 += 2) {
            const int ng = groups - g0 >= 2 ? 2 : 1;
            __m256 scores[2][PREFILL_KEY_BLOCK];
            if (ng == 2) scores_of_groups(2, qt + g0 * head_dim * LANES, kb, head_dim, scores);
            else scores_of_groups(1, qt + g0 * head_dim * LANES, kb, head_dim, scores);
          for (int k = 0; k < ng; ++k) {
            const int64_t gi = g0 + k;
            __m256 *s = scores[k];
            if (CAPPED) {   /* before the mask, as the reference; lanes past the keys are masked below */
                const __m256 inv = _mm256_set1_ps(1.0f / softcap), cap = _mm256_set1_ps(softcap);
                _Pragma("GCC unroll 16") for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) s[t] = cap_ps256(s[t], inv, cap);
            }
            /* causal mask: row r sees key j0 + t when t < keys and position[r] >= j0 + t; under a
             * window also position[r] < j0 + t + window (prefill() passes a window only when it
             * is shorter than the sequence, so that sum fits an int) */
            const __m256i pos = _mm256_loadu_si256((const __m256i *)(position + gi * LANES));
            __m256 visible[PREFILL_KEY_BLOCK];
            const __m256 old_max = _mm256_loadu_ps(row_max + gi * LANES);
            __m256 top = old_max;
            _Pragma("GCC unroll 16") for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) {
                visible[t] = t < keys ? _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, _mm256_set1_epi32((int)(j0 + t - 1))))
                                      : _mm256_setzero_ps();
                if (window > 0)
                    visible[t] = _mm256_and_ps(visible[t], _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                                   _mm256_set1_epi32((int)(j0 + t + window)), pos)));
                s[t] = _mm256_blendv_ps(minus_inf, s[t], visible[t]);
                top = _mm256_max_ps(top, s[t]);
            }
            /* exp_ps256 clamps its argument from below, and -inf - -inf (a row that has seen no key
             * yet: the block is in its future or before its window) is NaN, which the clamp's
             * max_ps also replaces: the correction is then ~0 times a zero output and sum. Masked
             * probabilities are zeroed outright. */
            const __m256 scale_old = exp_ps256(_mm256_sub_ps(old_max, top));
            __m256 block_sum = _mm256_setzero_ps();
            _Pragma("GCC unroll 16") for (int t = 0; t < PREFILL_KEY_BLOCK; ++t) {
                const __m256 e = _mm256_and_ps(exp_ps256(_mm256_sub_ps(s[t], top)), visible[t]);
                _mm256_storeu_ps(p + t * LANES, e);
                block_sum = _mm256_add_ps(block_sum, e);
            }
            _mm256_storeu_ps(row_max + gi * LANES, top);
            _mm256_storeu_ps(row_sum + gi * LANES, _mm256_fmadd_ps(_mm256_loadu_ps(row_sum + gi * LANES), scale_old, block_sum));
            _mm256_storeu_ps(correction, scale_old);
            for (int rr = 0; rr < LANES && gi * LANES + rr < real_rows; rr += 4) {   /* rows past real_rows: padding */
                float *o4 = o + (gi * LANES + rr) * head_dim;
                int64_t d0 = 0;
                for (; d0 + LANES * VALUE_VECTORS <= head_dim; d0 += LANES * VALUE_VECTORS)
                    values_four_rows(VALUE_VECTORS, o4, p + rr, correction + rr, vb, keys, head_dim, d0);
                if (d0 < head_dim) values_four_rows(1, o4, p + rr, correction + rr, vb, keys, head_dim, d0);
            }
          }
        }
    }
    for (int64_t r = 0; r < real_rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        const int64_t at = ((row0 + i) * num_heads + h) * head_dim;
        const float inv = row_normaliser(row_sum[r], row_max[r], sinks == NULL ? NULL : sinks + h);
        for (int64_t d = 0; d < head_dim; ++d) {
            const float value = o[r * head_dim + d] * inv;
            if (is_bf16) ((bf16_t *)out)[at + d] = f32_to_bf16(value);
            else ((float *)out)[at + d] = value;
        }
    }
}

static void prefill_task_lanes(const void *query, void *out, int is_bf16, int64_t row0, int64_t i0, int64_t i1,
                               int64_t context_len, const int32_t *table, const void *key_cache,
                               const void *value_cache, int64_t g, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int64_t window,
                               const float *sinks, float softcap, float *restrict scratch) {
#define TASK(CAPPED) prefill_task_lanes_any(CAPPED, query, out, is_bf16, row0, i0, i1, context_len, table, key_cache, \
                                            value_cache, g, num_heads, num_kv_heads, head_dim, block_size, scale, \
                                            window, sinks, softcap, scratch)
    if (softcap != 0.0f) TASK(1);
    else TASK(0);
#undef TASK
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* prefill_task for bfloat16 where the compiler targets AVX512_BF16 and head_dim is 32, 64 or 128
 * (dp_path_fits). prefill_task spent most of its cycles outside its multiply-adds, mostly on
 * per-row scalar bookkeeping (masking, block max and sum, expf of the correction) and on
 * widening K and V element by element. Here, for the same tasks and key blocks:
 *   - K is transposed as 32-bit pairs into [head_dim / 2][16 keys], the operand layout of
 *     _mm512_dpbf16_ps, and each row's 16 scores come from head_dim / 2 dot products of its
 *     bfloat16 query pair (broadcast) with a vector of 16 keys' pairs;
 *   - the online softmax runs for PREFILL_ROW_BLOCK rows at once: the rows' block maxima and
 *     sums are reduced together (reduce_lanes_16), their corrections are one vector exp;
 *   - V is widened once per block into even / odd lanes (shift / mask), and each row's output
 *     is kept split that way until the end, as in the decode path.
 * Scores are scaled after the dot product (prefill_task scales the query first).
 * With PV_DP (the "dp-pv" function, prefill_attention_bf16_select), P x V is dot products too:
 * each row's probabilities are rounded to bfloat16 (as torch's SDPA and flash attention do
 * before P x V) and a block's V is laid out as pairs of keys, [KEY_BLOCK / 2][head_dim] 32-bit
 * lanes holding dimension d of keys 2k and 2k + 1, so one _mm512_dpbf16_ps adds two keys'
 * products to 16 output dimensions: half the instructions of the float32 FMAs, which on CPUs
 * whose dot product runs at the FMA's rate held the whole function to the FMA's pace. */
#define PREFILL_ROW_BLOCK 16

/* Scratch bytes prefill_task_dp needs for ``rows`` (a multiple of PREFILL_ROW_BLOCK). */
static int64_t prefill_dp_scratch_bytes(int64_t rows, int64_t head_dim) {
    return sizeof(bf16_t) * rows * head_dim                           /* queries */
           + sizeof(float) * (rows * head_dim + 2 * rows)              /* outputs, row max and sum */
           + sizeof(uint32_t) * head_dim / 2 * PREFILL_KEY_BLOCK       /* K pairs, transposed */
           + sizeof(float) * PREFILL_KEY_BLOCK * head_dim              /* V, widened and split */
           + sizeof(float) * PREFILL_ROW_BLOCK * (PREFILL_KEY_BLOCK + 2);  /* probabilities, maxima, corrections */
}

/* VEC: head_dim / 32; CAPPED: softcap != 0; PV_DP: P x V in dot products. Constants
 * (prefill_task_dp_any). */
static inline __attribute__((always_inline)) void prefill_task_dp(
        const int VEC, const int CAPPED, const int PV_DP, const bf16_t *query, bf16_t *out, int64_t row0, int64_t i0, int64_t i1,
        int64_t context_len, const int32_t *table, const bf16_t *key_cache, const bf16_t *value_cache, int64_t g,
        int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale, int64_t window, const float *sinks,
        float softcap, int64_t rows, void *scratch) {
    const int64_t head_dim = 32 * VEC, group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t real_rows = group * (i1 - i0);
    bf16_t *restrict q = scratch;                                /* [rows][head_dim] */
    float *restrict o = (float *)(q + rows * head_dim);          /* [rows][VEC][even 16, odd 16]; PV_DP: [rows][head_dim] */
    float *restrict row_max = o + rows * head_dim;               /* [rows] */
    float *restrict row_sum = row_max + rows;                    /* [rows] */
    uint32_t *restrict kp = (uint32_t *)(row_sum + rows);        /* [head_dim / 2][KEY_BLOCK] */
    float *restrict vs = (float *)(kp + head_dim / 2 * PREFILL_KEY_BLOCK);   /* [KEY_BLOCK][VEC][even, odd] */
    uint32_t *restrict vp = (uint32_t *)vs;                      /* PV_DP: [KEY_BLOCK / 2][head_dim] key pairs */
    float *restrict p = vs + PREFILL_KEY_BLOCK * head_dim;       /* [ROW_BLOCK][KEY_BLOCK] */
    bf16_t *restrict pb = (bf16_t *)p;                           /* PV_DP: [ROW_BLOCK][KEY_BLOCK] */
    float *restrict new_max = p + PREFILL_ROW_BLOCK * PREFILL_KEY_BLOCK, *restrict correction = new_max + PREFILL_ROW_BLOCK;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    /* PV_DP: dimensions 0-15 / 16-31 of a 32-element slice of keys a and b, interleaved a, b */
    const __m512i first_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        if (r < real_rows) memcpy(q + r * head_dim, query + ((row0 + i) * num_heads + h) * head_dim, sizeof(bf16_t) * head_dim);
        else memset(q + r * head_dim, 0, sizeof(bf16_t) * head_dim);
        memset(o + r * head_dim, 0, sizeof(float) * head_dim);
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    const int64_t last_key = context_len + i1 - 1;     /* the tile's last query sees keys 0..last_key */
    for (int64_t j0 = prefill_first_key(context_len + i0, window); j0 <= last_key; j0 += PREFILL_KEY_BLOCK) {
        const int64_t keys = last_key + 1 - j0 < PREFILL_KEY_BLOCK ? last_key + 1 - j0 : PREFILL_KEY_BLOCK;
        if (PV_DP) {   /* V as pairs of keys; past the keys: zeros (never NaN from memory) */
            for (int64_t t = 0; t < PREFILL_KEY_BLOCK; t += 2) {
                const bf16_t *a = t < keys ? value_cache + token_offset(table, j0 + t, block_size, token_stride) + g * head_dim : NULL;
                const bf16_t *b = t + 1 < keys ? value_cache + token_offset(table, j0 + t + 1, block_size, token_stride) + g * head_dim : NULL;
                for (int j = 0; j < VEC; ++j) {
                    const __m512i va = a ? _mm512_loadu_si512(a + 32 * j) : _mm512_setzero_si512();
                    const __m512i vb = b ? _mm512_loadu_si512(b + 32 * j) : _mm512_setzero_si512();
                    _mm512_storeu_si512(vp + t / 2 * head_dim + 32 * j, _mm512_permutex2var_epi16(va, first_half, vb));
                    _mm512_storeu_si512(vp + t / 2 * head_dim + 32 * j + 16, _mm512_permutex2var_epi16(va, second_half, vb));
                }
            }
        }
        for (int64_t t = 0; t < PREFILL_KEY_BLOCK; ++t) {
            if (t < keys) {
                const int64_t at = token_offset(table, j0 + t, block_size, token_stride) + g * head_dim;
                const uint32_t *pairs = (const uint32_t *)(key_cache + at);
                for (int64_t d = 0; d < head_dim / 2; ++d) kp[d * PREFILL_KEY_BLOCK + t] = pairs[d];
                if (!PV_DP) for (int j = 0; j < VEC; ++j) {
                    const __m512i pair = _mm512_loadu_si512(value_cache + at + 32 * j);
                    _mm512_storeu_ps(vs + t * head_dim + 32 * j, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
                    _mm512_storeu_ps(vs + t * head_dim + 32 * j + 16, _mm512_castsi512_ps(_mm512_and_si512(pair, high)));
                }
            } else {   /* past the keys: zeros (never NaN from memory), masked below */
                for (int64_t d = 0; d < head_dim / 2; ++d) kp[d * PREFILL_KEY_BLOCK + t] = 0;
                if (!PV_DP) memset(vs + t * head_dim, 0, sizeof(float) * head_dim);
            }
        }
        for (int64_t r0 = 0; r0 < rows && r0 < real_rows; r0 += PREFILL_ROW_BLOCK) {
            /* keys of this block each row may see: [hidden, visible), from its query's position,
             * its window and the block's keys */
            int visible[PREFILL_ROW_BLOCK], hidden[PREFILL_ROW_BLOCK];
            __mmask16 masks[PREFILL_ROW_BLOCK];
            int any = 0;
            for (int rr = 0; rr < PREFILL_ROW_BLOCK; ++rr) {
                row_key_range(r0 + rr, real_rows, group, context_len, i0, j0, keys, window, &visible[rr], &hidden[rr]);
                const int v = visible[rr], before = hidden[rr];
                masks[rr] = (v >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << v) - 1)) &
                            (__mmask16)~((1u << before) - 1);
                any |= v > before;
            }
            if (!any) continue;     /* the whole block is in these rows' future */
            __m512 s[PREFILL_ROW_BLOCK];
            _Pragma("GCC unroll 16") for (int rr = 0; rr < PREFILL_ROW_BLOCK; ++rr) s[rr] = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim / 2; ++d) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(kp + d * PREFILL_KEY_BLOCK);
                _Pragma("GCC unroll 16") for (int rr = 0; rr < PREFILL_ROW_BLOCK; ++rr) {
                    int32_t pair;
                    memcpy(&pair, q + (r0 + rr) * head_dim + 2 * d, sizeof pair);
                    s[rr] = _mm512_dpbf16_ps(s[rr], (__m512bh)_mm512_set1_epi32(pair), k);
                }
            }
            const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
            if (CAPPED) {   /* scaled, capped, then masked (the reference's order) */
                const __m512 inv = _mm512_set1_ps(1.0f / softcap), cap = _mm512_set1_ps(softcap);
                _Pragma("GCC unroll 16") for (int rr = 0; rr < PREFILL_ROW_BLOCK; ++rr)
                    s[rr] = _mm512_mask_mov_ps(minus_inf, masks[rr],
                                               cap_ps512(_mm512_mul_ps(s[rr], _mm512_set1_ps(scale)), inv, cap));
            } else {
                _Pragma("GCC unroll 16") for (int rr = 0; rr < PREFILL_ROW_BLOCK; ++rr)
                    s[rr] = _mm512_mask_mul_ps(minus_inf, masks[rr], s[rr], _mm512_set1_ps(scale));
            }
            /* per row: the new running max; rows that see no key of the block keep theirs */
            const __m512 scale_old = online_max_step(reduce_lanes_16(s, 1), row_max + r0, new_max, correction);
            _Pragma("GCC unroll 16") for (int rr = 0; rr < PREFILL_ROW_BLOCK; ++rr) {
                s[rr] = _mm512_maskz_mov_ps(masks[rr], exp_ps512(_mm512_sub_ps(s[rr], _mm512_set1_ps(new_max[rr]))));
                if (PV_DP) _mm256_storeu_si256((__m256i *)(pb + rr * PREFILL_KEY_BLOCK), (__m256i)_mm512_cvtneps_pbh(s[rr]));
                else _mm512_storeu_ps(p + rr * PREFILL_KEY_BLOCK, s[rr]);
            }
            _mm512_storeu_ps(row_sum + r0, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + r0), scale_old, reduce_lanes_16(s, 0)));
            if (PV_DP) {   /* two rows at once (independent sums, one V load for both), a pair of keys a step */
                for (int rr = 0; rr < PREFILL_ROW_BLOCK; rr += 2) {
                    const int first = hidden[rr] < hidden[rr + 1] ? hidden[rr] : hidden[rr + 1];
                    const int end = visible[rr] > visible[rr + 1] ? visible[rr] : visible[rr + 1];
                    if (end <= first) continue;
                    /* a row outside its range of this block has p = 0 and correction 1: unchanged */
                    float *orow = o + (r0 + rr) * head_dim;
                    const __m512 c0 = _mm512_set1_ps(correction[rr]), c1 = _mm512_set1_ps(correction[rr + 1]);
                    __m512 acc0[2 * DP_MAX_VECTORS], acc1[2 * DP_MAX_VECTORS];
                    for (int j = 0; j < 2 * VEC; ++j) {
                        acc0[j] = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * j), c0);
                        acc1[j] = _mm512_mul_ps(_mm512_loadu_ps(orow + head_dim + 16 * j), c1);
                    }
                    const uint32_t *w0 = (const uint32_t *)(pb + rr * PREFILL_KEY_BLOCK), *w1 = w0 + PREFILL_KEY_BLOCK / 2;
                    for (int k = first / 2; k < (end + 1) / 2; ++k) {
                        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)w0[k]), b = (__m512bh)_mm512_set1_epi32((int)w1[k]);
                        for (int j = 0; j < 2 * VEC; ++j) {
                            const __m512bh v = (__m512bh)_mm512_loadu_si512(vp + k * head_dim + 16 * j);
                            acc0[j] = _mm512_dpbf16_ps(acc0[j], a, v);
                            acc1[j] = _mm512_dpbf16_ps(acc1[j], b, v);
                        }
                    }
                    for (int j = 0; j < 2 * VEC; ++j) {
                        _mm512_storeu_ps(orow + 16 * j, acc0[j]);
                        _mm512_storeu_ps(orow + head_dim + 16 * j, acc1[j]);
                    }
                }
                continue;
            }
            for (int rr = 0; rr < PREFILL_ROW_BLOCK; ++rr) {
                if (visible[rr] <= hidden[rr]) continue;
                float *orow = o + (r0 + rr) * head_dim;
                const __m512 c = _mm512_set1_ps(correction[rr]);
                __m512 acc[2 * DP_MAX_VECTORS];
                for (int j = 0; j < 2 * VEC; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * j), c);
                for (int t = hidden[rr]; t < visible[rr]; ++t) {
                    const __m512 w = _mm512_set1_ps(p[rr * PREFILL_KEY_BLOCK + t]);
                    for (int j = 0; j < 2 * VEC; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vs + t * head_dim + 16 * j), acc[j]);
                }
                for (int j = 0; j < 2 * VEC; ++j) _mm512_storeu_ps(orow + 16 * j, acc[j]);
            }
        }
    }
    for (int64_t r = 0; r < real_rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        bf16_t *dst = out + ((row0 + i) * num_heads + h) * head_dim;
        const float inv = row_normaliser(row_sum[r], row_max[r], sinks == NULL ? NULL : sinks + h);
        if (PV_DP) {
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = f32_to_bf16(o[r * head_dim + d] * inv);
            continue;
        }
        for (int j = 0; j < VEC; ++j)
            for (int e = 0; e < 16; ++e) {
                dst[32 * j + 2 * e] = f32_to_bf16(o[r * head_dim + 32 * j + e] * inv);
                dst[32 * j + 2 * e + 1] = f32_to_bf16(o[r * head_dim + 32 * j + 16 + e] * inv);
            }
    }
}

static void prefill_task_dp_any(const bf16_t *query, bf16_t *out, int64_t row0, int64_t i0, int64_t i1,
                                int64_t context_len, const int32_t *table, const bf16_t *key_cache,
                                const bf16_t *value_cache, int64_t g, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, float scale, int64_t window,
                                const float *sinks, float softcap, int64_t rows, void *scratch, int pv_dp) {
#define TASK(V, C, P) prefill_task_dp(V, C, P, query, out, row0, i0, i1, context_len, table, key_cache, value_cache, g, \
                                      num_heads, num_kv_heads, block_size, scale, window, sinks, softcap, rows, scratch)
#define BY_SIZE(C, P) { if (head_dim == 32) TASK(1, C, P); else if (head_dim == 64) TASK(2, C, P); else TASK(4, C, P); }
    if (softcap != 0.0f) {
        if (pv_dp) BY_SIZE(1, 1) else BY_SIZE(1, 0)
    } else {
        if (pv_dp) BY_SIZE(0, 1) else BY_SIZE(0, 0)
    }
#undef BY_SIZE
#undef TASK
}
#endif

#if defined(__AVX512F__)
/* ---- bfloat16 prefill in float32 512-bit FMAs (prefill_task_fma) ----------------------------
 *
 * On some CPUs with AVX512_BF16 the dot product _mm512_dpbf16_ps runs at half the rate of
 * float32 512-bit FMAs (the Intel Xeon of docs/benchmarks.md: 183 against 358 GFLOP/s), so
 * prefill_task_dp is held below the FMA ceiling however well it is fed. This variant keeps K
 * and V bfloat16 in the cache and widens them (exact) once per task and key block, then does
 * both products in float32 FMAs, the same sums as the reference's float32 arithmetic in
 * another order (no subnormal flushing either):
 *   - a block of FMA_KEY_BLOCK (32) keys of one KV head is transposed as 32-bit pairs (16 x 16
 *     transposes in registers) and widened to float32 [head_dim][32 keys];
 *   - FMA_QK_ROWS query rows (of every head of the GQA group: the task's rows as in
 *     prefill_task) accumulate their 32 scores together: per dimension two loads of K serve
 *     2 x FMA_QK_ROWS FMAs with the row's query element broadcast;
 *   - the online softmax runs for FMA_ROW_BLOCK rows at once as in prefill_task_dp
 *     (reduce_lanes_16 for the rows' maxima and sums, one vector exp for their corrections);
 *   - V is widened once per block into [32 keys][head_dim], and PV keeps several rows'
 *     outputs in registers over the block's keys (fma_pv_rows).
 * Which bfloat16 prefill runs (this or the build's own, prefill_task_dp on AVX512_BF16 builds)
 * is a process-wide choice, prefill_attention_bf16_select, that the engine makes from a timing
 * at start-up (backend/model/prefill_attention_choice.py); off, nothing changes. head_dim a
 * multiple of 16 from 32 to 128, or 256 (fma_path_fits); windows, sinks and soft-capping as
 * every prefill path. */
#define FMA_KEY_BLOCK 32
#define FMA_ROW_BLOCK 16
#define FMA_QK_ROWS 8

static int fma_path_fits(int64_t head_dim) {
    return (head_dim % 16 == 0 && head_dim >= 32 && head_dim <= 128) || head_dim == 256;
}

/* Rows whose outputs one PV pass keeps in registers: up to 16 accumulators. */
#define fma_pv_rows(VEC) ((VEC) <= 4 ? 4 : (VEC) <= 8 ? 2 : 1)

/* Scratch bytes prefill_task_fma needs for ``rows`` (a multiple of FMA_ROW_BLOCK); 64-byte
 * aligned pieces. */
static int64_t prefill_fma_scratch_bytes(int64_t rows, int64_t head_dim) {
    return sizeof(float) * (2 * rows * head_dim                      /* queries, outputs */
                            + 2 * rows                               /* row max and sum */
                            + 2 * FMA_KEY_BLOCK * head_dim           /* K transposed, V */
                            + FMA_ROW_BLOCK * FMA_KEY_BLOCK          /* scores, then probabilities */
                            + 2 * FMA_ROW_BLOCK);                    /* new maxima, corrections */
}

/* r[i] <- column i of the 16 x 16 matrix of 32-bit lanes whose row j is r[j]. */
static inline __attribute__((always_inline)) void transpose_16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* kt[d][t] = K[t][d] in float32 for the block's keys t < ``keys`` (0 past them: never read from
 * memory), d < head_dim; ``rows[t]``: key t's K row of this KV head. 32 dimensions (16 pairs)
 * of 16 keys per transpose; a last 16 dimensions (head_dim an odd multiple of 16) as 8 pairs. */
static inline __attribute__((always_inline)) void widen_keys_transposed(
        const bf16_t *const rows[FMA_KEY_BLOCK], int keys, int64_t head_dim, float *restrict kt) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int half = 0; half < FMA_KEY_BLOCK / 16; ++half) {
        for (int64_t c = 0; c < head_dim; c += 32) {
            const int pairs = head_dim - c >= 32 ? 16 : 8;
            __m512 r[16];
            for (int t = 0; t < 16; ++t) {
                const int key = 16 * half + t;
                if (key >= keys) r[t] = _mm512_setzero_ps();
                else if (pairs == 16) r[t] = _mm512_castsi512_ps(_mm512_loadu_si512(rows[key] + c));
                else r[t] = _mm512_castsi512_ps(_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(rows[key] + c))));
            }
            transpose_16x16(r);
            for (int i = 0; i < pairs; ++i) {
                const __m512i pair = _mm512_castps_si512(r[i]);
                _mm512_store_ps(kt + (c + 2 * i) * FMA_KEY_BLOCK + 16 * half, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
                _mm512_store_ps(kt + (c + 2 * i + 1) * FMA_KEY_BLOCK + 16 * half,
                                _mm512_castsi512_ps(_mm512_and_si512(pair, high)));
            }
        }
    }
}

static inline __attribute__((always_inline)) __m512 widen16(const bf16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

/* Queries [i0, i1) of one sequence, the heads of KV head ``g``, as prefill_task_dp (the same
 * rows, masks, online softmax and rounding); VEC = head_dim / 16 and CAPPED (softcap != 0) are
 * constants (prefill_task_fma_any). ``rows``: the task's rows rounded up to FMA_ROW_BLOCK. */
static inline __attribute__((always_inline)) void prefill_task_fma(
        const int VEC, const int CAPPED, const bf16_t *query, bf16_t *out, int64_t row0, int64_t i0, int64_t i1,
        int64_t context_len, const int32_t *table, const bf16_t *key_cache, const bf16_t *value_cache, int64_t g,
        int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale, int64_t window, const float *sinks,
        float softcap, int64_t rows, float *scratch) {
    const int64_t head_dim = 16 * VEC, group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    const int64_t real_rows = group * (i1 - i0);
    const int PV_ROWS = fma_pv_rows(VEC);
    float *restrict q = scratch;                                   /* [rows][head_dim] */
    float *restrict o = q + rows * head_dim;                       /* [rows][head_dim] */
    float *restrict row_max = o + rows * head_dim;                 /* [rows] */
    float *restrict row_sum = row_max + rows;                      /* [rows] */
    float *restrict kt = row_sum + rows;                           /* [head_dim][KEY_BLOCK] */
    float *restrict vs = kt + head_dim * FMA_KEY_BLOCK;            /* [KEY_BLOCK][head_dim] */
    float *restrict p = vs + FMA_KEY_BLOCK * head_dim;             /* [ROW_BLOCK][KEY_BLOCK] */
    float *restrict new_max = p + FMA_ROW_BLOCK * FMA_KEY_BLOCK, *restrict correction = new_max + FMA_ROW_BLOCK;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        for (int j = 0; j < VEC; ++j)
            _mm512_store_ps(q + r * head_dim + 16 * j,
                            r < real_rows ? widen16(query + ((row0 + i) * num_heads + h) * head_dim + 16 * j)
                                          : _mm512_setzero_ps());
        memset(o + r * head_dim, 0, sizeof(float) * head_dim);
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    const int64_t last_key = context_len + i1 - 1;     /* the tile's last query sees keys 0..last_key */
    for (int64_t j0 = prefill_first_key(context_len + i0, window); j0 <= last_key; j0 += FMA_KEY_BLOCK) {
        const int keys = (int)(last_key + 1 - j0 < FMA_KEY_BLOCK ? last_key + 1 - j0 : FMA_KEY_BLOCK);
        const bf16_t *krows[FMA_KEY_BLOCK];
        for (int64_t t = 0, block = j0 / block_size, slot = j0 % block_size; t < keys; ++t) {
            const int64_t at = ((int64_t)table[block] * block_size + slot) * token_stride + g * head_dim;
            if (++slot == block_size) slot = 0, ++block;
            krows[t] = key_cache + at;
            for (int j = 0; j < VEC; ++j) _mm512_store_ps(vs + t * head_dim + 16 * j, widen16(value_cache + at + 16 * j));
        }
        for (int t = keys; t < FMA_KEY_BLOCK; ++t)    /* past the keys: zeros (never NaN from memory) */
            memset(vs + t * head_dim, 0, sizeof(float) * head_dim);
        widen_keys_transposed(krows, keys, head_dim, kt);
        for (int64_t r0 = 0; r0 < real_rows; r0 += FMA_ROW_BLOCK) {
            /* keys of this block each row may see: [hidden, visible) */
            int visible[FMA_ROW_BLOCK], hidden[FMA_ROW_BLOCK];
            __mmask16 lo[FMA_ROW_BLOCK], hi[FMA_ROW_BLOCK];
            int any = 0;
            for (int rr = 0; rr < FMA_ROW_BLOCK; ++rr) {
                row_key_range(r0 + rr, real_rows, group, context_len, i0, j0, keys, window, &visible[rr], &hidden[rr]);
                const int v = visible[rr], before = hidden[rr];
                const uint32_t mask = (v >= 32 ? 0xFFFFFFFFu : (1u << v) - 1) & ~(before >= 32 ? 0xFFFFFFFFu : (1u << before) - 1);
                lo[rr] = (__mmask16)(mask & 0xFFFF);
                hi[rr] = (__mmask16)(mask >> 16);
                any |= v > before;
            }
            if (!any) continue;     /* the whole block is in these rows' future (or before their windows) */
            /* scores: FMA_QK_ROWS rows x 32 keys at a time, scaled, capped and masked */
            for (int rb = 0; rb < FMA_ROW_BLOCK; rb += FMA_QK_ROWS) {
                int active = 0;
                for (int rr = rb; rr < rb + FMA_QK_ROWS; ++rr) active |= visible[rr] > hidden[rr];
                float *sr = p + rb * FMA_KEY_BLOCK;
                if (!active) {
                    for (int rr = 0; rr < FMA_QK_ROWS; ++rr) {
                        _mm512_store_ps(sr + rr * FMA_KEY_BLOCK, minus_inf);
                        _mm512_store_ps(sr + rr * FMA_KEY_BLOCK + 16, minus_inf);
                    }
                    continue;
                }
                const float *qb = q + (r0 + rb) * head_dim;
                __m512 acc[FMA_QK_ROWS][2];
                _Pragma("GCC unroll 8") for (int rr = 0; rr < FMA_QK_ROWS; ++rr) acc[rr][0] = acc[rr][1] = _mm512_setzero_ps();
                for (int64_t d = 0; d < head_dim; ++d) {
                    const __m512 k0 = _mm512_load_ps(kt + d * FMA_KEY_BLOCK), k1 = _mm512_load_ps(kt + d * FMA_KEY_BLOCK + 16);
                    _Pragma("GCC unroll 8") for (int rr = 0; rr < FMA_QK_ROWS; ++rr) {
                        const __m512 qd = _mm512_set1_ps(qb[rr * head_dim + d]);
                        acc[rr][0] = _mm512_fmadd_ps(qd, k0, acc[rr][0]);
                        acc[rr][1] = _mm512_fmadd_ps(qd, k1, acc[rr][1]);
                    }
                }
                const __m512 scales = _mm512_set1_ps(scale);
                _Pragma("GCC unroll 8") for (int rr = 0; rr < FMA_QK_ROWS; ++rr) {
                    __m512 s0 = _mm512_mul_ps(acc[rr][0], scales), s1 = _mm512_mul_ps(acc[rr][1], scales);
                    if (CAPPED) {   /* scaled, capped, then masked (the reference's order) */
                        const __m512 inv = _mm512_set1_ps(1.0f / softcap), cap = _mm512_set1_ps(softcap);
                        s0 = cap_ps512(s0, inv, cap);
                        s1 = cap_ps512(s1, inv, cap);
                    }
                    _mm512_store_ps(sr + rr * FMA_KEY_BLOCK, _mm512_mask_mov_ps(minus_inf, lo[rb + rr], s0));
                    _mm512_store_ps(sr + rr * FMA_KEY_BLOCK + 16, _mm512_mask_mov_ps(minus_inf, hi[rb + rr], s1));
                }
            }
            /* online softmax of the 16 rows: rows that see no key of the block keep their state */
            __m512 m[FMA_ROW_BLOCK];
            _Pragma("GCC unroll 16") for (int rr = 0; rr < FMA_ROW_BLOCK; ++rr)
                m[rr] = _mm512_max_ps(_mm512_load_ps(p + rr * FMA_KEY_BLOCK), _mm512_load_ps(p + rr * FMA_KEY_BLOCK + 16));
            const __m512 scale_old = online_max_step(reduce_lanes_16(m, 1), row_max + r0, new_max, correction);
            _Pragma("GCC unroll 16") for (int rr = 0; rr < FMA_ROW_BLOCK; ++rr) {
                const __m512 nm = _mm512_set1_ps(new_max[rr]);
                float *pr = p + rr * FMA_KEY_BLOCK;
                const __m512 p0 = _mm512_maskz_mov_ps(lo[rr], exp_ps512(_mm512_sub_ps(_mm512_load_ps(pr), nm)));
                const __m512 p1 = _mm512_maskz_mov_ps(hi[rr], exp_ps512(_mm512_sub_ps(_mm512_load_ps(pr + 16), nm)));
                _mm512_store_ps(pr, p0);
                _mm512_store_ps(pr + 16, p1);
                m[rr] = _mm512_add_ps(p0, p1);
            }
            _mm512_storeu_ps(row_sum + r0, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + r0), scale_old, reduce_lanes_16(m, 0)));
            /* PV: PV_ROWS rows' outputs in registers over the keys any of them sees */
            for (int rb = 0; rb < FMA_ROW_BLOCK; rb += PV_ROWS) {
                int first = FMA_KEY_BLOCK, end = 0;
                for (int rr = rb; rr < rb + PV_ROWS; ++rr)
                    if (visible[rr] > hidden[rr]) {
                        first = hidden[rr] < first ? hidden[rr] : first;
                        end = visible[rr] > end ? visible[rr] : end;
                    }
                if (first >= end) continue;
                float *ob = o + (r0 + rb) * head_dim;
                __m512 acc[4][16];
                _Pragma("GCC unroll 4") for (int rr = 0; rr < PV_ROWS; ++rr) {
                    const __m512 c = _mm512_set1_ps(correction[rb + rr]);
                    for (int j = 0; j < VEC; ++j) acc[rr][j] = _mm512_mul_ps(_mm512_load_ps(ob + rr * head_dim + 16 * j), c);
                }
                for (int t = first; t < end; ++t) {
                    __m512 w[4];
                    _Pragma("GCC unroll 4") for (int rr = 0; rr < PV_ROWS; ++rr) w[rr] = _mm512_set1_ps(p[(rb + rr) * FMA_KEY_BLOCK + t]);
                    _Pragma("GCC unroll 16") for (int j = 0; j < VEC; ++j) {
                        const __m512 v = _mm512_load_ps(vs + t * head_dim + 16 * j);
                        _Pragma("GCC unroll 4") for (int rr = 0; rr < PV_ROWS; ++rr) acc[rr][j] = _mm512_fmadd_ps(w[rr], v, acc[rr][j]);
                    }
                }
                for (int rr = 0; rr < PV_ROWS; ++rr)
                    for (int j = 0; j < VEC; ++j) _mm512_store_ps(ob + rr * head_dim + 16 * j, acc[rr][j]);
            }
        }
    }
    for (int64_t r = 0; r < real_rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        bf16_t *dst = out + ((row0 + i) * num_heads + h) * head_dim;
        const float inv = row_normaliser(row_sum[r], row_max[r], sinks == NULL ? NULL : sinks + h);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = f32_to_bf16(o[r * head_dim + d] * inv);
    }
}

static void prefill_task_fma_any(const bf16_t *query, bf16_t *out, int64_t row0, int64_t i0, int64_t i1,
                                 int64_t context_len, const int32_t *table, const bf16_t *key_cache,
                                 const bf16_t *value_cache, int64_t g, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, float scale, int64_t window,
                                 const float *sinks, float softcap, int64_t rows, float *scratch) {
#define TASK(V, C) prefill_task_fma(V, C, query, out, row0, i0, i1, context_len, table, key_cache, value_cache, g, \
                                    num_heads, num_kv_heads, block_size, scale, window, sinks, softcap, rows, scratch)
#define BY_SIZE(C) switch (head_dim / 16) { \
        case 2: TASK(2, C); break; case 3: TASK(3, C); break; case 4: TASK(4, C); break; \
        case 5: TASK(5, C); break; case 6: TASK(6, C); break; case 7: TASK(7, C); break; \
        case 8: TASK(8, C); break; default: TASK(16, C); break; }
    if (softcap != 0.0f) BY_SIZE(1)
    else BY_SIZE(0)
#undef BY_SIZE
#undef TASK
}

int prefill_attention_bf16_fma_built(void) { return 1; }
#else
static int fma_path_fits(int64_t head_dim) { (void)head_dim; return 0; }
int prefill_attention_bf16_fma_built(void) { return 0; }
#endif

#if defined(__AVX512F__) && defined(__AVX512FP16__)
/* ---- bfloat16 prefill in float16 512-bit FMAs (prefill_task_fp16) ---------------------------
 *
 * Where AVX512-FP16 is (the Intel Xeon of docs/benchmarks.md), a 512-bit float16 FMA issues as
 * often as a float32 one and does twice the products: prefill_task_fma's two products run here
 * in float16, every sum handed to float32 after at most 32 products a lane (as linear_bf16.c's
 * float16 version does), the scores' after 16; the softmax (maxima, exp, sums) stays float32.
 *   - Range: each query row is scaled by a power of 2 to a largest magnitude in [0.5, 1) and
 *     narrowed once per task; each key block's K and V by one power of 2 each (their largest
 *     magnitudes over the block's keys). bfloat16 -> float16 is exact over float16's normal
 *     range, every product is under 1 and every float16 sum under 32: nothing overflows,
 *     whatever the model's scale; the powers of 2 are undone in float32 (exact). Precision is
 *     float16's: a score's error is about 2^-11 of its largest partial sums, so wide scores or
 *     a query dimension far above the others cost more than bfloat16's own rounding
 *     (docs/benchmarks.md, "Where float16 costs accuracy"): a task whose query rows have such a
 *     dimension runs prefill_task_fma instead (fp16_queries_fit); cpu_prefill_bf16_kernel=fma
 *     is the way back for other cases.
 *   - QK: 16 keys a vector, a pair of dimensions a 32-bit lane (K transposed in pairs, as
 *     prefill_task_fma does before widening); a broadcast pair of a query row gives each lane
 *     one product; even and odd lanes are added in float32 after each FP16_QK_PAIRS pairs (16:
 *     a score's float16 error grows with its magnitude, and 32 pairs doubled the largest
 *     error for 4% of the time; docs/benchmarks.md).
 *   - PV: a pair of keys a 32-bit lane, 16 dimensions a vector; a broadcast pair of the rows'
 *     probabilities (rounded to float16, relative 2^-11) gives each lane one product. A block
 *     of FP16_KEY_BLOCK keys is 32 pairs: each lane sums 32 products, then goes into float32
 *     outputs kept per parity of key (the online softmax's corrections scale both), added at
 *     the end.
 * Which bfloat16 prefill runs is the process-wide choice prefill_attention_bf16_select (the
 * engine times it at start-up, backend/model/prefill_attention_choice.py). head_dim 32, 64,
 * 96, 128 or 256 (fp16_path_fits); windows, sinks and soft-capping as every prefill path. */
#define FP16_KEY_BLOCK 64             /* 32 pairs of keys: the most a float16 lane sums in PV */
#define FP16_CHUNKS (FP16_KEY_BLOCK / 16)
#define FP16_ROW_BLOCK 16
#define FP16_QK_ROWS 8
#ifndef FP16_QK_PAIRS
#define FP16_QK_PAIRS 16              /* pairs of dimensions summed in float16 before float32 */
#endif

static int fp16_path_fits(int64_t head_dim) {
    return head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

/* Scratch bytes prefill_task_fp16 needs for ``rows`` (a multiple of FP16_ROW_BLOCK); every piece
 * starts 64-byte aligned (head_dim a multiple of 32). */
static int64_t prefill_fp16_scratch_bytes(int64_t rows, int64_t head_dim) {
    return 2 * rows * head_dim                                       /* queries, float16 */
           + sizeof(float) * (2 * rows * head_dim                    /* outputs, per parity of key */
                              + 3 * rows                             /* row max, sum, score multiplier */
                              + FP16_ROW_BLOCK * FP16_KEY_BLOCK      /* scores, then probabilities */
                              + 2 * FP16_ROW_BLOCK)                  /* new maxima, corrections */
           + 2 * 2 * FP16_KEY_BLOCK * head_dim                       /* K pairs, V pairs, float16 */
           + 2 * FP16_ROW_BLOCK * FP16_KEY_BLOCK;                    /* probabilities, float16 */
}

/* The largest magnitude among n bfloat16 values (a multiple of 32), as the bits of a bfloat16
 * magnitude (their order is the values' order; NaN above infinity), folded into ``top``. */
static inline __attribute__((always_inline)) __m512i bf16_magnitude_max(const bf16_t *src, int64_t n, __m512i top) {
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
    for (int64_t c = 0; c < n; c += 32)
        top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512(src + c), magnitude));
    return top;
}

/* The power of 2 that brings the largest magnitude whose lanes ``top`` holds into [0.5, 1); 1
 * where it is 0 or not finite (NaN and infinities then pass through as in the reference). */
static inline float fp16_range_scale(__m512i top) {
    const __m512i wide = _mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(top)),
                                          _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(top, 1)));
    const uint32_t bits = (uint32_t)_mm512_reduce_max_epu32(wide) << 16;
    float m;
    memcpy(&m, &bits, sizeof m);
    if (!(m > 0.0f) || !isfinite(m)) return 1.0f;
    int e = -(ilogbf(m) + 1);
    e = e > 126 ? 126 : e < -126 ? -126 : e;   /* a normal float32 (its inverse finite): a largest
                                                 magnitude of 2^127 and more scales into [2, 4) */
    return ldexpf(1.0f, e);
}

/* 32 bfloat16 values times ``s``, narrowed to float16 in the same order. */
static inline __attribute__((always_inline)) __m512i narrow_bf16_32(__m512i v, __m512 s) {
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
    const __m256i lo16 = (__m256i)_mm512_cvtxps_ph(_mm512_mul_ps(lo, s));
    const __m256i hi16 = (__m256i)_mm512_cvtxps_ph(_mm512_mul_ps(hi, s));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo16), hi16, 1);
}

/* 16 bfloat16 values times ``s``, narrowed to float16. */
static inline __attribute__((always_inline)) __m256i narrow_bf16_16(const bf16_t *src, __m512 s) {
    return (__m256i)_mm512_cvtxps_ph(_mm512_mul_ps(widen16(src), s));
}

/* A vector of 16 pairs of float16 lanes -> the 16 pairs' sums in float32 (lane i: lanes 2i and
 * 2i + 1). */
static inline __attribute__((always_inline)) __m512 fp16_pair_sums(__m512h acc, __m512i even, __m512i odd) {
    const __m512i bits = _mm512_castph_si512(acc);
    const __m512 lo = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_castsi512_si256(bits)));
    const __m512 hi = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_extracti64x4_epi64(bits, 1)));
    return _mm512_add_ps(_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi));
}

/* Queries [i0, i1) of one sequence, the heads of KV head ``g``, as prefill_task_fma (the same
 * rows, masks and online softmax); VEC = head_dim / 16 and CAPPED are constants
 * (prefill_task_fp16_any). ``rows``: the task's rows rounded up to FP16_ROW_BLOCK. */
static inline __attribute__((always_inline)) void prefill_task_fp16(
        const int VEC, const int CAPPED, const bf16_t *query, bf16_t *out, int64_t row0, int64_t i0, int64_t i1,
        int64_t context_len, const int32_t *table, const bf16_t *key_cache, const bf16_t *value_cache, int64_t g,
        int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale, int64_t window, const float *sinks,
        float softcap, int64_t rows, void *scratch) {
    const int64_t head_dim = 16 * VEC, pairs = 8 * VEC, group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim, real_rows = group * (i1 - i0);
    const int PV_ROWS = fma_pv_rows(VEC);
    uint32_t *restrict qh = scratch;                                /* [rows][pairs] float16 pairs */
    float *restrict o = (float *)(qh + rows * pairs);               /* [rows][VEC][32]: per parity of key */
    float *restrict row_max = o + rows * 2 * head_dim;              /* [rows] */
    float *restrict row_sum = row_max + rows;                       /* [rows] */
    float *restrict row_mult = row_sum + rows;                      /* [rows]: scale / the row's power of 2 */
    float *restrict p = row_mult + rows;                            /* [ROW_BLOCK][KEY_BLOCK] */
    float *restrict new_max = p + FP16_ROW_BLOCK * FP16_KEY_BLOCK, *restrict correction = new_max + FP16_ROW_BLOCK;
    uint32_t *restrict kp = (uint32_t *)(correction + FP16_ROW_BLOCK);   /* [CHUNKS][pairs][16 keys] */
    uint32_t *restrict vp = kp + FP16_KEY_BLOCK * pairs;            /* [KEY_BLOCK / 2][VEC][16 dims] */
    uint32_t *restrict ph = vp + FP16_KEY_BLOCK * pairs;            /* [ROW_BLOCK][KEY_BLOCK / 2] */
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        if (r < real_rows) {
            const bf16_t *src = query + ((row0 + i) * num_heads + h) * head_dim;
            const float s = fp16_range_scale(bf16_magnitude_max(src, head_dim, _mm512_setzero_si512()));
            for (int j = 0; j < VEC; ++j)
                _mm256_store_si256((__m256i *)(qh + r * pairs + 8 * j), narrow_bf16_16(src + 16 * j, _mm512_set1_ps(s)));
            row_mult[r] = scale / s;
        } else {
            memset(qh + r * pairs, 0, sizeof(uint32_t) * pairs);
            row_mult[r] = 0.0f;
        }
        memset(o + r * 2 * head_dim, 0, sizeof(float) * 2 * head_dim);
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    const int64_t last_key = context_len + i1 - 1;     /* the tile's last query sees keys 0..last_key */
    for (int64_t j0 = prefill_first_key(context_len + i0, window); j0 <= last_key; j0 += FP16_KEY_BLOCK) {
        const int keys = (int)(last_key + 1 - j0 < FP16_KEY_BLOCK ? last_key + 1 - j0 : FP16_KEY_BLOCK);
        const int chunks = (keys + 15) / 16;
        int64_t at[FP16_KEY_BLOCK];
        __m512i ktop = _mm512_setzero_si512(), vtop = _mm512_setzero_si512();
        for (int64_t t = 0, block = j0 / block_size, slot = j0 % block_size; t < keys; ++t) {
            at[t] = ((int64_t)table[block] * block_size + slot) * token_stride + g * head_dim;
            if (++slot == block_size) slot = 0, ++block;
            ktop = bf16_magnitude_max(key_cache + at[t], head_dim, ktop);
            vtop = bf16_magnitude_max(value_cache + at[t], head_dim, vtop);
        }
        const float ks = fp16_range_scale(ktop), vs = fp16_range_scale(vtop);
        const __m512 kscale = _mm512_set1_ps(ks), vscale = _mm512_set1_ps(vs), vinv = _mm512_set1_ps(1.0f / vs);
        /* K: kp[(c * pairs + i) * 16 + t] = key 16c + t's dimensions 2i, 2i + 1 (zeros past the keys) */
        for (int c = 0; c < (chunks + 1) / 2 * 2; ++c)   /* QK takes chunks two at a time */
            for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
                __m512i r[16];
                for (int t = 0; t < 16; ++t)
                    r[t] = 16 * c + t < keys ? _mm512_loadu_si512(key_cache + at[16 * c + t] + d0) : _mm512_setzero_si512();
                transpose_16x16((__m512 *)r);
                for (int i = 0; i < 16; ++i)
                    _mm512_store_si512(kp + (c * pairs + d0 / 2 + i) * 16, narrow_bf16_32(r[i], kscale));
            }
        /* V: vp[(jp * VEC + j) * 16 + d] = keys 2jp, 2jp + 1 at dimension 16j + d (zeros past the keys) */
        for (int jp = 0; jp < (keys + 1) / 2; ++jp)
            for (int j = 0; j < VEC; ++j) {
                const __m256i a = narrow_bf16_16(value_cache + at[2 * jp] + 16 * j, vscale);
                const __m256i b = 2 * jp + 1 < keys ? narrow_bf16_16(value_cache + at[2 * jp + 1] + 16 * j, vscale)
                                                    : _mm256_setzero_si256();
                _mm512_store_si512(vp + (jp * VEC + j) * 16,
                                   _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
            }
        for (int64_t r0 = 0; r0 < real_rows; r0 += FP16_ROW_BLOCK) {
            int visible[FP16_ROW_BLOCK], hidden[FP16_ROW_BLOCK];
            __mmask16 mask[FP16_ROW_BLOCK][FP16_CHUNKS];
            int any = 0;
            for (int rr = 0; rr < FP16_ROW_BLOCK; ++rr) {
                row_key_range(r0 + rr, real_rows, group, context_len, i0, j0, keys, window, &visible[rr], &hidden[rr]);
                const int v = visible[rr], before = hidden[rr];
                const uint64_t bits = (v >= 64 ? ~0ull : (1ull << v) - 1) & ~(before >= 64 ? ~0ull : (1ull << before) - 1);
                for (int c = 0; c < FP16_CHUNKS; ++c) mask[rr][c] = (__mmask16)(bits >> (16 * c));
                any |= v > before;
            }
            if (!any) continue;     /* the whole block is in these rows' future (or before their windows) */
            /* scores: FP16_QK_ROWS rows x 32 keys at a time, scaled, capped and masked */
            for (int rb = 0; rb < FP16_ROW_BLOCK; rb += FP16_QK_ROWS) {
                int active = 0;
                for (int rr = rb; rr < rb + FP16_QK_ROWS; ++rr) active |= visible[rr] > hidden[rr];
                for (int c0 = 0; c0 < FP16_CHUNKS; c0 += 2) {
                    float *sr = p + rb * FP16_KEY_BLOCK + 16 * c0;
                    if (!active || c0 >= chunks) {
                        for (int rr = 0; rr < FP16_QK_ROWS; ++rr) {
                            _mm512_store_ps(sr + rr * FP16_KEY_BLOCK, minus_inf);
                            _mm512_store_ps(sr + rr * FP16_KEY_BLOCK + 16, minus_inf);
                        }
                        continue;
                    }
                    const uint32_t *qb = qh + (r0 + rb) * pairs;
                    const uint32_t *k0 = kp + c0 * pairs * 16, *k1 = k0 + pairs * 16;   /* chunk c0 + 1: zeros past the keys */
                    for (int64_t s0 = 0; s0 < pairs; s0 += FP16_QK_PAIRS) {
                        const int64_t s1 = pairs - s0 < FP16_QK_PAIRS ? pairs : s0 + FP16_QK_PAIRS;
                        __m512h acc[FP16_QK_ROWS][2];
                        _Pragma("GCC unroll 8") for (int rr = 0; rr < FP16_QK_ROWS; ++rr)
                            acc[rr][0] = acc[rr][1] = _mm512_setzero_ph();
                        for (int64_t i = s0; i < s1; ++i) {
                            const __m512h ka = _mm512_castsi512_ph(_mm512_load_si512(k0 + i * 16));
                            const __m512h kb = _mm512_castsi512_ph(_mm512_load_si512(k1 + i * 16));
                            _Pragma("GCC unroll 8") for (int rr = 0; rr < FP16_QK_ROWS; ++rr) {
                                const __m512h qv = _mm512_castsi512_ph(_mm512_set1_epi32((int)qb[rr * pairs + i]));
                                acc[rr][0] = _mm512_fmadd_ph(qv, ka, acc[rr][0]);
                                acc[rr][1] = _mm512_fmadd_ph(qv, kb, acc[rr][1]);
                            }
                        }
                        _Pragma("GCC unroll 8") for (int rr = 0; rr < FP16_QK_ROWS; ++rr)
                            for (int half = 0; half < 2; ++half) {
                                float *to = sr + rr * FP16_KEY_BLOCK + 16 * half;
                                const __m512 sum = fp16_pair_sums(acc[rr][half], even, odd);
                                _mm512_store_ps(to, s0 == 0 ? sum : _mm512_add_ps(_mm512_load_ps(to), sum));
                            }
                    }
                    _Pragma("GCC unroll 8") for (int rr = 0; rr < FP16_QK_ROWS; ++rr) {
                        const __m512 mult = _mm512_set1_ps(row_mult[r0 + rb + rr] / ks);
                        for (int half = 0; half < 2; ++half) {
                            float *to = sr + rr * FP16_KEY_BLOCK + 16 * half;
                            __m512 s = _mm512_mul_ps(_mm512_load_ps(to), mult);
                            if (CAPPED) s = cap_ps512(s, _mm512_set1_ps(1.0f / softcap), _mm512_set1_ps(softcap));
                            _mm512_store_ps(to, _mm512_mask_mov_ps(minus_inf, mask[rb + rr][c0 + half], s));
                        }
                    }
                }
            }
            /* online softmax of the 16 rows (float32); probabilities also narrowed to float16 pairs */
            __m512 m[FP16_ROW_BLOCK];
            _Pragma("GCC unroll 16") for (int rr = 0; rr < FP16_ROW_BLOCK; ++rr) {
                const float *pr = p + rr * FP16_KEY_BLOCK;
                m[rr] = _mm512_max_ps(_mm512_max_ps(_mm512_load_ps(pr), _mm512_load_ps(pr + 16)),
                                      _mm512_max_ps(_mm512_load_ps(pr + 32), _mm512_load_ps(pr + 48)));
            }
            const __m512 scale_old = online_max_step(reduce_lanes_16(m, 1), row_max + r0, new_max, correction);
            _Pragma("GCC unroll 16") for (int rr = 0; rr < FP16_ROW_BLOCK; ++rr) {
                const __m512 nm = _mm512_set1_ps(new_max[rr]);
                const float *pr = p + rr * FP16_KEY_BLOCK;
                __m512 sum = _mm512_setzero_ps();
                for (int c = 0; c < FP16_CHUNKS; ++c) {
                    const __m512 e = _mm512_maskz_mov_ps(mask[rr][c], exp_ps512(_mm512_sub_ps(_mm512_load_ps(pr + 16 * c), nm)));
                    _mm256_store_si256((__m256i *)(ph + rr * (FP16_KEY_BLOCK / 2) + 8 * c), (__m256i)_mm512_cvtxps_ph(e));
                    sum = _mm512_add_ps(sum, e);
                }
                m[rr] = sum;
            }
            _mm512_storeu_ps(row_sum + r0, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum + r0), scale_old, reduce_lanes_16(m, 0)));
            /* PV: PV_ROWS rows' outputs in float16 registers over the pairs of keys any of them sees */
            for (int rb = 0; rb < FP16_ROW_BLOCK; rb += PV_ROWS) {
                int first = FP16_KEY_BLOCK, end = 0;
                for (int rr = rb; rr < rb + PV_ROWS; ++rr)
                    if (visible[rr] > hidden[rr]) {
                        first = hidden[rr] < first ? hidden[rr] : first;
                        end = visible[rr] > end ? visible[rr] : end;
                    }
                if (first >= end) continue;   /* correction 1: these rows keep their state */
                __m512h acc[4][16];
                _Pragma("GCC unroll 4") for (int rr = 0; rr < PV_ROWS; ++rr)
                    for (int j = 0; j < VEC; ++j) acc[rr][j] = _mm512_setzero_ph();
                for (int jp = first / 2; jp < (end + 1) / 2; ++jp) {
                    __m512h w[4];
                    _Pragma("GCC unroll 4") for (int rr = 0; rr < PV_ROWS; ++rr)
                        w[rr] = _mm512_castsi512_ph(_mm512_set1_epi32((int)ph[(rb + rr) * (FP16_KEY_BLOCK / 2) + jp]));
                    _Pragma("GCC unroll 16") for (int j = 0; j < VEC; ++j) {
                        const __m512h v = _mm512_castsi512_ph(_mm512_load_si512(vp + (jp * VEC + j) * 16));
                        _Pragma("GCC unroll 4") for (int rr = 0; rr < PV_ROWS; ++rr) acc[rr][j] = _mm512_fmadd_ph(w[rr], v, acc[rr][j]);
                    }
                }
                _Pragma("GCC unroll 4") for (int rr = 0; rr < PV_ROWS; ++rr) {
                    const __m512 c = _mm512_set1_ps(correction[rb + rr]);
                    float *ob = o + (r0 + rb + rr) * 2 * head_dim;
                    for (int j = 0; j < VEC; ++j) {
                        const __m512i bits = _mm512_castph_si512(acc[rr][j]);
                        const __m512 lo = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_castsi512_si256(bits)));
                        const __m512 hi = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_extracti64x4_epi64(bits, 1)));
                        _mm512_store_ps(ob + 32 * j, _mm512_fmadd_ps(lo, vinv, _mm512_mul_ps(_mm512_load_ps(ob + 32 * j), c)));
                        _mm512_store_ps(ob + 32 * j + 16,
                                        _mm512_fmadd_ps(hi, vinv, _mm512_mul_ps(_mm512_load_ps(ob + 32 * j + 16), c)));
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < real_rows; ++r) {
        const int64_t i = i0 + r / group, h = g * group + r % group;
        bf16_t *dst = out + ((row0 + i) * num_heads + h) * head_dim;
        const __m512 inv = _mm512_set1_ps(row_normaliser(row_sum[r], row_max[r], sinks == NULL ? NULL : sinks + h));
        float done[16] __attribute__((aligned(64)));
        for (int j = 0; j < VEC; ++j) {
            /* lanes 2d and 2d + 1 of the 32 floats: dimension 16j + d from even and odd keys */
            const __m512 lo = _mm512_load_ps(o + r * 2 * head_dim + 32 * j), hi = _mm512_load_ps(o + r * 2 * head_dim + 32 * j + 16);
            _mm512_store_ps(done, _mm512_mul_ps(_mm512_add_ps(_mm512_permutex2var_ps(lo, even, hi),
                                                              _mm512_permutex2var_ps(lo, odd, hi)), inv));
            for (int d = 0; d < 16; ++d) dst[16 * j + d] = f32_to_bf16(done[d]);
        }
    }
}

/* Whether a task's query rows suit float16 sums: no row has an element more than
 * FP16_QUERY_OUTLIER times the RMS of its other elements. One dimension that far above the rest
 * dominates every float16 partial sum of the scores and their error with it (2^8 above: 0.033 of
 * the output's largest, against 0.0052 at 2^4; docs/benchmarks.md); such a task runs
 * prefill_task_fma instead. Random rows of 128 have a ratio of about 3-4. */
#define FP16_QUERY_OUTLIER 32.0f
static int fp16_queries_fit(const bf16_t *query, int64_t row0, int64_t i0, int64_t i1, int64_t g, int64_t group,
                            int64_t num_heads, int64_t head_dim) {
    for (int64_t i = i0; i < i1; ++i)
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const bf16_t *row = query + ((row0 + i) * num_heads + h) * head_dim;
            float top = 0.0f, squares = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) {
                const float x = bf16_to_f32(row[d]);
                squares += x * x;
                top = fabsf(x) > top ? fabsf(x) : top;
            }
            const float rest = (squares - top * top) / (float)(head_dim - 1);
            if (!(top * top <= FP16_QUERY_OUTLIER * FP16_QUERY_OUTLIER * (rest > 0.0f ? rest : 0.0f)) && top > 0.0f)
                return 0;
        }
    return 1;
}

static void prefill_task_fp16_any(const bf16_t *query, bf16_t *out, int64_t row0, int64_t i0, int64_t i1,
                                  int64_t context_len, const int32_t *table, const bf16_t *key_cache,
                                  const bf16_t *value_cache, int64_t g, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, float scale, int64_t window,
                                  const float *sinks, float softcap, int64_t rows, void *scratch) {
#define TASK(V, C) prefill_task_fp16(V, C, query, out, row0, i0, i1, context_len, table, key_cache, value_cache, g, \
                                     num_heads, num_kv_heads, block_size, scale, window, sinks, softcap, rows, scratch)
#define BY_SIZE(C) switch (head_dim) { \
        case 32: TASK(2, C); break; case 64: TASK(4, C); break; case 96: TASK(6, C); break; \
        case 128: TASK(8, C); break; default: TASK(16, C); break; }
    if (softcap != 0.0f) BY_SIZE(1)
    else BY_SIZE(0)
#undef BY_SIZE
#undef TASK
}

int prefill_attention_bf16_fp16_built(void) { return 1; }
#else
static int fp16_path_fits(int64_t head_dim) { (void)head_dim; return 0; }
static int fp16_queries_fit(const bf16_t *query, int64_t row0, int64_t i0, int64_t i1, int64_t g, int64_t group,
                            int64_t num_heads, int64_t head_dim) {
    (void)query, (void)row0, (void)i0, (void)i1, (void)g, (void)group, (void)num_heads, (void)head_dim;
    return 0;
}
int prefill_attention_bf16_fp16_built(void) { return 0; }
#endif

/* Which bfloat16 prefill function this process runs (prefill_attention_bf16_select). */
enum prefill_bf16_kernel { PREFILL_BF16_OWN = 0, PREFILL_BF16_FMA = 1, PREFILL_BF16_FP16 = 2, PREFILL_BF16_DP_PV = 3 };
static int prefill_bf16_kernel = PREFILL_BF16_OWN;

/* prefill_task_dp with P x V in dot products too: built with the dot-product function. */
int prefill_attention_bf16_dp_pv_built(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Select the bfloat16 prefill function for this process: the build's own (0, until asked), the
 * float32-FMA one (1), the float16 one (2) or the dot products for both products (3); one the
 * build lacks selects the build's own. Returns the one now selected. */
int prefill_attention_bf16_select(int kernel) {
    prefill_bf16_kernel = (kernel == PREFILL_BF16_FMA && prefill_attention_bf16_fma_built()) ||
                          (kernel == PREFILL_BF16_FP16 && prefill_attention_bf16_fp16_built()) ||
                          (kernel == PREFILL_BF16_DP_PV && prefill_attention_bf16_dp_pv_built()) ? kernel : PREFILL_BF16_OWN;
    return prefill_bf16_kernel;
}

int prefill_attention_bf16_selected(void) { return prefill_bf16_kernel; }

/* Which function prefill() runs for bfloat16 at this head size: 3 for prefill_task_fma, 4 for
 * prefill_task_fp16, 5 for prefill_task_dp with P x V in dot products (where selected and the
 * size fits), else attention_path(1, head_dim)'s answer. */
#define ATTENTION_AVX512_FMA 3
#define ATTENTION_AVX512_FP16 4
#define ATTENTION_AVX512_BF16_PV 5
/* Queries per prefill_task_fma task: with a GQA group of 3, 192 rows share each widened K and V
 * block (32 queries, as the other prefill functions take, left the widening a larger share). */
#ifndef FMA_QUERY_TILE
#define FMA_QUERY_TILE 64
#endif
#ifndef DP_PV_QUERY_TILE
#define DP_PV_QUERY_TILE 64
#endif
int prefill_attention_bf16_path(int64_t head_dim) {
    if (prefill_bf16_kernel == PREFILL_BF16_FMA && fma_path_fits(head_dim)) return ATTENTION_AVX512_FMA;
    if (prefill_bf16_kernel == PREFILL_BF16_FP16 && fp16_path_fits(head_dim)) return ATTENTION_AVX512_FP16;
    /* dp-pv is selected only where built: it serves the sizes the dot-product function does */
    if (prefill_bf16_kernel == PREFILL_BF16_DP_PV && attention_path(1, head_dim) == ATTENTION_AVX512_BF16)
        return ATTENTION_AVX512_BF16_PV;
    return attention_path(1, head_dim);
}

/* Every prefill sequence of a step: sequence s owns packed rows q_starts[s] ..
 * q_starts[s] + q_lens[s], the last q_lens[s] of its seq_lens[s] tokens. Tasks (sequence,
 * KV head, query tile) go to OpenMP threads. ``window``, ``sinks`` and ``softcap`` as the file's
 * first comment says. Returns 0, or -1 when scratch allocation failed. */
static int prefill(const void *query, void *out, int is_bf16, const int64_t *q_starts, const int64_t *q_lens,
                   const int64_t *seq_lens, const int32_t *block_tables, int64_t block_table_stride,
                   const void *key_cache, const void *value_cache, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                   const float *sinks, float softcap, int num_threads) {
    /* the float32-FMA, float16 or dp-pv bfloat16 function where selected (prefill_attention_bf16_select) */
    const int bf16_path = is_bf16 ? prefill_attention_bf16_path(head_dim) : -1;
    const int fma = bf16_path == ATTENTION_AVX512_FMA, fp16 = bf16_path == ATTENTION_AVX512_FP16;
    const int dp_pv = bf16_path == ATTENTION_AVX512_BF16_PV;
    const int64_t query_tile = fma || fp16 ? FMA_QUERY_TILE : dp_pv ? DP_PV_QUERY_TILE : PREFILL_QUERY_TILE;
    int64_t num_tasks = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        num_tasks += num_kv_heads * ((q_lens[s] + query_tile - 1) / query_tile);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t rows = (group * PREFILL_QUERY_TILE + PREFILL_ROWS_AT_ONCE - 1) / PREFILL_ROWS_AT_ONCE *
                         PREFILL_ROWS_AT_ONCE;
    int failed = 0;
    /* Tasks late in a sequence read more keys: the last tiles first, dynamic, to balance. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t task = 0; task < num_tasks; ++task) {
        int64_t rest = task, s = 0;
        for (;; ++s) {
            const int64_t seq_tasks = num_kv_heads * ((q_lens[s] + query_tile - 1) / query_tile);
            if (rest < seq_tasks) break;
            rest -= seq_tasks;
        }
        const int64_t tiles = (q_lens[s] + query_tile - 1) / query_tile;
        const int64_t tile = tiles - 1 - rest / num_kv_heads, g = rest % num_kv_heads;
        const int64_t i0 = tile * query_tile;
        const int64_t i1 = i0 + query_tile < q_lens[s] ? i0 + query_tile : q_lens[s];
        const int64_t task_rows = (group * (i1 - i0) + PREFILL_ROWS_AT_ONCE - 1) / PREFILL_ROWS_AT_ONCE *
                                  PREFILL_ROWS_AT_ONCE;
        /* A window at least as long as the sequence hides no key: such tasks run unwindowed. */
        const int64_t task_window = window > 0 && window < seq_lens[s] ? window : 0;
        /* a float16 task whose queries do not suit float16 sums runs the float32-FMA function */
        const int task_fp16 = fp16 && fp16_queries_fit((const bf16_t *)query, q_starts[s], i0, i1, g, group,
                                                       num_heads, head_dim);
        (void)task_fp16;   /* builds without AVX-512F run neither */
#if defined(__AVX512F__)
        if (fma || (fp16 && !task_fp16)) {
            const int64_t fma_rows = (group * FMA_QUERY_TILE + FMA_ROW_BLOCK - 1) / FMA_ROW_BLOCK * FMA_ROW_BLOCK;
            const int64_t bytes = (prefill_fma_scratch_bytes(fma_rows, head_dim) + 63) / 64 * 64;
            float *scratch = aligned_alloc(64, bytes);
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            prefill_task_fma_any(query, out, q_starts[s], i0, i1, seq_lens[s] - q_lens[s],
                                 block_tables + s * block_table_stride, key_cache, value_cache, g, num_heads,
                                 num_kv_heads, head_dim, block_size, scale, task_window, sinks, softcap,
                                 (group * (i1 - i0) + FMA_ROW_BLOCK - 1) / FMA_ROW_BLOCK * FMA_ROW_BLOCK, scratch);
            free(scratch);
            continue;
        }
#endif
#if defined(__AVX512F__) && defined(__AVX512FP16__)
        if (task_fp16) {
            const int64_t fp16_rows = (group * FMA_QUERY_TILE + FP16_ROW_BLOCK - 1) / FP16_ROW_BLOCK * FP16_ROW_BLOCK;
            void *scratch = aligned_alloc(64, (prefill_fp16_scratch_bytes(fp16_rows, head_dim) + 63) / 64 * 64);
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            prefill_task_fp16_any(query, out, q_starts[s], i0, i1, seq_lens[s] - q_lens[s],
                                  block_tables + s * block_table_stride, key_cache, value_cache, g, num_heads,
                                  num_kv_heads, head_dim, block_size, scale, task_window, sinks, softcap,
                                  (group * (i1 - i0) + FP16_ROW_BLOCK - 1) / FP16_ROW_BLOCK * FP16_ROW_BLOCK, scratch);
            free(scratch);
            continue;
        }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        if (attention_path(is_bf16, head_dim) == ATTENTION_AVX512_BF16) {
            const int64_t dp_rows = (group * query_tile + PREFILL_ROW_BLOCK - 1) / PREFILL_ROW_BLOCK * PREFILL_ROW_BLOCK;
            void *scratch = malloc(prefill_dp_scratch_bytes(dp_rows, head_dim));
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            prefill_task_dp_any(query, out, q_starts[s], i0, i1, seq_lens[s] - q_lens[s],
                                block_tables + s * block_table_stride, key_cache, value_cache, g, num_heads,
                                num_kv_heads, head_dim, block_size, scale, task_window, sinks, softcap,
                                (group * (i1 - i0) + PREFILL_ROW_BLOCK - 1) / PREFILL_ROW_BLOCK * PREFILL_ROW_BLOCK,
                                scratch, dp_pv);
            free(scratch);
            continue;
        }
#endif
#if AVX2_ATTENTION
        if (attention_path(is_bf16, head_dim) == ATTENTION_AVX2) {
            float *scratch = malloc(sizeof(float) * prefill_lanes_scratch_floats((rows + LANES - 1) / LANES, head_dim));
            if (scratch == NULL) {
                failed = 1;
                continue;
            }
            prefill_task_lanes(query, out, is_bf16, q_starts[s], i0, i1, seq_lens[s] - q_lens[s],
                               block_tables + s * block_table_stride, key_cache, value_cache, g, num_heads,
                               num_kv_heads, head_dim, block_size, scale, task_window, sinks, softcap, scratch);
            free(scratch);
            continue;
        }
#endif
        float *scratch = malloc(sizeof(float) * prefill_scratch_floats(rows, head_dim));
        if (scratch == NULL) {
            failed = 1;
            continue;
        }
        prefill_task(query, out, is_bf16, q_starts[s], i0, i1, seq_lens[s] - q_lens[s],
                     block_tables + s * block_table_stride, key_cache, value_cache, g, num_heads, num_kv_heads,
                     head_dim, block_size, scale, task_window, sinks, softcap, task_rows, scratch);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* The exported prefill functions: as the decode ones, the old arguments run uncapped (decoder.c
 * calls them), the _softcap ones take ``softcap`` (0: off) before num_threads. */
int paged_prefill_attention_f32(const float *query, float *out, const int64_t *q_starts, const int64_t *q_lens,
                                const int64_t *seq_lens, const int32_t *block_tables, int64_t block_table_stride,
                                const float *key_cache, const float *value_cache, int64_t num_seqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                int64_t window, const float *sinks, int num_threads) {
    return prefill(query, out, 0, q_starts, q_lens, seq_lens, block_tables, block_table_stride, key_cache,
                   value_cache, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, 0.0f,
                   num_threads);
}

int paged_prefill_attention_softcap_f32(const float *query, float *out, const int64_t *q_starts,
                                        const int64_t *q_lens, const int64_t *seq_lens, const int32_t *block_tables,
                                        int64_t block_table_stride, const float *key_cache, const float *value_cache,
                                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                        int64_t block_size, float scale, int64_t window, const float *sinks,
                                        float softcap, int num_threads) {
    return prefill(query, out, 0, q_starts, q_lens, seq_lens, block_tables, block_table_stride, key_cache,
                   value_cache, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, softcap,
                   num_threads);
}

int paged_prefill_attention_bf16(const bf16_t *query, bf16_t *out, const int64_t *q_starts, const int64_t *q_lens,
                                 const int64_t *seq_lens, const int32_t *block_tables, int64_t block_table_stride,
                                 const bf16_t *key_cache, const bf16_t *value_cache, int64_t num_seqs,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, const float *sinks, int num_threads) {
    return prefill(query, out, 1, q_starts, q_lens, seq_lens, block_tables, block_table_stride, key_cache,
                   value_cache, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, 0.0f,
                   num_threads);
}

int paged_prefill_attention_softcap_bf16(const bf16_t *query, bf16_t *out, const int64_t *q_starts,
                                         const int64_t *q_lens, const int64_t *seq_lens,
                                         const int32_t *block_tables, int64_t block_table_stride,
                                         const bf16_t *key_cache, const bf16_t *value_cache, int64_t num_seqs,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                         int64_t block_size, float scale, int64_t window, const float *sinks,
                                         float softcap, int num_threads) {
    return prefill(query, out, 1, q_starts, q_lens, seq_lens, block_tables, block_table_stride, key_cache,
                   value_cache, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, sinks, softcap,
                   num_threads);
}
