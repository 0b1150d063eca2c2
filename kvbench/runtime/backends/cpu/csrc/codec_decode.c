/* Paged decode attention over a codec cache (kvbench/runtime/cache/quantized_cache.py), read in place, so the layer is
 * never dequantized into a dense scratch copy. KIVI's 2- and 4-bit blocks are read straight from their codes
 * (score_packed_keys, accumulate_packed_values: the scale and minimum are folded into the query and the
 * probabilities); every other block (full precision, 8-bit, int8, per-token keys) is decoded into a small fp32
 * tile as the kernel reaches it (a few KiB, in L1). Same semantics, work split and chunk merge as
 * paged_decode_attention_f32 (paged_decode.c), which this mirrors:
 *
 *   block id < num_fp   a full-precision block of fp_pool [num_fp, bs, D] (fp16 or fp32)
 *   block id >= num_fp  row (id - num_fp) of the packed pool [num_packed, row_bytes] (uint8), laid out by the
 *                       codec (kvbench/quant/packing.ByteLayout): codes, and fp16 scale / minimum fields
 *
 * Packed formats (the `block_format` of each of K and V):
 *   bits 2, 4, 8 unsigned codes, asymmetric: x = mn + code * scale (KIVI);
 *   bits 8 signed codes, symmetric (mn_off < 0): x = code * scale (int8).
 *   Codes of row t form one little-endian bit stream over t * D + d (packing.py); stats are either per channel
 *   (one per channel for each group of `group` tokens: [bs / group, D]) or per token (one per group of `group`
 *   channels of a token: [bs, ceil(D / group)]).
 *   fp4 1 / 2: FP4 (NVFP4 / MXFP4): x = e2m1(code) * (group scale [* tensor scale]), the group scale an E4M3 byte
 *   or an E8M0 power of two per `group` channels of a token (decode_fp4_rows).
 */
#include "decode_ops.h"
#ifdef _OPENMP
#include <omp.h>
#endif

typedef uint32_t vnu __attribute__((vector_size(VN * 4)));

/* VN 2- or 4-bit codes starting at a multiple of VN (so at byte `src`), as floats: a few vector shifts, masks and
 * conversions (GCC/Clang vector extensions) */
static inline __attribute__((always_inline)) vn codesn(const uint8_t *restrict src, const int bits) {
#if VN == 16
    if (bits == 2) {
        static const vnu shift = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
        uint32_t w;
        memcpy(&w, src, 4);
        return __builtin_convertvector(((vnu){0} + w) >> shift & 3u, vn);
    }
    if (bits == 4) {
        static const vnu shift = {0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28};
        static const vnu high = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
        uint32_t w[2];
        memcpy(w, src, 8);
        const vnu words = (vnu){0} + w[0] + (w[1] - w[0]) * high;  /* lanes 0-7: w[0], 8-15: w[1] */
        return __builtin_convertvector(words >> shift & 15u, vn);
    }
#else
    if (bits == 2) {
        static const vnu shift = {0, 2, 4, 6, 8, 10, 12, 14};
        uint16_t w;
        memcpy(&w, src, 2);
        return __builtin_convertvector(((vnu){0} + (uint32_t)w) >> shift & 3u, vn);
    }
    if (bits == 4) {
        static const vnu shift = {0, 4, 8, 12, 16, 20, 24, 28};
        uint32_t w;
        memcpy(&w, src, 4);
        return __builtin_convertvector(((vnu){0} + w) >> shift & 15u, vn);
    }
#endif
    return (vn){0};  /* not reached: 8-bit codes are read by a plain loop */
}

/* rows [r0, r1) of packed row `row` as fp32 into tile[(r - r0) * D + d]; bits, is_signed, D constants */
static inline __attribute__((always_inline)) void decode_packed_rows(
    const uint8_t *row, const block_format *f, const int bits, const int is_signed, const int D, int r0, int r1,
    float *restrict tile)
{
    const uint16_t *mn = f->mn_off >= 0 ? (const uint16_t *)(row + f->mn_off) : NULL;
    const uint16_t *sc = (const uint16_t *)(row + f->scale_off);
    const uint8_t *codes = row + f->codes_off;
    const int64_t row_code_bytes = (int64_t)D * bits / 8;
    const int group = f->group, per_channel = f->per_channel;
    const int ng = (D + group - 1) / group;  /* stat groups per token (per-token stats) */
    float m[128], s[128];  /* minimum and scale per channel for the current group of rows / this row (D <= 128) */
    int stats_of = -1;  /* per channel: the token group m and s hold */
    for (int r = r0; r < r1; r++) {
        if (per_channel) {
            if (r / group != stats_of) {
                stats_of = r / group;
                const int64_t base = (int64_t)stats_of * D;
                for (int d = 0; d < D; d++) {
                    s[d] = half_to_float(sc[base + d]);
                    m[d] = mn ? half_to_float(mn[base + d]) : 0.0f;
                }
            }
        } else {
            for (int g = 0; g < ng; g++) {
                const float sg = half_to_float(sc[(int64_t)r * ng + g]);
                const float mg = mn ? half_to_float(mn[(int64_t)r * ng + g]) : 0.0f;
                const int d1 = (g + 1) * group < D ? (g + 1) * group : D;
                for (int d = g * group; d < d1; d++) {
                    s[d] = sg;
                    m[d] = mg;
                }
            }
        }
        float *t = tile + (int64_t)(r - r0) * D;
        const uint8_t *src = codes + r * row_code_bytes;
        if (bits == 8) {  /* a plain loop vectorizes best here (measured) */
            if (is_signed)
                for (int d = 0; d < D; d++) t[d] = m[d] + (float)(int8_t)src[d] * s[d];
            else
                for (int d = 0; d < D; d++) t[d] = m[d] + (float)src[d] * s[d];
        } else {
            for (int d0 = 0; d0 < D; d0 += VN)
                *(vn *)(t + d0) = *(const vn *)(m + d0) + codesn(src + d0 * bits / 8, bits) * *(const vn *)(s + d0);
        }
    }
}

