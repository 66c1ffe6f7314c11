/* bfloat16 <-> float32 for the CPU kernels (paged_attention.c, layer_ops.c). A bfloat16 is the
 * top half of a float32: widening is a 16-bit shift, exact; narrowing rounds. */
#ifndef LLM_KERNELS_BF16_H
#define LLM_KERNELS_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;   /* raw bits of a bfloat16 (torch.bfloat16's storage) */

static inline float bf16_to_f32(bf16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, NaN to the canonical quiet NaN: the same bits as c10::BFloat16's
 * conversion from float (torch's .to(bfloat16)). */
static inline bf16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return 0x7FC0;
    return (bf16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#endif
