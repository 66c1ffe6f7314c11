/* Every decoder layer of one CPU step in one call: the sequence of C kernels the model's Python
 * layer loop (CausalLM._decoder_fused in backend/model/llama.py, the reference this is tested
 * against) calls, in the same order with the same arguments, so the results are the same bits.
 *
 * Why: the Python loop costs time between the kernels of every layer (module calls, argument
 * checks, ~12 ctypes calls, output allocations): a noticeable share of what the 30 layers of a
 * 16-sequence bfloat16 decode step take (docs/benchmarks.md, "The decoder layers in one C
 * call"). Here that is one ctypes call a step.
 *
 * Per layer, for float32 or bfloat16 (all of a model's tensors one dtype; biases float32):
 *   qkv = x Wqkv^T (+ b); RoPE on q, k and the K/V cache write; q copied out contiguous;
 *   attention of the decode rows and of the prefill rows; a = o Wo^T; h += a, x = RMSNorm(h);
 *   gate|up = x Wgu^T; gate = SiLU(gate) * up; m = gate Wdown^T; h += m, x = RMSNorm(h) with the
 *   next layer's weight (after the last layer h += m only).
 * The first layer's input norm runs first. h: the residual stream [tokens, hidden], in place.
 *
 * A projection without packed weights (oneDNN's, torch's or int8's on the Python side; or, in a
 * step with LoRA adapters, every projection they adapt) is handed back to the caller: ``external`` reads
 * the projection's input from the scratch (the layout is decoder_scratch_layout's; the down
 * projection's, from an external gate|up's own output) and returns where its output is, which
 * the rest of the layer then reads, as the Python loop reads the module's output.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* The kernels this calls (paged_attention.c, linear_f32.c, linear_bf16.c, layer_ops.c). */
int linear_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n, const float *bias,
               float *y, int num_threads);
int linear_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                const float *bias, uint16_t *y, int num_threads);
void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out, int64_t rows,
                      int64_t hidden, float eps);
void add_rms_norm_bf16(bf16_t *residual, const bf16_t *delta, const bf16_t *weight, bf16_t *out, int64_t rows,
                       int64_t hidden, float eps);
void rope_and_cache_f32(float *qkv, int64_t qkv_stride, const float *cos, const float *sin, const int64_t *slots,
                        float *key_cache, float *value_cache, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim);
void rope_and_cache_bf16(bf16_t *qkv, int64_t qkv_stride, const bf16_t *cos, const bf16_t *sin, const int64_t *slots,
                         bf16_t *key_cache, bf16_t *value_cache, int64_t tokens, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim);
void silu_and_mul_f32(float *x, int64_t rows, int64_t inter, int64_t ld, int num_threads);
void silu_and_mul_bf16(bf16_t *x, int64_t rows, int64_t inter, int64_t ld, int num_threads);
int paged_decode_attention_f32(const float *query, float *out, const int64_t *rows, const int64_t *seq_lens,
                               const int32_t *block_tables, int64_t block_table_stride, const float *key_cache,
                               const float *value_cache, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int64_t window, const float *sinks,
                               int num_threads);
int paged_decode_attention_bf16(const bf16_t *query, bf16_t *out, const int64_t *rows, const int64_t *seq_lens,
                                const int32_t *block_tables, int64_t block_table_stride, const bf16_t *key_cache,
                                const bf16_t *value_cache, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, float scale, int64_t window,
                                const float *sinks, int num_threads);
int paged_prefill_attention_f32(const float *query, float *out, const int64_t *q_starts, const int64_t *q_lens,
                                const int64_t *seq_lens, const int32_t *block_tables, int64_t block_table_stride,
                                const float *key_cache, const float *value_cache, int64_t num_seqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                int64_t window, const float *sinks, int num_threads);
int paged_prefill_attention_bf16(const bf16_t *query, bf16_t *out, const int64_t *q_starts, const int64_t *q_lens,
                                 const int64_t *seq_lens, const int32_t *block_tables, int64_t block_table_stride,
                                 const bf16_t *key_cache, const bf16_t *value_cache, int64_t num_seqs,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, const float *sinks, int num_threads);

