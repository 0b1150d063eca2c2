/* The row-wise ops and projections of decode_ops.c, for the fused decode layer (decode_layer.c). `_team` functions
 * are work-shared loops: every thread of an enclosing parallel region calls them (a barrier ends each), or one
 * thread outside any region runs them whole. */
#ifndef KVBENCH_DECODE_OPS_H
#define KVBENCH_DECODE_OPS_H
#include "decode_common.h"

/* fp32 -> fp16 bits, rounded to nearest even (as torch's .to(torch.float16)): F16C where the build has it, else
 * the bit-exact software conversion of c10's fp16_ieee_from_fp32_value */
#if defined(__F16C__)
#include <immintrin.h>
static inline uint16_t float_to_half(float f) { return (uint16_t)_cvtss_sh(f, 0); }
#else
static inline uint16_t float_to_half(float f) {
    uint32_t w;
    memcpy(&w, &f, 4);
    volatile float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;  /* volatile: no FMA contraction below */
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    float b;
    const uint32_t bb = (bias >> 1) + 0x07800000u;
    memcpy(&b, &bb, 4);
    const float r = b + base;
    uint32_t bits;
    memcpy(&bits, &r, 4);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
#endif

/* fp16 bits -> fp32 (normals, subnormals, inf and nan), branch-light so loops over it vectorize */
static inline float half_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)(h & 0x7fff) << 13 };
    v.f *= 0x1.0p112f;  /* rebias the exponent: 2^(127 - 15); subnormal halves become normal floats */
    if ((h & 0x7fff) >= 0x7c00) v.u |= 0x7f800000u;
    v.u |= (uint32_t)(h & 0x8000) << 16;
    return v.f;
}

