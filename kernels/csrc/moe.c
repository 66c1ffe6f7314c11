/* A mixture-of-experts feed-forward block in bfloat16 on CPU, in one call per layer: the rows of
 * a packed batch grouped by the experts their router chose, each chosen expert's SwiGLU run once
 * over its rows, the outputs summed back per row with the routing weights.
 *
 * Why one call: run from Python, an expert costs a dozen small torch operations (select its rows,
 * two matmuls, the activation, a weighted scatter) whatever its rows; a decode step of 16 rows
 * routed 4 ways over 32 experts touches most experts of every layer, so those operations cost
 * about as much as the matmuls (docs/benchmarks.md, "Mixture of experts on CPU"). Here the whole
 * block is one parallel region, and each chosen expert's weights are read once per step.
 *
 * Steps (barriers between them):
 *   1. group: a counting sort of the (row, choice) assignments by expert, rows ascending within
 *      an expert; the rows gathered into that order (serial: a few thousand indices);
 *   2. gate|up: for every expert with rows, its rows times its packed gate|up panels, bfloat16
 *      out; the (expert, panel) pairs are one list shared out to the threads in contiguous
 *      stretches, so each thread streams one stretch of the layer's packed experts;
 *   3. SiLU(gate) * up in place (layer_ops.c's rounding);
 *   4. down: as 2, float32 out;
 *   5. combine: each row's outputs times their routing weights, summed in float32 in ascending
 *      expert order (transformers' order), rounded once to bfloat16.
 * The matmuls are linear_bf16.c's (linear_bf16_panels); the weights are that file's packed
 * layout, every expert of a layer stacked: gate_up [experts][panels of 2 * inter][hidden / 2][16][2],
 * down [experts][panels of hidden][inter / 2][16][2] (backend/model/moe.py packs them).
 * kernels/moe.py's moe_reference is the specification the tests hold this to.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

#define NR 16          /* output columns per packed panel (linear_bf16.c) */
#define MAX_TOP_K 64   /* experts a row may choose (every family in use: 2-8) */

int linear_bf16_panels(const uint16_t *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                       int64_t p0, int64_t p1, float *yf, uint16_t *yb, int64_t ldy);   /* linear_bf16.c */
void silu_and_mul_bf16(uint16_t *x, int64_t rows, int64_t inter, int64_t ld, int num_threads);  /* layer_ops.c */

/* Thread t's share [begin, end) of `total` items: contiguous, as even as can be. */
static void share(const int64_t total, const int t, const int threads, int64_t *begin, int64_t *end) {
    *begin = total * t / threads;
    *end = total * (t + 1) / threads;
}

/* Thread t's part of one grouped matmul: in [assignments][k] (row stride ldx) times each active
 * expert's n-column weight, into yf or yb [assignments][n]. The list of work is (active expert,
 * panel), experts in ascending order. Returns 0, or -1 (a kernel's scratch). */
static int grouped_matmul(const uint16_t *in, const int64_t k, const int64_t ldx, const int64_t *offsets,
                          const int64_t *active, const int64_t num_active, const uint16_t *packed,
                          const int64_t expert_stride, const int64_t n, float *yf, uint16_t *yb, const int t,
                          const int threads) {
    const int64_t panels = (n + NR - 1) / NR;
    int64_t begin, end;
    share(num_active * panels, t, threads, &begin, &end);
    int status = 0;
    for (int64_t item = begin; item < end && status == 0;) {
        const int64_t a = item / panels, p0 = item % panels;
        const int64_t p1 = end - a * panels < panels ? end - a * panels : panels;
        const int64_t e = active[a], r0 = offsets[e], rows = offsets[e + 1] - r0;
        status = linear_bf16_panels(in + r0 * ldx, rows, k, ldx, packed + e * expert_stride, n, p0, p1,
                                    yf ? yf + r0 * n : NULL, yb ? yb + r0 * n : NULL, n);
        item += p1 - p0;
    }
    return status;
}

/* x: [m][hidden] bfloat16 (row stride ldx); ids, weights: [m][top_k] (int64 expert ids, float32
 * routing weights); gate_up, down: the layer's packed experts (above); out: [m][hidden] bfloat16,
 * contiguous. hidden and inter even. Returns 0, -1 (scratch memory), or -3 (an id outside
 * [0, num_experts), or top_k over MAX_TOP_K). */