/* One layer's weights and cache, as the engine packed them (backend/model/cpu_decoder.py mirrors
 * these structs field for field). */
typedef struct {
    const void *input_norm, *post_norm;            /* [hidden], the model's dtype */
    const void *qkv, *o, *gate_up, *down;          /* packed for linear_f32 / linear_bf16 */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;   /* float32 or NULL */
    void *key_cache, *value_cache;                 /* [blocks, block_size, kv_heads, head_dim] */
} decoder_layer_t;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} decoder_shape_t;

/* One step: its rows, RoPE tables, cache slots, and the attention plan's decode and prefill
 * parts (kernels/cpu_attention.py: CpuAttentionPlan), either count 0 when absent. */
typedef struct {
    int64_t tokens;
    const void *cos, *sin;                         /* [tokens, head_dim], the model's dtype */
    const int64_t *slots;                          /* [tokens]: < 0 not written */
    int64_t num_decodes, decode_table_stride;
    const int64_t *decode_rows, *decode_seq_lens;
    const int32_t *decode_tables;
    int64_t num_prefills, prefill_table_stride;
    const int64_t *prefill_starts, *prefill_query_lens, *prefill_seq_lens;
    const int32_t *prefill_tables;
    /* Nonzero: the step also has prefill rows that ``external`` attends (EXTERNAL_PREFILL_ATTENTION). */
    int64_t external_prefill_attention;
} decoder_step_t;

/* Which projection an external call is for (backend/model/cpu_decoder.py: Projection). */
enum { PROJECTION_QKV, PROJECTION_O, PROJECTION_GATE_UP, PROJECTION_DOWN };

/* Runs projection ``projection`` of layer ``layer`` outside C, its input read from the scratch.
 * Returns where its output is (contiguous [tokens, n], the model's dtype; valid until the next
 * call for the same projection: the caller keeps it), or NULL to stop the step. */
typedef void *(*external_projection_t)(int64_t layer, int64_t projection);

/* Not a projection: the id ``external`` is called with, once a layer, for the prefill rows the
 * caller attends itself (prefills through torch's SDPA: kernels/cpu_attention.py). It reads
 * q from the scratch and the layer's caches, and writes those rows of the attention output in
 * the scratch; the pointer it returns only says it succeeded (NULL: stop the step). */
enum { EXTERNAL_PREFILL_ATTENTION = 4 };

/* Status codes of decoder_layers. */
enum { DECODER_OK = 0, DECODER_NO_MEMORY = -1, DECODER_EXTERNAL_FAILED = -2, DECODER_NO_EXTERNAL = -3 };

/* y = x W^T (+ bias) into ``*y`` (the scratch) with our kernel; without packed weights, by
 * ``external``, whose output ``*y`` then points to. */
static int project(int is_bf16, const void *x, int64_t m, int64_t k, int64_t ldx, const void *packed, int64_t n,
                   const float *bias, void **y, int num_threads, external_projection_t external, int64_t layer,
                   int projection) {
    if (packed == NULL) {
        if (external == NULL) return DECODER_NO_EXTERNAL;
        void *out = external(layer, projection);
        if (out == NULL) return DECODER_EXTERNAL_FAILED;
        *y = out;
        return DECODER_OK;
    }
    return is_bf16 ? linear_bf16(x, m, k, ldx, packed, n, bias, *y, num_threads)
                   : linear_f32(x, m, k, ldx, packed, n, bias, *y, num_threads);
}

static void add_rms_norm(int is_bf16, void *h, const void *delta, const void *weight, void *x, int64_t rows,
                         int64_t hidden, float eps) {
    if (is_bf16) add_rms_norm_bf16(h, delta, weight, x, rows, hidden, eps);
    else add_rms_norm_f32(h, delta, weight, x, rows, hidden, eps);
}

/* No window (0) and no sinks (NULL): the layer loop declines the families that have them
 * (backend/model/cpu_decoder.py). */