/* fp32 -> fp16 bits rounded toward -inf (down != 0) or +inf: the page summaries' outward rounding */
#if defined(__F16C__)
static inline uint16_t float_to_half_directed(float f, int down) {
    return down ? (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
                : (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
}
#else
static inline uint16_t float_to_half_directed(float f, int down) {
    uint16_t h = float_to_half(f);
    const float r = half_to_float(h);
    if (down && r > f) h = (h & 0x8000) ? (uint16_t)(h + 1) : (h == 0 ? 0x8001 : (uint16_t)(h - 1));
    if (!down && r < f) h = (h & 0x8000) ? (h == 0x8000 ? 0x0001 : (uint16_t)(h - 1)) : (uint16_t)(h + 1);
    return h;
}
#endif

/* VN fp16 values at p as floats */
static inline vn load_half_vn(const uint16_t *p) {
#if defined(__F16C__) && VN == 16 && defined(__AVX512F__)
    return (vn)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VN == 8
    return (vn)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vn v;
    for (int i = 0; i < VN; i++) v[i] = half_to_float(p[i]);
    return v;
#endif
}

/* How the codec kernels read one packed K or V row (kvbench/quant/packing.ByteLayout; kernels.BlockFormat) */
typedef struct {
    int64_t row_bytes;  /* bytes of one packed row */
    int64_t codes_off, mn_off, scale_off;  /* byte offsets in a row; mn_off < 0: symmetric (no minimum) */
    int32_t bits;  /* 2, 4 or 8 */
    int32_t is_signed;  /* 8-bit codes are int8 */
    int32_t per_channel;  /* stats per channel over `group` tokens, else per token over `group` channels */
    int32_t group;
    /* FP4 rows (kvbench/quant/fp4_codecs.py) instead of uniform codes: 0 none, 1 E4M3 group scales (NVFP4),
     * 2 E8M0 group scales (MXFP4); one scale byte per `group` channels of a token at scale_off; E2M1 codes at
     * codes_off, low nibble first; tscale_off: the byte offset of an fp32 tensor scale (< 0: none) */
    int32_t fp4;
    int32_t reserved;
    int64_t tscale_off;
} block_format;

/* A codec cache's two pools as the codec decode kernel reads them (codec_decode.c): block id < num_fp is a
 * full-precision block of k_fp / v_fp [num_fp, bs, D], else row (id - num_fp) of kq / vq; tiles: per thread, bs x D
 * floats of scratch */
typedef struct {
    const void *k_fp, *v_fp;
    int32_t fp_is_half;
    const uint8_t *kq, *vq;
    const block_format *kf, *vf;
    int64_t num_fp;
    float *tiles;
} codec_pools;

/* How far ahead (floats) dot_f32 asks for weights into L2: a batch-1 step streams every weight once, in order, and
 * 4 KiB ahead read them faster than the hardware prefetcher alone (8 KiB: no better; figures:
 * docs/benchmark-results.md). Past the end of w it asks for bytes nobody reads, harmlessly (a prefetch never
 * faults). */
#define DOT_PREFETCH_FLOATS 1024

/* dot(w, x) over n floats; four native-vector accumulators (independent FMA chains) when n is a multiple of 4 VN */
static inline float dot_f32(const float *restrict w, const float *restrict x, int64_t n) {
    if (n % (4 * VN) == 0) {
        vn a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < n; i += 4 * VN) {
            for (int c = 0; c < 4 * VN; c += 16)  /* one prefetch per cache line */
                __builtin_prefetch(w + i + DOT_PREFETCH_FLOATS + c, 0, 2);
            a0 += *(const vn *)(w + i) * *(const vn *)(x + i);
            a1 += *(const vn *)(w + i + VN) * *(const vn *)(x + i + VN);
            a2 += *(const vn *)(w + i + 2 * VN) * *(const vn *)(x + i + 2 * VN);
            a3 += *(const vn *)(w + i + 3 * VN) * *(const vn *)(x + i + 3 * VN);
        }
        const vn a = (a0 + a1) + (a2 + a3);
        float s = 0.0f;
        for (int i = 0; i < VN; i++) s += a[i];
        return s;
    }
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += w[i] * x[i];
    return acc;
}

/* The GEMV's register tile: TILE_ROWS weight rows by up to TILE_X rows of x, one vector accumulator each, so each
 * loaded weight vector serves TILE_X rows of x and each x vector TILE_ROWS weight rows.
 *   AVX2 (16 registers): 4 x 2 (8 accumulators, 4 weight vectors, 1 x vector); a 4 x 4 tile spills.
 *   AVX-512 (32 registers): 8 x 3 (24 accumulators, 3 x vectors, 1 weight vector), faster there than 4 x 2 from 4
 *   to 16 rows of x (bench/bench_gemv.py; figures: docs/benchmark-results.md).
 * Every output is the same sequence of vector FMAs over n followed by the same hsum4, whatever the tile, so the
 * tile changes no bit of the result. */
#if VN == 16
#define TILE_ROWS 8
#define TILE_X 3
#else
#define TILE_ROWS 4
#define TILE_X 2
#endif

/* d[r][m] = dot(w[r], x + m * x_ss) over n floats for the TILE_ROWS weight rows w[r] and the first NX (<= TILE_X)
 * rows m of x. n a multiple of VN; inlined with NX constant. */
static inline __attribute__((always_inline)) void dots_tile(const float *const w[TILE_ROWS], const float *restrict x,
                                                            int64_t x_ss, int64_t n, const int NX,
                                                            float d[TILE_ROWS][TILE_X]) {
    vn a[TILE_ROWS][TILE_X];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int m = 0; m < TILE_X; m++) a[r][m] = (vn){0};
    for (int64_t i = 0; i < n; i += VN) {
        vn y[TILE_X];
        for (int m = 0; m < TILE_X; m++) y[m] = m < NX ? *(const vn *)(x + m * x_ss + i) : (vn){0};
        for (int r = 0; r < TILE_ROWS; r++) {
            const vn v = *(const vn *)(w[r] + i);
            for (int m = 0; m < TILE_X; m++)
                if (m < NX) a[r][m] += v * y[m];
        }
    }
    for (int m = 0; m < NX; m++)
        for (int r0 = 0; r0 < TILE_ROWS; r0 += 4) {
            float s[4];
            hsum4(a[r0][m], a[r0 + 1][m], a[r0 + 2][m], a[r0 + 3][m], s);
            for (int r = 0; r < 4; r++) d[r0 + r][m] = s[r];
        }
}