/* float32 from its bit pattern */
static inline float float_of_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* An E4M3 (float8_e4m3fn) byte as float: 4 exponent bits (bias 7), 3 mantissa bits, exponent 0 subnormal. The
 * bytes 0x7f / 0xff (NaN) are never written by the codec. */
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    const float mag = e ? float_of_bits((e + 120u) << 23 | m << 20) : (float)m * 0.001953125f;
    return (b & 128u) ? -mag : mag;
}

/* An E8M0 byte (a biased exponent, 0..254) as the power of two 2^(b - 127); 0 is 2^-127, a float32 subnormal */
static inline float e8m0_to_float(uint8_t b) {
    return b ? float_of_bits((uint32_t)b << 23) : float_of_bits(1u << 22);
}

/* rows [r0, r1) of an FP4 row as fp32 into tile[(r - r0) * D + d]: e2m1(code) * (group scale [* tensor scale]),
 * multiplied in the order of the codec's own decode (kvbench/quant/fp4.py), so both give the same floats */
static void decode_fp4_rows(const uint8_t *row, const block_format *f, const int D, int r0, int r1,
                            float *restrict tile)
{
    static const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    const uint8_t *codes = row + f->codes_off, *scales = row + f->scale_off;
    const int group = f->group, ng = (D + group - 1) / group;
    float ts = 1.0f;
    if (f->tscale_off >= 0)
        memcpy(&ts, row + f->tscale_off, 4);
    for (int r = r0; r < r1; r++) {
        float *t = tile + (int64_t)(r - r0) * D;
        const uint8_t *src = codes + (int64_t)r * D / 2;  /* D even: a token's codes start on a byte */
        for (int g = 0; g < ng; g++) {
            const uint8_t b = scales[(int64_t)r * ng + g];
            float s = f->fp4 == 2 ? e8m0_to_float(b) : e4m3_to_float(b);
            if (f->tscale_off >= 0)
                s *= ts;
            const int d1 = (g + 1) * group < D ? (g + 1) * group : D;
            for (int d = g * group; d < d1; d++) t[d] = e2m1[(src[d >> 1] >> ((d & 1) * 4)) & 15] * s;
        }
    }
}

/* rows [r0, r1) of block `id` as fp32: tile[(r - r0) * D + d] */
static inline void load_rows(const void *fp_pool, int fp_is_half, const uint8_t *packed, const block_format *f,
                             int64_t num_fp, int64_t id, int bs, const int D, int r0, int r1, float *restrict tile)
{
    if (id < num_fp) {
        if (fp_is_half) {
            const uint16_t *src = (const uint16_t *)fp_pool + (id * bs + r0) * D;
            const int64_t n = (int64_t)(r1 - r0) * D;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) tile[i] = half_to_float(src[i]);
        } else {
            memcpy(tile, (const float *)fp_pool + (id * bs + r0) * D, sizeof(float) * (r1 - r0) * D);
        }
        return;
    }
    const uint8_t *row = packed + (id - num_fp) * f->row_bytes;
    if (f->fp4)
        decode_fp4_rows(row, f, D, r0, r1, tile);
    else if (f->bits == 2)
        decode_packed_rows(row, f, 2, 0, D, r0, r1, tile);
    else if (f->bits == 4)
        decode_packed_rows(row, f, 4, 0, D, r0, r1, tile);
    else if (f->is_signed)
        decode_packed_rows(row, f, 8, 1, D, r0, r1, tile);
    else
        decode_packed_rows(row, f, 8, 0, D, r0, r1, tile);
}