static int attend(int is_bf16, const decoder_shape_t *s, const decoder_step_t *step, const decoder_layer_t *layer,
                  const void *q, void *out, int num_threads, external_projection_t external, int64_t layer_index) {
    int status = 0;
    if (step->num_decodes > 0) {
        status = is_bf16
            ? paged_decode_attention_bf16(q, out, step->decode_rows, step->decode_seq_lens, step->decode_tables,
                                          step->decode_table_stride, layer->key_cache, layer->value_cache,
                                          step->num_decodes, s->num_heads, s->num_kv_heads, s->head_dim,
                                          s->block_size, s->scale, 0, NULL, num_threads)
            : paged_decode_attention_f32(q, out, step->decode_rows, step->decode_seq_lens, step->decode_tables,
                                         step->decode_table_stride, layer->key_cache, layer->value_cache,
                                         step->num_decodes, s->num_heads, s->num_kv_heads, s->head_dim,
                                         s->block_size, s->scale, 0, NULL, num_threads);
    }
    if (status == 0 && step->num_prefills > 0) {
        status = is_bf16
            ? paged_prefill_attention_bf16(q, out, step->prefill_starts, step->prefill_query_lens,
                                           step->prefill_seq_lens, step->prefill_tables, step->prefill_table_stride,
                                           layer->key_cache, layer->value_cache, step->num_prefills, s->num_heads,
                                           s->num_kv_heads, s->head_dim, s->block_size, s->scale, 0, NULL, num_threads)
            : paged_prefill_attention_f32(q, out, step->prefill_starts, step->prefill_query_lens,
                                          step->prefill_seq_lens, step->prefill_tables, step->prefill_table_stride,
                                          layer->key_cache, layer->value_cache, step->num_prefills, s->num_heads,
                                          s->num_kv_heads, s->head_dim, s->block_size, s->scale, 0, NULL, num_threads);
    }
    if (status == 0 && step->external_prefill_attention) {
        if (external == NULL) return DECODER_NO_EXTERNAL;
        if (external(layer_index, EXTERNAL_PREFILL_ATTENTION) == NULL) return DECODER_EXTERNAL_FAILED;
    }
    return status;
}

/* h += m, rounded to the dtype as torch's in-place add rounds (after the last layer). */
static void add_in_place(int is_bf16, void *h, const void *m, int64_t n) {
    if (is_bf16) {
        bf16_t *a = h;
        const bf16_t *b = m;
        for (int64_t i = 0; i < n; ++i) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    } else {
        float *a = h;
        const float *b = m;
        for (int64_t i = 0; i < n; ++i) a[i] += b[i];
    }
}

/* The activations of one layer, reused by every layer, in the caller's scratch: x (normed
 * input), qkv, q (contiguous), the attention output, a projection's output, gate|up. Writes
 * the byte offset of each and, last, the total (offsets[0..6]). Each starts on a 64-byte
 * boundary, as torch's allocations (the Python loop's) do: the same vector loop peeling, so the
 * same summation order, and no vector split over two cache lines. */
int64_t decoder_scratch_layout(int is_bf16, const decoder_shape_t *s, int64_t tokens, int64_t *offsets) {
    const int64_t element = is_bf16 ? 2 : 4;
    const int64_t q_size = s->num_heads * s->head_dim, qkv_size = q_size + 2 * s->num_kv_heads * s->head_dim;
    const int64_t sizes[6] = {s->hidden, qkv_size, q_size, q_size, s->hidden, 2 * s->intermediate};
    offsets[0] = 0;
    for (int i = 0; i < 6; ++i) offsets[i + 1] = offsets[i] + (sizes[i] * tokens * element + 63) / 64 * 64;
    return offsets[6];
}

/* ``scratch``: 64-byte aligned, decoder_scratch_layout's total for this step's tokens.
 * ``external_mask``: with bit PROJECTION_x set, that projection goes to ``external`` in every
 * layer (a step with LoRA adapters on it, whose deltas the caller adds).
 * Returns DECODER_OK, DECODER_NO_MEMORY when a kernel's scratch could not be allocated,
 * DECODER_EXTERNAL_FAILED when ``external`` said so, DECODER_NO_EXTERNAL when a projection has
 * no packed weights, or the step external prefill attention, and no ``external`` was given. */