/* dots_tile for nx = 1 .. TILE_X rows of x, with NX constant */
static inline void dots_tile_rows(const float *const w[TILE_ROWS], const float *restrict x, int64_t x_ss, int64_t n,
                                  int nx, float d[TILE_ROWS][TILE_X]) {
    if (nx >= TILE_X)
        dots_tile(w, x, x_ss, n, TILE_X, d);
    else if (nx == 1)
        dots_tile(w, x, x_ss, n, 1, d);
    else
        dots_tile(w, x, x_ss, n, 2, d);  /* TILE_X == 3 */
}

/* Ask for this pass's share of the `nbytes` bytes at `next` into L2, one prefetch per cache line (nothing when next
 * is NULL): pass `pass` of `passes` takes the pass-th slice. The tiled GEMV calls it at each of a tile's passes over
 * the rows of x with the next tile's weight rows: a tile reads its weights from DRAM in its first pass only, then
 * from L1, so without it the memory idles during the other passes. It helped the projections whose tiles stay in L1
 * (figures per projection: docs/benchmark-results.md). */
#define L1_TILE_BYTES (24 * 1024)  /* weight tiles at most this large are prefetched (decode_ops.c) */
static inline void prefetch_share_l2(const float *next, int64_t nbytes, int64_t pass, int64_t passes) {
    if (next == NULL) return;
    const int64_t per = (nbytes / 64 + passes - 1) / passes * 64;
    const int64_t a = pass * per, b = a + per < nbytes ? a + per : nbytes;
    for (int64_t c = a; c < b; c += 64) __builtin_prefetch((const char *)next + c, 0, 2);
}