/* Scores of the n first rows of a packed key block (2/4-bit codes, a minimum and a scale per channel for each group
 * of `group` tokens, group % 4 == 0) for the G query heads, without decoding the keys:
 *   q . (mn + code * scale) = sum_d (q[d] * scale[d]) * code[d] + sum_d q[d] * mn[d],
 * the first sum over codes unpacked 16 at a time, the second once per group. Writes scale * score into
 * sc_t[g * T + j] and raises the running maximum m[g]. */
static inline __attribute__((always_inline)) void score_packed_keys(
    const uint8_t *row, const block_format *f, const int bits, const float *restrict qh, const int G, const int D,
    float scale, int n, float *restrict sc_t, int64_t T, float *restrict m)
{
    const uint16_t *mn = (const uint16_t *)(row + f->mn_off);
    const uint16_t *sc = (const uint16_t *)(row + f->scale_off);
    const uint8_t *codes = row + f->codes_off;
    const int64_t rb = (int64_t)D * bits / 8;  /* code bytes per row */
    const int group = f->group;
    float qs[GROUP_MAX][128] __attribute__((aligned(64)));  /* q * scale per channel */
    float qm[GROUP_MAX];  /* q . mn */
    for (int j0 = 0; j0 < n; j0 += group) {
        const int64_t base = (int64_t)(j0 / group) * D;
        for (int g = 0; g < G; g++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) {
                qs[g][d] = qh[g * D + d] * half_to_float(sc[base + d]);
                dot += qh[g * D + d] * half_to_float(mn[base + d]);
            }
            qm[g] = dot;
        }
        const int j1 = n < j0 + group ? n : j0 + group;
        for (int j = j0; j < j1; j += 4) {
            const int rows = j1 - j < 4 ? j1 - j : 4;
            vn a[GROUP_MAX][4];
            for (int g = 0; g < G; g++)
                for (int i = 0; i < 4; i++) a[g][i] = (vn){0};
            for (int c = 0; c < D; c += VN) {
                const uint8_t *src = codes + j * rb + c * bits / 8;
                const vn k0 = codesn(src, bits);
                const vn k1 = rows > 1 ? codesn(src + rb, bits) : (vn){0};
                const vn k2 = rows > 2 ? codesn(src + 2 * rb, bits) : (vn){0};
                const vn k3 = rows > 3 ? codesn(src + 3 * rb, bits) : (vn){0};
                for (int g = 0; g < G; g++) {
                    const vn qv = *(const vn *)(qs[g] + c);
                    a[g][0] += qv * k0;
                    a[g][1] += qv * k1;
                    a[g][2] += qv * k2;
                    a[g][3] += qv * k3;
                }
            }
            store_scores4(a, G, qm, rows, scale, sc_t + j, T, m);
        }
    }
}

/* acc[g] += sum_j p[g, j] * value_j over the n first rows of a packed value block (2/4-bit codes, a minimum and a
 * scale per token for each group of `group` channels, group % 16 == 0, D % group == 0), without decoding the
 * values: p * (mn + code * scale) = (p * scale) * code + p * mn, the second term summed per channel group into
 * msum[g][group index] (added to acc once, after the last block). p[g, j] = sc_t[g * T + j]. */
