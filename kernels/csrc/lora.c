/* LoRA over a packed batch on CPU: out[t] += B_s (A_s x[t]) for each token row t whose adapter
 * slot s = slot_ids[t] is >= 0, float32 or bfloat16 (the spec: lora_shrink_reference and
 * lora_expand_reference in kernels/reference.py).
 *
 * Why: as torch ops a step's LoRA took 3 calls per projection (every row against every
 * resident adapter's A, a mask, one expand), 360 calls a SmolLM2 step, a large share of a
 * 16-stream decode step with 4 adapters. Here one call per projection does both halves for
 * each row against its own adapter only, keeping the rank-sized intermediate in float32.
 *
 * What bounds it is reading the adapters' weights: a decode step streams every resident
 * adapter's A and B from memory (the base weights evict them from cache between steps), so:
 * - rows are grouped by slot into tiles of up to TILE rows (SGMV's idea on a CPU), so that
 *   each weight is read once per tile, not once per row;
 * - the expand reads each part's own B (q, k, v or gate, up: [rank, part columns]), not the
 *   block matrix of the whole fused projection, two thirds zeros for qkv;
 * - every matrix is read in memory order, in segments of up to COLUMN_BLOCK elements.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_LORA_RANK_TOTAL 512  /* rank x parts of one fused projection (3 x 64 for qkv) */
#define MAX_PARTS 3
#define TILE 4                   /* rows of one slot that share each weight read */
#define COLUMN_BLOCK 1024        /* expand: output columns whose float32 sums (x TILE) stay in L1/L2 */

/* One slot of one projection, as the Python side writes it (an int64 tensor [num_slots, 18]). */
typedef struct {
    int64_t b;                                   /* address of B transposed [rank_end - rank_start, out_end - out_start] */
    int64_t rank_start, rank_end;                /* its rows of A (and of the shrink's result) */
    int64_t out_start, out_end;                  /* its columns of the fused output */
} lora_part_t;

typedef struct {
    int64_t a;                                   /* address of A [rank, in_features]; 0: not adapted */
    int64_t rank;                                /* the parts' ranks summed */
    int64_t num_parts;
    lora_part_t parts[MAX_PARTS];
} lora_slot_t;

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const bf16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void add_f32(float *p, int64_t i, float v) { p[i] += v; }
static inline void add_bf16(bf16_t *p, int64_t i, float v) { p[i] = f32_to_bf16(bf16_to_f32(p[i]) + v); }

/* tiles[j] = {slot, first index into `order`, row count}: rows of one slot, TILE at most. */
static int64_t make_tiles(const int32_t *slot_ids, int64_t rows, int64_t num_slots, int64_t *order,
                          int64_t (*tiles)[3]) {
    int64_t count = 0, num_tiles = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
        const int64_t start = count;
        for (int64_t t = 0; t < rows; ++t)
            if (slot_ids[t] == s) order[count++] = t;
        for (int64_t i = start; i < count; i += TILE) {
            tiles[num_tiles][0] = s;
            tiles[num_tiles][1] = i;
            tiles[num_tiles][2] = count - i < TILE ? count - i : TILE;
            ++num_tiles;
        }
    }
    return num_tiles;
}

/* One tile: m rows (order[0..m)) of one adapter. Missing rows of a short tile compute on
 * zeros and are not written, so the inner loops always run TILE wide. */