int moe_bf16(const uint16_t *x, const int64_t m, const int64_t hidden, const int64_t ldx, const int64_t *ids,
             const float *weights, const int64_t top_k, const int64_t num_experts, const uint16_t *gate_up,
             const uint16_t *down, const int64_t inter, uint16_t *out, int num_threads) {
    const int64_t assignments = m * top_k;
    if (top_k > MAX_TOP_K) return -3;
    for (int64_t a = 0; a < assignments; ++a)
        if (ids[a] < 0 || ids[a] >= num_experts) return -3;
    if (m == 0) return 0;
    const int64_t gate_up_stride = (2 * inter + NR - 1) / NR * (hidden / 2) * 2 * NR;
    const int64_t down_stride = (hidden + NR - 1) / NR * (inter / 2) * 2 * NR;
    int64_t *offsets = calloc((size_t)(num_experts + 1), sizeof *offsets);
    int64_t *active = malloc(sizeof *active * (size_t)num_experts);
    int64_t *next = malloc(sizeof *next * (size_t)num_experts);         /* the sort's cursor per expert */
    int64_t *position = malloc(sizeof *position * (size_t)assignments);   /* assignment -> grouped row */
    int64_t *source = malloc(sizeof *source * (size_t)assignments);       /* grouped row -> x's row */
    uint16_t *grouped = malloc(sizeof *grouped * (size_t)(assignments * hidden));
    uint16_t *h = malloc(sizeof *h * (size_t)(assignments * 2 * inter));
    float *y = malloc(sizeof *y * (size_t)(assignments * hidden));
    int status = -1;
    if (!offsets || !active || !next || !position || !source || !grouped || !h || !y) goto done;

    /* 1. counting sort, stable in rows */
    for (int64_t a = 0; a < assignments; ++a) ++offsets[ids[a] + 1];
    int64_t num_active = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        if (offsets[e + 1] > 0) active[num_active++] = e;
        offsets[e + 1] += offsets[e];
    }
    memcpy(next, offsets, sizeof *next * (size_t)num_experts);
    for (int64_t a = 0; a < assignments; ++a) {
        position[a] = next[ids[a]]++;
        source[position[a]] = a / top_k;
    }
    status = 0;
    const int threads = num_threads > 0 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < assignments; ++g)
            memcpy(grouped + g * hidden, x + source[g] * ldx, sizeof *grouped * (size_t)hidden);
        /* 2 */
        int mine = grouped_matmul(grouped, hidden, hidden, offsets, active, num_active, gate_up, gate_up_stride,
                                  2 * inter, NULL, h, t, team);
#pragma omp barrier
        /* 3 */
        {
            int64_t begin, end;
            share(assignments, t, team, &begin, &end);
            if (end > begin) silu_and_mul_bf16(h + begin * 2 * inter, end - begin, inter, 2 * inter, 1);
        }
#pragma omp barrier
        /* 4: the activations are the gate halves of h, row stride 2 * inter */
        if (mine == 0)
            mine = grouped_matmul(h, inter, 2 * inter, offsets, active, num_active, down, down_stride, hidden, y,
                                  NULL, t, team);
        if (mine != 0) {
#pragma omp atomic write
            status = mine;
        }
#pragma omp barrier
        /* 5 */
        float *sum = malloc(sizeof *sum * (size_t)hidden);
        if (sum == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) {
            if (sum == NULL) continue;
            int64_t order[MAX_TOP_K];   /* the row's choices in ascending expert order */
            for (int64_t j = 0; j < top_k; ++j) {
                int64_t i = j;
                for (; i > 0 && ids[r * top_k + order[i - 1]] > ids[r * top_k + j]; --i) order[i] = order[i - 1];
                order[i] = j;
            }
            memset(sum, 0, sizeof *sum * (size_t)hidden);
            for (int64_t j = 0; j < top_k; ++j) {
                const int64_t a = r * top_k + order[j];
                const float w = weights[a], *row = y + position[a] * hidden;
#pragma omp simd
                for (int64_t c = 0; c < hidden; ++c) sum[c] += w * row[c];
            }
            for (int64_t c = 0; c < hidden; ++c) out[r * hidden + c] = f32_to_bf16(sum[c]);
        }
        free(sum);
    }
done:
    free(offsets);
    free(active);
    free(next);
    free(position);
    free(source);
    free(grouped);
    free(h);
    free(y);
    return status;
}