static inline __attribute__((always_inline)) void accumulate_packed_values(
    const uint8_t *row, const block_format *f, const int bits, const int G, const int D, int n,
    const float *restrict sc_t, int64_t T, vn acc[][128 / VN], float msum[][128 / 16])
{
    const uint16_t *mn = (const uint16_t *)(row + f->mn_off);
    const uint16_t *sc = (const uint16_t *)(row + f->scale_off);
    const uint8_t *codes = row + f->codes_off;
    const int64_t rb = (int64_t)D * bits / 8;
    const int group = f->group, ng = D / group;
    vn a[GROUP_MAX][128 / VN];  /* acc in registers for the block (G and D constant) */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / VN; c++) a[g][c] = acc[g][c];
    for (int j0 = 0; j0 < n; j0 += 32) {  /* the stats of 32 rows at a time, converted in one vector loop */
        const int jn = n - j0 < 32 ? n - j0 : 32;
        float sv[32 * 8], mv[32 * 8];  /* [row, channel group] (ng <= 8) */
#pragma omp simd
        for (int i = 0; i < jn * ng; i++) {
            sv[i] = half_to_float(sc[(int64_t)j0 * ng + i]);
            mv[i] = half_to_float(mn[(int64_t)j0 * ng + i]);
        }
        for (int j = 0; j < jn; j++) {
            const uint8_t *src = codes + (j0 + j) * rb;
            float ps[GROUP_MAX][8];  /* p * scale per query head and channel group */
            for (int g = 0; g < G; g++) {
                const float p = sc_t[g * T + j0 + j];
                for (int q = 0; q < ng; q++) {
                    ps[g][q] = p * sv[j * ng + q];
                    msum[g][q] += p * mv[j * ng + q];
                }
            }
            for (int c = 0; c < D / VN; c++) {  /* D and G constant: the accumulators stay in registers */
                const vn code = codesn(src + c * VN * bits / 8, bits);
                const int q = c * VN / group;
                for (int g = 0; g < G; g++) a[g][c] += ps[g][q] * code;
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / VN; c++) acc[g][c] = a[g][c];
}

/* bring a packed row towards the cache before its block is read (blocks sit anywhere in the pool) */
static inline void prefetch_row(const uint8_t *row, int64_t nbytes) {
    for (int64_t o = 0; o < nbytes; o += 64) __builtin_prefetch(row + o, 0, 3);
}

/* The part of keys [t, t1) that lies in one block: its table entry `id`, first slot `r0` in the block, `n` slots,
 * ending at `end`. When the next block is packed, its row of `packed` is prefetched. */
typedef struct { int64_t end, id; int r0, n; } block_span;

static inline __attribute__((always_inline)) block_span span_at(
    int64_t t, int64_t t1, int bs, const int32_t *table, int64_t tab_sj, int64_t num_fp, const uint8_t *packed,
    int64_t row_bytes)
{
    block_span b;
    b.end = t - t % bs + bs < t1 ? t - t % bs + bs : t1;
    b.r0 = (int)(t % bs);
    b.n = (int)(b.end - t);
    b.id = table[(t / bs) * tab_sj];
    if (b.end < t1 && table[(t / bs + 1) * tab_sj] >= num_fp)
        prefetch_row(packed + (table[(t / bs + 1) * tab_sj] - num_fp) * row_bytes, row_bytes);
    return b;
}

/* whether a block format can take the direct paths above (KIVI's layouts at 2 and 4 bits) */
static int direct_keys(const block_format *f, int bs) {
    return !f->fp4 && (f->bits == 2 || f->bits == 4) && f->per_channel && f->mn_off >= 0 && f->group % 4 == 0 &&
           bs % f->group == 0;
}
static int direct_values(const block_format *f, int D) {
    return !f->fp4 && (f->bits == 2 || f->bits == 4) && !f->per_channel && f->mn_off >= 0 && f->group % 16 == 0 &&
           D % f->group == 0;
}

/* One work item, keys [t0, t1) of one table: as attend_chunk_grouped in paged_decode.c, with each block's K (then
 * V) rows decoded into `tile` [bs, D] first (KIVI 2/4-bit blocks: read from their codes). */
static inline __attribute__((always_inline)) void attend_chunk_codec(
    const float *restrict qh, const void *k_fp, const void *v_fp, int fp_is_half, const uint8_t *kq,
    const uint8_t *vq, const block_format *kf, const block_format *vf, int64_t num_fp, const int32_t *table,
    int64_t tab_sj, int bs, const int G, const int D, float scale, int64_t t0, int64_t t1, int64_t T,
    float *restrict sc, float *restrict part, float *restrict tile, int fast_keys, int fast_values)
{
    float m[GROUP_MAX];
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    for (int64_t t = t0; t < t1;) {
        const block_span b = span_at(t, t1, bs, table, tab_sj, num_fp, kq, kf->row_bytes);
        const int64_t end = b.end, id = b.id;
        const int r0 = b.r0, n = b.n;
        if (id >= num_fp && r0 == 0 && fast_keys) {  /* packed: scored from the codes */
            const uint8_t *row = kq + (id - num_fp) * kf->row_bytes;
            if (kf->bits == 2)
                score_packed_keys(row, kf, 2, qh, G, D, scale, n, sc + t, T, m);
            else
                score_packed_keys(row, kf, 4, qh, G, D, scale, n, sc + t, T, m);
            t = end;
            continue;
        }
        load_rows(k_fp, fp_is_half, kq, kf, num_fp, id, bs, D, r0, r0 + n, tile);
        score_rows(qh, tile, n, G, D, scale, sc + t, T, m, NULL);
        t = end;
    }
    exp_and_sum(sc, T, G, D, t0, t1, m, part);
    vn acc[GROUP_MAX][128 / VN];
    float msum[GROUP_MAX][128 / 16];  /* sum of p * minimum per value channel group (direct path) */
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < D / VN; c++) acc[g][c] = (vn){0};
        for (int c = 0; c < D / 16; c++) msum[g][c] = 0.0f;
    }
    for (int64_t t = t0; t < t1;) {
        const block_span b = span_at(t, t1, bs, table, tab_sj, num_fp, vq, vf->row_bytes);
        const int64_t end = b.end, id = b.id;
        const int r0 = b.r0, n = b.n;
        if (id >= num_fp && r0 == 0 && fast_values) {
            const uint8_t *row = vq + (id - num_fp) * vf->row_bytes;
            if (vf->bits == 2)
                accumulate_packed_values(row, vf, 2, G, D, n, sc + t, T, acc, msum);
            else
                accumulate_packed_values(row, vf, 4, G, D, n, sc + t, T, acc, msum);
            t = end;
            continue;
        }
        load_rows(v_fp, fp_is_half, vq, vf, num_fp, id, bs, D, r0, r0 + n, tile);
        accumulate_rows(tile, n, G, D, sc + t, T, acc, NULL);
        t = end;
    }
    if (fast_values)
        for (int g = 0; g < G; g++)
            for (int c = 0; c < D / VN; c++) acc[g][c] += msum[g][c * VN / vf->group];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / VN; c++) memcpy(part + g * (D + 2) + c * VN, &acc[g][c], sizeof(vn));
}