int decoder_layers(int is_bf16, const decoder_layer_t *layers, int64_t num_layers, const decoder_shape_t *s,
                   const decoder_step_t *step, void *h, void *scratch_memory, external_projection_t external,
                   int external_mask, int num_threads) {
    const int64_t t = step->tokens, element = is_bf16 ? 2 : 4;
    const int64_t q_size = s->num_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = s->intermediate;
    if (t == 0 || num_layers == 0) return DECODER_OK;
    int64_t offsets[7];
    decoder_scratch_layout(is_bf16, s, t, offsets);
    char *scratch = scratch_memory;
    char *x = scratch + offsets[0], *qkv_scratch = scratch + offsets[1], *q = scratch + offsets[2];
    char *attn = scratch + offsets[3], *proj_scratch = scratch + offsets[4], *gate_up_scratch = scratch + offsets[5];
    int status = 0;
    add_rms_norm(is_bf16, h, NULL, layers[0].input_norm, x, t, s->hidden, s->eps);
    for (int64_t i = 0; i < num_layers && status == 0; ++i) {
        const decoder_layer_t *layer = &layers[i];
        /* Each projection's packed weights, or NULL where external_mask sends it to ``external``. */
        const void *w_qkv = (external_mask >> PROJECTION_QKV & 1) ? NULL : layer->qkv;
        const void *w_o = (external_mask >> PROJECTION_O & 1) ? NULL : layer->o;
        const void *w_gate_up = (external_mask >> PROJECTION_GATE_UP & 1) ? NULL : layer->gate_up;
        const void *w_down = (external_mask >> PROJECTION_DOWN & 1) ? NULL : layer->down;
        /* Where each projection's output is: the scratch, or an external projection's own. */
        void *qkv = qkv_scratch, *proj = proj_scratch, *gate_up = gate_up_scratch;
        status = project(is_bf16, x, t, s->hidden, s->hidden, w_qkv, qkv_size, layer->qkv_bias, &qkv, num_threads,
                         external, i, PROJECTION_QKV);
        if (status != 0) break;
        if (is_bf16)
            rope_and_cache_bf16(qkv, qkv_size, step->cos, step->sin, step->slots, layer->key_cache,
                                layer->value_cache, t, s->num_heads, s->num_kv_heads, s->head_dim);
        else
            rope_and_cache_f32(qkv, qkv_size, step->cos, step->sin, step->slots, layer->key_cache,
                               layer->value_cache, t, s->num_heads, s->num_kv_heads, s->head_dim);
        for (int64_t r = 0; r < t; ++r)
            memcpy(q + r * q_size * element, (char *)qkv + r * qkv_size * element, (size_t)(q_size * element));
        status = attend(is_bf16, s, step, layer, q, attn, num_threads, external, i);
        if (status != 0) break;
        status = project(is_bf16, attn, t, q_size, q_size, w_o, s->hidden, layer->o_bias, &proj, num_threads,
                         external, i, PROJECTION_O);
        if (status != 0) break;
        add_rms_norm(is_bf16, h, proj, layer->post_norm, x, t, s->hidden, s->eps);
        status = project(is_bf16, x, t, s->hidden, s->hidden, w_gate_up, 2 * inter, layer->gate_up_bias, &gate_up,
                         num_threads, external, i, PROJECTION_GATE_UP);
        if (status != 0) break;
        if (is_bf16) silu_and_mul_bf16(gate_up, t, inter, 2 * inter, num_threads);
        else silu_and_mul_f32(gate_up, t, inter, 2 * inter, num_threads);
        proj = proj_scratch;    /* our down writes the scratch, never an external o's output */
        status = project(is_bf16, gate_up, t, inter, 2 * inter, w_down, s->hidden, layer->down_bias, &proj,
                         num_threads, external, i, PROJECTION_DOWN);
        if (status != 0) break;
        if (i + 1 < num_layers) add_rms_norm(is_bf16, h, proj, layers[i + 1].input_norm, x, t, s->hidden, s->eps);
        else add_in_place(is_bf16, h, proj, t * s->hidden);
    }
    return status;
}