#define LORA_TILE(T, LOAD, ADD)                                                                         \
    static void lora_tile_##T(const T *restrict x, int64_t x_stride, T *restrict out, int64_t out_stride, \
                              const int64_t *order, int64_t m, int64_t in_features,                     \
                              const lora_slot_t *slot, float *restrict xf) {                            \
        for (int64_t i = 0; i < TILE; ++i)                                                              \
            for (int64_t k = 0; k < in_features; ++k)                                                   \
                xf[i * in_features + k] = i < m ? LOAD(x + order[i] * x_stride, k) : 0.0f;              \
        float y[TILE][MAX_LORA_RANK_TOTAL];                                                             \
        const float *x0 = xf, *x1 = xf + in_features, *x2 = xf + 2 * in_features, *x3 = xf + 3 * in_features; \
        const T *a = (const T *)(intptr_t)slot->a;                                                      \
        for (int64_t r = 0; r < slot->rank; ++r) {                                                      \
            const T *ar = a + r * in_features;                                                          \
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                           \
            _Pragma("omp simd reduction(+ : s0, s1, s2, s3)")                                          \
            for (int64_t k = 0; k < in_features; ++k) {                                                 \
                const float w = LOAD(ar, k);                                                            \
                s0 += w * x0[k];                                                                        \
                s1 += w * x1[k];                                                                        \
                s2 += w * x2[k];                                                                        \
                s3 += w * x3[k];                                                                        \
            }                                                                                           \
            y[0][r] = s0;                                                                               \
            y[1][r] = s1;                                                                               \
            y[2][r] = s2;                                                                               \
            y[3][r] = s3;                                                                               \
        }                                                                                               \
        for (int64_t p = 0; p < slot->num_parts; ++p) {                                                 \
            const lora_part_t *part = &slot->parts[p];                                                  \
            const int64_t width = part->out_end - part->out_start;                                      \
            const T *b = (const T *)(intptr_t)part->b;                                                  \
            for (int64_t n0 = 0; n0 < width; n0 += COLUMN_BLOCK) {                                      \
                const int64_t cols = width - n0 < COLUMN_BLOCK ? width - n0 : COLUMN_BLOCK;             \
                float acc[TILE][COLUMN_BLOCK];                                                          \
                for (int64_t i = 0; i < TILE; ++i) memset(acc[i], 0, sizeof(float) * cols);             \
                for (int64_t r = part->rank_start; r < part->rank_end; ++r) {                           \
                    const T *br = b + (r - part->rank_start) * width + n0;                              \
                    const float y0 = y[0][r], y1 = y[1][r], y2 = y[2][r], y3 = y[3][r];                 \
                    _Pragma("omp simd")                                                                 \
                    for (int64_t n = 0; n < cols; ++n) {                                                \
                        const float w = LOAD(br, n);                                                    \
                        acc[0][n] += y0 * w;                                                            \
                        acc[1][n] += y1 * w;                                                            \
                        acc[2][n] += y2 * w;                                                            \
                        acc[3][n] += y3 * w;                                                            \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t i = 0; i < m; ++i) {                                                       \
                    T *row = out + order[i] * out_stride + part->out_start + n0;                        \
                    for (int64_t n = 0; n < cols; ++n) ADD(row, n, acc[i][n]);                          \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

LORA_TILE(float, load_f32, add_f32)
LORA_TILE(bf16_t, load_bf16, add_bf16)

/* Returns 0; -1 for a slot over MAX_LORA_RANK_TOTAL ranks or MAX_PARTS parts; -2 when scratch
 * memory is not there. */
#define LORA_APPLY(NAME, T)                                                                             \
    int NAME(const T *restrict x, int64_t x_stride, T *restrict out, int64_t out_stride, int64_t rows,  \
             int64_t in_features, const int32_t *restrict slot_ids, const lora_slot_t *slots,           \
             int64_t num_slots, int threads) {                                                          \
        for (int64_t s = 0; s < num_slots; ++s)                                                         \
            if (slots[s].rank > MAX_LORA_RANK_TOTAL || slots[s].num_parts > MAX_PARTS) return -1;      \
        int64_t *order = malloc(sizeof(int64_t) * (rows + 1));                                          \
        int64_t(*tiles)[3] = malloc(sizeof(int64_t[3]) * (rows + 1));                                   \
        if (order == NULL || tiles == NULL) {                                                           \
            free(order);                                                                                \
            free(tiles);                                                                                \
            return -2;                                                                                  \
        }                                                                                               \
        const int64_t num_tiles = make_tiles(slot_ids, rows, num_slots, order, tiles);                  \
        /* A parallel region costs a few microseconds: only for more than a tile of real work. */      \
        int used = threads < 1 ? 1 : threads;                                                           \
        if (num_tiles < 2 || num_tiles * TILE * 32 * in_features < 65536) used = 1;                     \
        if (used > num_tiles) used = (int)num_tiles;                                                    \
        int failed = 0;                                                                                 \
        _Pragma("omp parallel num_threads(used) if (used > 1) reduction(| : failed)")                   \
        {                                                                                               \
            float *xf = malloc(sizeof(float) * TILE * in_features);                                     \
            /* Every thread reaches the loop (a worksharing construct must be met by all). */           \
            _Pragma("omp for schedule(static)")                                                         \
            for (int64_t j = 0; j < num_tiles; ++j) {                                                   \
                const lora_slot_t *slot = &slots[tiles[j][0]];                                          \
                if (xf == NULL) {                                                                       \
                    failed = 1;                                                                         \
                    continue;                                                                           \
                }                                                                                       \
                if (slot->a == 0 || slot->rank == 0) continue;                                          \
                lora_tile_##T(x, x_stride, out, out_stride, order + tiles[j][1], tiles[j][2],           \
                              in_features, slot, xf);                                                   \
            }                                                                                           \
            free(xf);                                                                                   \
        }                                                                                               \
        free(order);                                                                                    \
        free(tiles);                                                                                    \
        return failed ? -2 : 0;                                                                         \
    }

LORA_APPLY(lora_apply_f32, float)
LORA_APPLY(lora_apply_bf16, bf16_t)