void codec_decode_attention_team(
    const float *q, int64_t q_ss, const codec_pools *cp, const int32_t *tables, int64_t tab_ss, int64_t tab_sh,
    int64_t tab_sj, const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    int S, int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    float *out, float *key_scores, float *scores, float *partials)
{
    const int64_t n_chunks = T / chunk_slots;
    const int64_t n_items = (int64_t)S * H * n_chunks;
    const block_format *kf = cp->kf, *vf = cp->vf;
    const int fast_keys = direct_keys(kf, bs), fast_values = direct_values(vf, D);
    float *tile = cp->tiles;
#ifdef _OPENMP
    tile += (int64_t)omp_get_thread_num() * bs * D;
#endif
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < n_items; item++) {
        work_item w;
        if (!work_item_at(item, n_chunks, chunk_slots, H, G, D, T, q, q_ss, tables, tab_ss, tab_sh, lengths, len_ss,
                          len_sh, scores, partials, &w))
            continue;
        /* inlined with the head dim and the common group sizes constant (registers for the accumulators) */
#define ATTEND_CODEC(GC, DC)                                                                                    \
    attend_chunk_codec(w.qh, cp->k_fp, cp->v_fp, cp->fp_is_half, cp->kq, cp->vq, kf, vf, cp->num_fp, w.table,  \
                       tab_sj, bs, GC, DC, scale, w.t0, w.t1, T, w.sc, w.part, tile, fast_keys, fast_values)
#define ATTEND_CODEC_G(DC)                     \
    switch (G) {                               \
        case 1: ATTEND_CODEC(1, DC); break;    \
        case 2: ATTEND_CODEC(2, DC); break;    \
        case 3: ATTEND_CODEC(3, DC); break;    \
        case 4: ATTEND_CODEC(4, DC); break;    \
        default: ATTEND_CODEC(G, DC); break;   \
    }
        if (D == 64) {
            ATTEND_CODEC_G(64)
        } else {
            ATTEND_CODEC_G(128)
        }
#undef ATTEND_CODEC_G
#undef ATTEND_CODEC
    }
    team_end();
    merge_chunks(lengths, len_ss, len_sh, S, H, G, D, T, chunk_slots, out, key_scores, scores, partials);
}

/* q [S, H*G, D] fp32; tables [S, H, MB] int32 and lengths [S, H] int64 with element strides; D 64 or 128,
 * G <= 8; scores, partials, out, key_scores as in paged_decode_attention_f32; tiles: nthreads x bs x D floats.
 * One parallel region: the chunks, then their merge. Returns 0, or -1 when the shape is not supported (nothing
 * written). */
int codec_decode_attention_f32(
    const float *q, const void *k_fp, const void *v_fp, int fp_is_half, const uint8_t *kq, const uint8_t *vq,
    const block_format *kf, const block_format *vf, int64_t num_fp,
    const int32_t *tables, int64_t tab_ss, int64_t tab_sh, int64_t tab_sj,
    const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    int S, int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    float *out, float *key_scores, float *scores, float *partials, float *tiles, int nthreads)
{
    if ((D != 64 && D != 128) || G < 1 || G > GROUP_MAX) return -1;
    const codec_pools cp = {k_fp, v_fp, fp_is_half, kq, vq, kf, vf, num_fp, tiles};
#pragma omp parallel num_threads(nthreads)
    codec_decode_attention_team(q, (int64_t)H * G * D, &cp, tables, tab_ss, tab_sh, tab_sj, lengths, len_ss, len_sh,
                                S, H, G, D, bs, scale, T, chunk_slots, out, key_scores, scores, partials);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Prefill (many queries, causal) over a codec cache, read tile by tile: the decode kernel's approach extended to a
 * chunk of queries. A work item is (sequence, kv-head, up to PREFILL_QT queries); it walks the table's blocks in slot
 * order, decodes each span of blocks' K and V rows (at least 32 keys) into two [span, D] fp32 tiles (load_rows:
 * full-precision blocks copied, packed ones decoded from their codes), and folds them into an online softmax
 * (flash attention) for every query head of the group and query of the tile. Query i sees key t when
 * key_pos[t] <= query_pos[i] and t < length; slots are in position order, so the walk stops at the first block
 * whose first key lies after the tile's last query. No dense copy of the layer is made: per thread, the tiles (K
 * also transposed) and the tile's accumulators. A full-precision cache (PagedKVCache) is read the same way: every
 * block id is below num_fp. Also used for fp32 later prefill chunks of a plain cache (cpu_kernels.paged_attention_cpu).
 *
 * q [S, H*G, Q, D] fp32 contiguous; tables [S, H, MB] int32, lengths [S, H] int64, key_pos [S, H, P] int32 (element
 * strides); query_pos [S, Q] int64 contiguous; out [S, H*G, Q, D]. Rows that see no key are zeros. */