/* one head of D floats rotated in place (rotate-half convention) by cos / sin rows of D floats */
static inline void rotate_half_head(float *restrict v, const float *restrict c, const float *restrict s, int64_t D) {
    const int64_t half = D / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

/* out rows = RMSNorm(x rows) * weight, rows of E floats */
void rms_norm_team(const float *x, const float *weight, float *out, int64_t rows, int64_t E, float eps);
/* y[m * y_ss + o] (+)= dot(W[o], x[m * x_ss ...]) + b[o] for o < O, m < M; W [O, I]; accumulate: add to y */
void gemv_team(const float *W, const float *x, int64_t x_ss, const float *b, float *y, int64_t y_ss, int64_t O,
               int64_t I, int64_t M, int accumulate);
/* act[m, o] = silu(gate_o . x_m) * (up_o . x_m) for o < I, W [2I, E] = gate rows then up rows (b [2I] or NULL) */
void gate_up_silu_team(const float *W, const float *b, const float *x, int64_t x_ss, float *act, int64_t I,
                       int64_t E, int64_t M);
/* A projection of the fused decode step: the row-wise stack of up to MAX_PARTS weight matrices of the same input
 * size (q/k/v or gate/up, each in its own format: a Q4_K_M file mixes types), with its bias. A part is an fp32
 * [rows, I] matrix (type 0; then it is the only part) or `rows` rows of a GGUF file's blocks of ggml `type`,
 * `row_bytes` each, multiplied by quant_matmul.c's kernels of instruction set `isa` (quant_linear.ISAS). */
#define MAX_PARTS 4
typedef struct {
    const void *data;  /* fp32 [rows, I], or [rows, row_bytes] bytes of blocks */
    int64_t rows, row_bytes;
    int32_t type, isa;  /* ggml type (0: fp32) and the quantized kernels' instruction set */
    int32_t act, reserved;  /* the quantized kernels' activations: 0 fp32, 1 Q8 blocks (quant_q8.h) */
} projection_part;
typedef struct {
    projection_part part[MAX_PARTS];
    int32_t n_parts, reserved;
    const float *bias;  /* [sum of rows] or NULL */
} projection;
/* quant_matmul.c's quant_matmul_team: a work-shared quantized product without a barrier, y[m, o] (+)= (W[o] . x[m]
 * + b[o]); the decode library calls it through this pointer (set_quant_matmul), so the two libraries share the
 * kernels and their arithmetic */
typedef int (*quant_matmul_fn)(int isa, int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K,
                               const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias,
                               int accumulate, int act);
void set_quant_matmul(quant_matmul_fn fn);
/* y[m * y_ss + o] (+)= x[m] . W[o] + b[o] for every row o of p (parts stacked along o) and m < M, x rows of I
 * floats x_ss apart; ends at the team barrier. An fp32 projection is gemv_team's, a quantized one quant_matmul_team's
 * per part. */
void project_team(const projection *p, const float *x, int64_t x_ss, float *y, int64_t y_ss, int64_t I, int64_t M,
                  int accumulate);
/* act[m, o] = silu(gate_o . x_m + b) * (up_o . x_m + b) for o < I (gate rows 0..I-1 of p, up rows I..2I-1): the
 * fp32 projection through gate_up_silu_team, a quantized one into gu [M, 2I] first (one more barrier) */
void gate_up_project_team(const projection *p, const float *x, int64_t x_ss, float *act, float *gu, int64_t I,
                          int64_t E, int64_t M);
/* decode attention of q (rows q_ss floats apart, [S, H * G, D]) over a codec cache, as codec_decode_attention_f32
 * (codec_decode.c; D 64 or 128, G <= GROUP_MAX, checked by the caller) */
void codec_decode_attention_team(
    const float *q, int64_t q_ss, const codec_pools *cp, const int32_t *tables, int64_t tab_ss, int64_t tab_sh,
    int64_t tab_sj, const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    int S, int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    float *out, float *key_scores, float *scores, float *partials);
/* Page retrieval in a decode step (page_select.c): the fused step's block summaries and selection buffers */
typedef struct {
    uint16_t *summary;  /* [N, 2, D] fp16 per block: min, max of its keys, rounded outward (updated as written) */
    const int32_t *pages;  /* [L] top blocks per query head of each layer (0: the layer reads every block) */
    int32_t *sel_tables;  /* [M, H, U] the compacted tables the attention reads ([M, H * G, U] per_head) */
    int64_t *sel_lengths;  /* [L, M, H] tokens each selection holds (out; [L, M, H * G] per_head) */
    float *bounds;  /* [M, H, 2 G, MB] scratch: each query head's bounds, then a selection scratch per head */
    uint8_t *chosen;  /* [M, H, G, MB] scratch: each query head's top blocks */
    int64_t U, MB;  /* columns of sel_tables; table columns in use */
    int64_t T;  /* slots the attention's work split covers over a selection (a multiple of chunk) */
    int64_t chunk;
    float *scores, *partials;  /* the attention's scratch for that split */
    int64_t per_head;  /* 1: each query head attends over its own blocks (one table per query head), 0: the union */
    int64_t *kv_blocks;  /* [L, M, H] per_head: the distinct blocks each kv-head's query heads read (out) */
} page_select;
/* fold key k (D floats) written at flat pool row `row` into its block's summary (slot 0 starts it afresh) */
void page_summary_update(uint16_t *summary, const float *k, int64_t row, int bs, int D);
/* the selection of one layer: sel_tables and sel_lengths ([M, H]) from q rows q_ss floats apart; per_head, also the
 * distinct blocks of each kv-head's query heads into kv_blocks [M, H] (when not NULL) */
void page_select_team(const float *q, int64_t q_ss, const page_select *ps, const int32_t *tables, int64_t tab_ss,
                      int64_t tab_sh, int64_t tab_sj, const int64_t *lengths, int64_t len_ss, int64_t len_sh,
                      int M, int H, int G, int D, int bs, int pages, int64_t *sel_lengths, int64_t *kv_blocks);
#endif
