/* Matrix products with the weight kept in a GGUF file's own quantized blocks (llama.cpp's ggml-quants.c layouts):
 * Q8_0, Q4_0, Q5_0 (32 values a block) and Q4_K, Q5_K, Q6_K (256 values a super-block).
 *
 *   y[m, o] = sum_k W[o, k] * x[m, k]     W: O rows of K values, each row `row_bytes` bytes of blocks
 *
 * Activations stay fp32 by default (llama.cpp quantizes them to Q8 blocks for integer dot products: quant_q8.h does
 * that for Q8_0 / Q4_0 / Q5_0 / Q4_K / Q6_K weights when asked, `act` ACT_Q8): each block
 * of the weight is expanded to fp32 vectors and multiplied with fused multiply-adds, so the result differs from
 * dequantize-then-matmul in fp32 only by the order of the sums.
 *   - decode (at most TILE_X input rows): each weight row's blocks are expanded in registers and multiplied with the
 *     input rows as they are read (quant_blocks.h through dot_span, four independent accumulators): each weight byte
 *     is read once, a bandwidth-bound GEMV;
 *   - prefill chunks (more rows): TILE_W weight rows are expanded whole into a per-thread scratch (L2), then
 *     multiplied with the input rows TILE_X at a time: the expansion is paid once per weight row, not per input row.
 * The body is compiled three times (quant_matmul_impl.h): for AVX-512, for AVX2+FMA and generic C (scalar, for any
 * CPU); quant_matmul picks one at run time by the `isa` argument (quant_linear.py: the best the CPU has, or
 * KVBENCH_QUANT_ISA). A fourth copy, AVX2 code with AVX-512's 16-float vectors, lets an AVX2 machine test the wide
 * form's logic. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GGML_Q4_0 = 2, GGML_Q5_0 = 6, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX2_WIDE = 3 };

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* IEEE half -> float (the blocks' scales) */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exp == 0) {
        f = (float)man * (1.0f / 16777216.0f); /* subnormal: man * 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* values and bytes of one block of a type; 0 for a type not handled */
static inline int block_values(int type) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q5_0: case GGML_Q8_0: return 32;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return 256;
    default: return 0;
    }
}
static inline int block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q5_0: return 22;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

/* the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *q, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#define SFX generic
#define QN 4
#define QKIND 0
#include "quant_matmul_impl.h"
#undef SFX
#undef QN
#undef QKIND

#if defined(__x86_64__) || defined(__i386__)
#define KV_X86 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SFX avx2
#define QN 8
#define QKIND 1
#include "quant_matmul_impl.h"
#undef SFX
#undef QN
#undef QKIND
#define SFX avx2_wide
#define QN 16
#define QKIND 3
#include "quant_matmul_impl.h"
#undef SFX
#undef QN
#undef QKIND
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define SFX avx512
#define QN 16
#define QKIND 2
#include "quant_matmul_impl.h"
#undef SFX
#undef QN
#undef QKIND
#pragma GCC pop_options
#endif

#include "quant_q8.h"

/* 1 when this CPU runs `isa`'s code */
int quant_isa_supported(int isa) {
    switch (isa) {
    case ISA_GENERIC: return 1;
#ifdef KV_X86
    case ISA_AVX2: case ISA_AVX2_WIDE:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
    default: return 0;
    }
}

int quant_block_values(int type) { return block_values(type); }
int quant_block_bytes(int type) { return block_bytes(type); }

/* y[m * ldy + o] = W[o, :] . x[m * ldx + :] for o < O, m < M (see the top); act ACT_Q8: with the rows quantized
 * to Q8_0 blocks where the weight type allows it (quant_q8.h; else fp32); 0, or -1 for an unsupported type, ISA or
 * a K that is not a whole number of blocks */
int quant_matmul(int isa, int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                 int64_t ldx, int64_t M, float *y, int64_t ldy, int nthreads, int act) {
    const int bv = block_values(type);
    if (bv == 0 || K % bv != 0 || row_bytes != K / bv * block_bytes(type) || !quant_isa_supported(isa)) return -1;
    if (act == ACT_Q8 && q8_activation_type(type)) {
#pragma omp parallel num_threads(nthreads)
        qmm_q8_team(isa != ISA_GENERIC, type, W, row_bytes, O, K, x, ldx, M, y, ldy, NULL, 0);
        return 0;
    }
    switch (isa) {
    case ISA_GENERIC: qmm_generic(type, W, row_bytes, O, K, x, ldx, M, y, ldy, nthreads); return 0;
#ifdef KV_X86
    case ISA_AVX2: qmm_avx2(type, W, row_bytes, O, K, x, ldx, M, y, ldy, nthreads); return 0;
    case ISA_AVX2_WIDE: qmm_avx2_wide(type, W, row_bytes, O, K, x, ldx, M, y, ldy, nthreads); return 0;
    case ISA_AVX512: qmm_avx512(type, W, row_bytes, O, K, x, ldx, M, y, ldy, nthreads); return 0;
#endif
    default: return -1;
    }
}

/* quant_matmul's product as a work-shared loop with no parallel region of its own (qmm_team in quant_matmul_impl.h:
 * every thread of the caller's region calls it and the caller ends it with a barrier), adding bias (or NULL) and,
 * with `accumulate`, adding into y: the fused decode step (decode_layer.c) calls it through a pointer
 * (kernels.set_quant_matmul). 0, or -1 as quant_matmul (checked before any thread works, the same in every one). */
int quant_matmul_team(int isa, int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                      int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias, int accumulate, int act) {
    const int bv = block_values(type);
    if (bv == 0 || K % bv != 0 || row_bytes != K / bv * block_bytes(type) || !quant_isa_supported(isa)) return -1;
    if (act == ACT_Q8 && q8_activation_type(type)) {
        qmm_q8_team(isa != ISA_GENERIC, type, W, row_bytes, O, K, x, ldx, M, y, ldy, bias, accumulate);
        return 0;
    }
    switch (isa) {
    case ISA_GENERIC: qmm_team_generic(type, W, row_bytes, O, K, x, ldx, M, y, ldy, bias, accumulate); return 0;
#ifdef KV_X86
    case ISA_AVX2: qmm_team_avx2(type, W, row_bytes, O, K, x, ldx, M, y, ldy, bias, accumulate); return 0;
    case ISA_AVX2_WIDE: qmm_team_avx2_wide(type, W, row_bytes, O, K, x, ldx, M, y, ldy, bias, accumulate); return 0;
    case ISA_AVX512: qmm_team_avx512(type, W, row_bytes, O, K, x, ldx, M, y, ldy, bias, accumulate); return 0;
#endif
    default: return -1;
    }
}

/* out[i, :] = the fp32 values of row rows[i] of W (embedding lookups, a dense copy); 0 or -1 as above */
int quant_dequantize_rows(int type, const uint8_t *W, int64_t row_bytes, int64_t K, const int64_t *rows, int64_t n,
                          float *out, int nthreads) {
    const int bv = block_values(type);
    if (bv == 0 || K % bv != 0 || row_bytes != K / bv * block_bytes(type)) return -1;
#pragma omp parallel for num_threads(nthreads) if (n * K >= 65536)
    for (int64_t i = 0; i < n; i++) dequant_span_generic(type, W + rows[i] * row_bytes, 0, K, out + i * K);
    return 0;
}