#define PREFILL_QT 128  /* queries per work item */

/* keys a prefill work item takes per step: whole blocks, at least 32 */
static inline int prefill_span(int bs) { return bs >= 32 ? bs : (32 + bs - 1) / bs * bs; }

/* The register tiles of a prefill work item's two products, per span of keys:
 *   scores  PF_QR queries of one head x two vectors of keys: one accumulator each, so each loaded vector of
 *           transposed keys serves PF_QR queries (AVX-512: 8 x 2 = 16 accumulators; AVX2: 4 x 2 = 8);
 *   values  PF_PV_ACC accumulators over PF_PV_ACC / (D / VN) query rows x the D channels, so each loaded value row
 *           serves that many query rows (AVX-512, D 64: 4 rows; AVX2, D 64: 1 row).
 * A row's result is the same sequence of FMAs whatever rows share its tile (a value row past a query's visible
 * keys adds 0 * v), so the tiles change no bit of the result and a query's output does not depend on the chunk. */
#if VN == 16
#define PF_QR 8
#define PF_PV_ACC 16
#else
#define PF_QR 4
#define PF_PV_ACC 8
#endif

/* p[u * bsp + j] = scale * q_u . k_j for the NR (<= PF_QR) queries q_u = q0 + u * D and the keys of vectors
 * c, c + 1 of kT [D, bsp] (two: whether c + 1 exists); inlined with NR and D constant */
static inline __attribute__((always_inline)) void score_tile(const float *restrict q0, const float *restrict kT,
                                                             int bsp, int c, int two, const int NR, const int D,
                                                             float scale, float *restrict p)
{
    vn a[PF_QR][2];
    for (int u = 0; u < NR; u++) a[u][0] = a[u][1] = (vn){0};
    for (int d = 0; d < D; d++) {
        const vn k0 = load_vn(kT + (int64_t)d * bsp + c * VN);
        const vn k1 = two ? load_vn(kT + (int64_t)d * bsp + (c + 1) * VN) : (vn){0};
        for (int u = 0; u < NR; u++) {
            const float x = q0[(int64_t)u * D + d];
            a[u][0] += x * k0;
            a[u][1] += x * k1;
        }
    }
    for (int u = 0; u < NR; u++) {
        store_vn(p + (int64_t)u * bsp + c * VN, a[u][0] * scale);
        if (two) store_vn(p + (int64_t)u * bsp + (c + 1) * VN, a[u][1] * scale);
    }
}

/* acc rows a_u = acc + u * D (u < NR): a_u = a_u * corr[u] + sum_{j < nj} p[u * bsp + j] * vrows[j]; inlined with NR
 * and D constant */
static inline __attribute__((always_inline)) void value_tile(float *restrict acc, const float *restrict p, int bsp,
                                                             const float *restrict corr, const float *restrict vrows,
                                                             int nj, const int NR, const int D)
{
    vn x[PF_PV_ACC > 128 / VN ? PF_PV_ACC : 128 / VN];  /* x[u * (D / VN) + c] */
    for (int u = 0; u < NR; u++)
        for (int c = 0; c < D / VN; c++) x[u * (D / VN) + c] = load_vn(acc + (int64_t)u * D + c * VN) * corr[u];
    for (int j = 0; j < nj; j++) {
        vn v[128 / VN];
        for (int c = 0; c < D / VN; c++) v[c] = load_vn(vrows + (int64_t)j * D + c * VN);
        for (int u = 0; u < NR; u++) {
            const float pj = p[(int64_t)u * bsp + j];
            for (int c = 0; c < D / VN; c++) x[u * (D / VN) + c] += pj * v[c];
        }
    }
    for (int u = 0; u < NR; u++)
        for (int c = 0; c < D / VN; c++) store_vn(acc + (int64_t)u * D + c * VN, x[u * (D / VN) + c]);
}

/* One work item: queries [i0, i1) of one (sequence, kv-head), all G query heads. Per span of whole blocks (at
 * least 32 keys): K rows decoded into `krows` [span, D] and transposed into kT [D, bsp] (bsp = span rounded up to
 * whole vectors, zero-padded), so the scores of PF_QR queries against two vectors of keys are D rounds of two
 * vector loads and 2 x PF_QR broadcast-FMAs (score_tile); V rows decoded into `vrows` [span, D] and added to the
 * accumulators of several query rows per loaded row (value_tile); exp and max on whole vectors. A row (g, i) is
 * r = g * nq + (i - i0). Work buffers: m, l [rows], acc [rows, D], p [PF_QR, bsp]. */
static inline __attribute__((always_inline)) void prefill_item(
    const float *q, const void *k_fp, const void *v_fp, int fp_is_half, const uint8_t *kq, const uint8_t *vq,
    const block_format *kf, const block_format *vf, int64_t num_fp, const int32_t *table, int64_t tab_sj,
    int64_t len, const int32_t *kpos, int64_t kpos_sj, const int64_t *qpos, int G, int Q, const int D, int bs,
    float scale, int i0, int i1, float *out, float *krows, float *vrows, float *kT, float *work)
{
    const int span = prefill_span(bs);  /* keys per step: whole blocks, at least 32 (two vectors of FMA chains) */
    const int nq = i1 - i0, rows = G * nq, bsp = (span + VN - 1) / VN * VN, nvs = bsp / VN;
    const int pv_rows = PF_PV_ACC / (D / VN) > 0 ? PF_PV_ACC / (D / VN) : 1;  /* query rows per value tile */
    float *m = work, *l = work + rows, *acc = work + 2 * rows, *p = work + 2 * rows + (int64_t)rows * D;
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    int64_t last_q = qpos[i0];
    for (int i = i0; i < i1; i++) last_q = qpos[i] > last_q ? qpos[i] : last_q;
    vni lane;
    for (int k = 0; k < VN; k++) lane[k] = k;
    const vn neg_inf = (vn){0} - INFINITY;
    for (int64_t t0 = 0; t0 < len; t0 += span) {
        const int64_t first_pos = kpos[t0 * kpos_sj];
        if (first_pos > last_q) break;  /* slots are in position order: nothing later is visible either */
        const int n = len - t0 < span ? (int)(len - t0) : span;
        const int64_t last_pos = kpos[(t0 + n - 1) * kpos_sj];
        for (int b0 = 0; b0 < n; b0 += bs) {
            const int64_t id = table[((t0 + b0) / bs) * tab_sj];
            const int nb = n - b0 < bs ? n - b0 : bs;
            load_rows(k_fp, fp_is_half, kq, kf, num_fp, id, bs, D, 0, nb, krows + (int64_t)b0 * D);
            load_rows(v_fp, fp_is_half, vq, vf, num_fp, id, bs, D, 0, nb, vrows + (int64_t)b0 * D);
        }
        for (int d = 0; d < D; d++) {
            float *row = kT + (int64_t)d * bsp;
            for (int j = 0; j < n; j++) row[j] = krows[(int64_t)j * D + d];
            for (int j = n; j < bsp; j++) row[j] = 0.0f;
        }
        for (int g = 0; g < G; g++)
            for (int u0 = i0; u0 < i1; u0 += PF_QR) {  /* a tile of queries [u0, u0 + nr) of head g */
                const int nr = i1 - u0 < PF_QR ? i1 - u0 : PF_QR;
                int64_t tile_last = qpos[u0];
                for (int u = 1; u < nr; u++) tile_last = qpos[u0 + u] > tile_last ? qpos[u0 + u] : tile_last;
                if (first_pos > tile_last) continue;  /* no query of the tile sees the span */
                const float *q0 = q + ((int64_t)g * Q + u0) * D;
                for (int c = 0; c < nvs; c += 2) {
                    if (nr == PF_QR)
                        score_tile(q0, kT, bsp, c, c + 1 < nvs, PF_QR, D, scale, p);
                    else
                        for (int u = 0; u < nr; u++)
                            score_tile(q0 + (int64_t)u * D, kT, bsp, c, c + 1 < nvs, 1, D, scale,
                                       p + (int64_t)u * bsp);
                }
                float corr[PF_QR];
                int nj = 0;  /* value rows the tile reads: the most keys a query of it sees */
                for (int u = 0; u < nr; u++) {
                    const int i = u0 + u, r = g * nq + (i - i0);
                    const int64_t qp = qpos[i];
                    float *restrict pr = p + (int64_t)u * bsp;
                    int nvis = n;  /* the visible keys of the span are a prefix of it (position order) */
                    if (last_pos > qp) {
                        nvis = 0;
                        while (nvis < n && kpos[(t0 + nvis) * kpos_sj] <= qp) nvis++;
                    }
                    if (nvis == 0) {  /* sees nothing here: unchanged (weights 0, correction 1) */
                        for (int c = 0; c < nvs; c++) store_vn(pr + c * VN, (vn){0});
                        corr[u] = 1.0f;
                        continue;
                    }
                    nj = nvis > nj ? nvis : nj;
                    vn vmax = neg_inf;
                    for (int c = 0; c < nvs; c++) {  /* scores past nvis are -inf from here on */
                        const vn sc = select_vn(lane + c * VN < nvis, load_vn(pr + c * VN), neg_inf);
                        store_vn(pr + c * VN, sc);
                        vmax = max_vn(sc, vmax);
                    }
                    const float mx = max_lanes(vmax);
                    const float m_new = m[r] > mx ? m[r] : mx;
                    corr[u] = exp_nonpos(m[r] - m_new);  /* ~0 on the first visible span: acc, l are 0 */
                    vn vsum = {0};
                    for (int c = 0; c < nvs; c++) {  /* exp(-inf - m) clamps to e^-87, masked back to 0 */
                        const vn e = select_vn(lane + c * VN < nvis, exp_nonpos_vn(load_vn(pr + c * VN) - m_new),
                                               (vn){0});
                        store_vn(pr + c * VN, e);
                        vsum += e;
                    }
                    l[r] = l[r] * corr[u] + sum_lanes(vsum);
                    m[r] = m_new;
                }
                if (nj == 0) continue;
                float *a0 = acc + ((int64_t)g * nq + (u0 - i0)) * D;
                int u = 0;
                if (pv_rows > 1)
                    for (; u + pv_rows <= nr; u += pv_rows)
                        value_tile(a0 + (int64_t)u * D, p + (int64_t)u * bsp, bsp, corr + u, vrows, nj, pv_rows, D);
                for (; u < nr; u++)
                    value_tile(a0 + (int64_t)u * D, p + (int64_t)u * bsp, bsp, corr + u, vrows, nj, 1, D);
            }
    }
    for (int g = 0; g < G; g++)
        for (int i = i0; i < i1; i++) {
            const int r = g * nq + (i - i0);
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            float *o = out + ((int64_t)g * Q + i) * D;
            const float *a = acc + (int64_t)r * D;
            for (int d = 0; d < D; d++) o[d] = a[d] * inv;
        }
}

int codec_prefill_attention_f32(
    const float *q, const void *k_fp, const void *v_fp, int fp_is_half, const uint8_t *kq, const uint8_t *vq,
    const block_format *kf, const block_format *vf, int64_t num_fp,
    const int32_t *tables, int64_t tab_ss, int64_t tab_sh, int64_t tab_sj,
    const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    const int32_t *key_pos, int64_t kp_ss, int64_t kp_sh, int64_t kp_sj, const int64_t *query_pos,
    int S, int H, int G, int Q, int D, int bs, float scale, float *out, float *scratch, int64_t scratch_per_thread,
    int nthreads)
{
    if ((D != 64 && D != 128) || G < 1 || bs < 1) return -1;
    const int n_tiles = (Q + PREFILL_QT - 1) / PREFILL_QT;
    const int64_t n_items = (int64_t)S * H * n_tiles;
#pragma omp parallel num_threads(nthreads)
    {
        float *mine = scratch;
#ifdef _OPENMP
        mine += (int64_t)omp_get_thread_num() * scratch_per_thread;
#endif
        const int span = prefill_span(bs), bsp = (span + VN - 1) / VN * VN;
        float *krows = mine, *vrows = mine + (int64_t)span * D, *kT = mine + 2 * (int64_t)span * D;
        float *work = kT + (int64_t)D * bsp;
#if defined(__SSE__)
        /* flush denormals to zero in this region (restored below): a running max that jumps makes acc * corr and
         * tiny weights denormal, which x86 computes many times slower, for no change to an fp32 result */
        const unsigned int csr = __builtin_ia32_stmxcsr();
        __builtin_ia32_ldmxcsr(csr | 0x8040);
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < n_items; item++) {
            const int tile = (int)(item % n_tiles);
            const int h = (int)((item / n_tiles) % H);
            const int s = (int)(item / n_tiles / H);
            const int i0 = tile * PREFILL_QT, i1 = i0 + PREFILL_QT < Q ? i0 + PREFILL_QT : Q;
            const int64_t len = lengths[s * len_ss + h * len_sh];
            const float *qh = q + (((int64_t)s * H + h) * G) * Q * D;
            float *oh = out + (((int64_t)s * H + h) * G) * Q * D;
            if (D == 64)
                prefill_item(qh, k_fp, v_fp, fp_is_half, kq, vq, kf, vf, num_fp, tables + s * tab_ss + h * tab_sh,
                             tab_sj, len, key_pos + s * kp_ss + h * kp_sh, kp_sj, query_pos + (int64_t)s * Q, G, Q,
                             64, bs, scale, i0, i1, oh, krows, vrows, kT, work);
            else
                prefill_item(qh, k_fp, v_fp, fp_is_half, kq, vq, kf, vf, num_fp, tables + s * tab_ss + h * tab_sh,
                             tab_sj, len, key_pos + s * kp_ss + h * kp_sh, kp_sj, query_pos + (int64_t)s * Q, G, Q,
                             128, bs, scale, i0, i1, oh, krows, vrows, kT, work);
        }
#if defined(__SSE__)
        __builtin_ia32_ldmxcsr(csr);
#endif
    }
    return 0;
}
