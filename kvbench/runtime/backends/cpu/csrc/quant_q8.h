/* Q8 activations for the products with Q8_0, Q4_0, Q5_0, Q4_K and Q6_K weights (llama.cpp's scheme, ggml-quants.c's
 * quantize_row_q8_0 and ggml_vec_dot_*_q8_0 / _q8_K; kvbench's code): each input row is quantized once to Q8_0 blocks
 * of 32 values, an fp32 scale d = max|x| / 127 and codes q = round-half-even(x / d) in [-127, 127], and each 32-value
 * block of the weight row is multiplied with the row's block in integers (exact), then scaled in fp32:
 *
 *   y[m, o] = sum_b d_x[m, b] * (s_w[o, b] * sum_i q_w[o, b, i] * q_x[m, b, i] - off_w[o, b] * sum_i q_x[m, b, i])
 *
 * (s_w: the block's weight scale, per 16 values for Q6_K; off_w: Q4_K's dmin * m, else 0). llama.cpp quantizes the
 * activations of K-quant products in 256-value Q8_K blocks; here they share the 32-value blocks (finer scales).
 * It changes the numbers (the activation's rounding: up to half a code, 1/254 of a block's largest value, per
 * element), so it is an option (quant_linear.py: QuantLinear.activations). Included by quant_matmul.c after the fp32
 * kernels. AVX2 path: each weight block unpacked to 32 int8 once and multiplied with up to Q8_ROWS input rows
 * (vpsignb / vpmaddubsw / vpmaddwd, one fp32 FMA per block and row); the AVX-512 ISA runs the same AVX2 code;
 * generic C: scalar. Q5_K keeps fp32 activations. */
enum { ACT_FP32 = 0, ACT_Q8 = 1 };
#define Q8_ROWS 4  /* input rows that share each unpacked weight block */

/* whether the Q8-activation kernels take this weight type (the others keep fp32 activations) */
static inline int q8_activation_type(int type) {
    return type == GGML_Q8_0 || type == GGML_Q4_0 || type == GGML_Q5_0 || type == GGML_Q4_K || type == GGML_Q6_K;
}
static inline int q8_k_type(int type) { return type == GGML_Q4_K || type == GGML_Q6_K; }

/* one row of K floats (K % 32 == 0) -> codes qs [K], scales d [K / 32] and code sums [K / 32] (quantize_row_q8_0's
 * rounding:
 * d = amax / 127, id = 1 / d, q = round(x * id); a zero block: d = 0, codes 0) */
static inline void quantize_row_q8(const float *restrict x, int64_t K, int8_t *restrict qs, float *restrict d,
                                   float *restrict sums) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            const int q = (int)nearbyintf(xb[i] * id);  /* half to even */
            qs[b * 32 + i] = (int8_t)q;
            sum += q;
        }
        sums[b] = (float)sum;  /* exact: the K-quants' offsets multiply it */
    }
}

/* the 32 weights of one block as int8 (generic C) */
static inline void q8_unpack_generic(int type, const uint8_t *b, int8_t w[32]) {
    switch (type) {
    case GGML_Q8_0: memcpy(w, b + 2, 32); break;
    case GGML_Q4_0:
        for (int i = 0; i < 16; i++) {
            w[i] = (int8_t)((b[2 + i] & 0xF) - 8);
            w[i + 16] = (int8_t)((b[2 + i] >> 4) - 8);
        }
        break;
    default: { /* Q5_0 */
        const uint32_t qh = rd32(b + 2);
        for (int i = 0; i < 16; i++) {
            w[i] = (int8_t)(((b[6 + i] & 0xF) | ((qh >> i) & 1) << 4) - 16);
            w[i + 16] = (int8_t)(((b[6 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - 16);
        }
    }
    }
}

/* d[m] = the Q8 product of one weight row (nb blocks) with nx <= Q8_ROWS quantized rows (codes K apart) */
static void q8_dot_rows_generic(int type, const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd,
                                int64_t K, int nx, float d[Q8_ROWS]) {
    const int bb = block_bytes(type);
    for (int m = 0; m < nx; m++) d[m] = 0.0f;
    for (int64_t j = 0; j < nb; j++, row += bb) {
        int8_t w[32];
        q8_unpack_generic(type, row, w);
        const float dw = h2f(rd16(row));
        for (int m = 0; m < nx; m++) {
            const int8_t *x = xq + m * K + j * 32;
            int32_t s = 0;
            for (int i = 0; i < 32; i++) s += (int32_t)w[i] * x[i];
            d[m] += (dw * xd[m * (K / 32) + j]) * (float)s;
        }
    }
}

/* 32-value sub-block c (0..7) of a Q4_K / Q6_K super-block b: its 32 weights as int8 w and the scales of its two
 * halves sa, sb and an offset off such that weight i = s(i) * w[i] - off (Q4_K: one 6-bit scale and min, d * sc and
 * dmin * m; Q6_K: a scale per 16 values, no offset), as quant_blocks.h expands them */
static inline void qk_sub_block(int type, const uint8_t *b, int c, int8_t w[32], float *sa, float *sb, float *off) {
    if (type == GGML_Q4_K) {
        float sc, m;
        scale_min_k4(c, b + 4, &sc, &m);
        const uint8_t *q = b + 16 + (c / 2) * 32;  /* even c: the low nibbles of 32 bytes, odd c: their high nibbles */
        for (int i = 0; i < 32; i++) w[i] = (int8_t)(c & 1 ? q[i] >> 4 : q[i] & 0xF);
        *sa = *sb = h2f(rd16(b)) * sc;
        *off = h2f(rd16(b + 2)) * m;
        return;
    }
    const int half = c / 4, k = c % 4;  /* Q6_K: 128 values a half, four 32-value blocks in it */
    const uint8_t *ql = b + half * 64 + (k & 1) * 32, *qh = b + 128 + half * 32;
    const int8_t *sc = (const int8_t *)(b + 192) + half * 8 + 2 * k;
    for (int i = 0; i < 32; i++) {
        const int nib = k < 2 ? ql[i] & 0xF : ql[i] >> 4;
        w[i] = (int8_t)((nib | (((qh[i] >> (2 * k)) & 3) << 4)) - 32);
    }
    const float d = h2f(rd16(b + 208));
    *sa = d * sc[0];
    *sb = d * sc[1];
    *off = 0.0f;
}

/* q8_dot_rows_generic for Q4_K / Q6_K weights (nb: 32-value blocks; xs: the rows' code sums per block) */
static void q8k_dot_rows_generic(int type, const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd,
                                 const float *xs, int64_t K, int nx, float d[Q8_ROWS]) {
    const int bb = block_bytes(type);
    for (int m = 0; m < nx; m++) d[m] = 0.0f;
    for (int64_t j = 0; j < nb; j++) {
        int8_t w[32];
        float sa, sb, off;
        qk_sub_block(type, row + j / 8 * bb, (int)(j % 8), w, &sa, &sb, &off);
        for (int m = 0; m < nx; m++) {
            const int8_t *x = xq + m * K + j * 32;
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 16; i++) s0 += (int32_t)w[i] * x[i];
            for (int i = 16; i < 32; i++) s1 += (int32_t)w[i] * x[i];
            d[m] += xd[m * (K / 32) + j] * (sa * (float)s0 + sb * (float)s1 - off * xs[m * (K / 32) + j]);
        }
    }
}

#ifdef KV_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
/* 32 bits -> 32 bytes, 0xFF where bit e of `bits` is set (byte e) */
static inline __m256i q8_bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);  /* byte e: byte e / 8 of bits */
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);  /* byte e tests bit e % 8 */
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

/* the 32 weights of one block as int8 lanes */
static inline __attribute__((always_inline)) __m256i q8_unpack_avx2(int type, const uint8_t *b) {
    if (type == GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i t = _mm_loadu_si128((const __m128i *)(b + (type == GGML_Q4_0 ? 2 : 6)));
    /* byte i: value i (low nibble), byte 16 + i: value 16 + i (high nibble) */
    const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
    if (type == GGML_Q4_0) return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    /* Q5_0: (nibble | bit << 4) - 16 = the nibble where the bit is set, nibble | 0xF0 (nibble - 16) where not */
    return _mm256_or_si256(v, _mm256_andnot_si256(q8_bits_to_bytes(rd32(b + 2)), _mm256_set1_epi8((char)0xF0)));
}

/* the 8 partial sums of w . x over 32 int8 lanes (|w| <= 128, |x| <= 127: no 16-bit saturation), as floats */
static inline __m256 q8_dot_i8(__m256i w, __m256i x) {
    const __m256i s16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
}

static inline float q8_hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* q8_dot_rows_generic's product, AVX2, with NX constant */
static inline __attribute__((always_inline)) void q8_dot_rows_avx2_n(int type, const uint8_t *row, int64_t nb,
                                                                   const int8_t *xq, const float *xd, int64_t K,
                                                                   const int NX, float d[Q8_ROWS]) {
    const int bb = block_bytes(type);
    __m256 acc[Q8_ROWS];
    for (int m = 0; m < NX; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; j++, row += bb) {
        const __m256i w = q8_unpack_avx2(type, row);
        const float dw = _cvtsh_ss(rd16(row));
        for (int m = 0; m < NX; m++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + m * K + j * 32));
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[m * (K / 32) + j]), q8_dot_i8(w, x), acc[m]);
        }
    }
    for (int m = 0; m < NX; m++) d[m] = q8_hsum_avx2(acc[m]);
}

static void q8_dot_rows_avx2(int type, const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd, int64_t K,
                             int nx, float d[Q8_ROWS]) {
    switch (nx) {  /* the type too, so each unpack is inlined with its branches resolved */
#define Q8_CASE(N)                                                                                     \
    case N:                                                                                            \
        if (type == GGML_Q8_0) q8_dot_rows_avx2_n(GGML_Q8_0, row, nb, xq, xd, K, N, d);                \
        else if (type == GGML_Q4_0) q8_dot_rows_avx2_n(GGML_Q4_0, row, nb, xq, xd, K, N, d);           \
        else q8_dot_rows_avx2_n(GGML_Q5_0, row, nb, xq, xd, K, N, d);                                  \
        break;
    Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4)
#undef Q8_CASE
    }
}

/* qk_sub_block in AVX2 lanes: the 32 weights as int8 */
static inline __attribute__((always_inline)) __m256i qk_unpack_avx2(int type, const uint8_t *b, int c, float *sa,
                                                                    float *sb, float *off) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == GGML_Q4_K) {
        float sc, m;
        scale_min_k4(c, b + 4, &sc, &m);
        *sa = *sb = _cvtsh_ss(rd16(b)) * sc;
        *off = _cvtsh_ss(rd16(b + 2)) * m;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + (c / 2) * 32));
        return _mm256_and_si256(c & 1 ? _mm256_srli_epi16(v, 4) : v, low4);
    }
    const int half = c / 4, k = c % 4;
    const int8_t *sc = (const int8_t *)(b + 192) + half * 8 + 2 * k;
    const float d = _cvtsh_ss(rd16(b + 208));
    *sa = d * sc[0];
    *sb = d * sc[1];
    *off = 0.0f;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + half * 64 + (k & 1) * 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + half * 32));
    const __m256i nib = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
    const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(h, 4)), _mm256_set1_epi8(32));
}

/* q8k_dot_rows_generic in AVX2: int32 lanes 0-3 of a block's product hold its first 16 values, 4-7 the rest, so
 * one vector of (sa x4, sb x4) scales both halves; the offsets' sum is kept apart and subtracted at the end */
static inline __attribute__((always_inline)) void q8k_dot_rows_avx2_n(int type, const uint8_t *row, int64_t nb,
                                                                    const int8_t *xq, const float *xd,
                                                                    const float *xs, int64_t K, const int NX,
                                                                    float d[Q8_ROWS]) {
    const int bb = block_bytes(type);
    __m256 acc[Q8_ROWS];
    float corr[Q8_ROWS];
    for (int m = 0; m < NX; m++) {
        acc[m] = _mm256_setzero_ps();
        corr[m] = 0.0f;
    }
    for (int64_t j = 0; j < nb; j++) {
        float sa, sb, off;
        const __m256i w = qk_unpack_avx2(type, row + j / 8 * bb, (int)(j % 8), &sa, &sb, &off);
        const __m256 s = _mm256_setr_ps(sa, sa, sa, sa, sb, sb, sb, sb);  /* once per block, for every row */
        for (int m = 0; m < NX; m++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + m * K + j * 32));
            const float dx = xd[m * (K / 32) + j];
            acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(dx)), q8_dot_i8(w, x), acc[m]);
            corr[m] += dx * off * xs[m * (K / 32) + j];
        }
    }
    for (int m = 0; m < NX; m++) d[m] = q8_hsum_avx2(acc[m]) - corr[m];
}

static void q8k_dot_rows_avx2(int type, const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd,
                              const float *xs, int64_t K, int nx, float d[Q8_ROWS]) {
    switch (nx) {
#define Q8K_CASE(N)                                                                                    \
    case N:                                                                                            \
        if (type == GGML_Q4_K) q8k_dot_rows_avx2_n(GGML_Q4_K, row, nb, xq, xd, xs, K, N, d);           \
        else q8k_dot_rows_avx2_n(GGML_Q6_K, row, nb, xq, xd, xs, K, N, d);                            \
        break;
    Q8K_CASE(1) Q8K_CASE(2) Q8K_CASE(3) Q8K_CASE(4)
#undef Q8K_CASE
    }
}

static void q8_quantize_rows_avx2(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *xd,
                                  float *xs) {
    for (int64_t m = 0; m < M; m++) quantize_row_q8(x + m * ldx, K, xq + m * K, xd + m * (K / 32), xs + m * (K / 32));
}
#pragma GCC pop_options
#endif

/* quant_matmul_team's product with Q8 activations (a Q8_0, Q4_0 or Q5_0 weight): each thread quantizes the M input
 * rows into its own buffer (no barrier; a few microseconds against the weight's read), then takes its share of the
 * output rows. `simd`: the AVX2 kernels, else generic C. */
static void qmm_q8_team(int simd, int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                        int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t nb = K / 32;
    const int kq = q8_k_type(type);
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc((size_t)(M * nb) * sizeof(float)), *xs = malloc((size_t)(M * nb) * sizeof(float));
#ifdef KV_X86
    if (simd)
        q8_quantize_rows_avx2(x, ldx, M, K, xq, xd, xs);
    else
#endif
        for (int64_t m = 0; m < M; m++) quantize_row_q8(x + m * ldx, K, xq + m * K, xd + m * nb, xs + m * nb);
#pragma omp for schedule(static) nowait
    for (int64_t o = 0; o < O; o++) {
        for (int64_t m0 = 0; m0 < M; m0 += Q8_ROWS) {
            const int nx = M - m0 < Q8_ROWS ? (int)(M - m0) : Q8_ROWS;
            const uint8_t *row = W + o * row_bytes;
            const int8_t *q = xq + m0 * K;
            float d[Q8_ROWS];
#ifdef KV_X86
            if (simd && kq)
                q8k_dot_rows_avx2(type, row, nb, q, xd + m0 * nb, xs + m0 * nb, K, nx, d);
            else if (simd)
                q8_dot_rows_avx2(type, row, nb, q, xd + m0 * nb, K, nx, d);
            else
#endif
            if (kq)
                q8k_dot_rows_generic(type, row, nb, q, xd + m0 * nb, xs + m0 * nb, K, nx, d);
            else
                q8_dot_rows_generic(type, row, nb, q, xd + m0 * nb, K, nx, d);
            for (int m = 0; m < nx; m++) {
                const float v = bias ? d[m] + bias[o] : d[m];
                float *yo = y + (m0 + m) * ldy + o;
                *yo = accumulate ? *yo + v : v;
            }
        }
    }
    free(xq);
    free(xd);
    free(xs);
}
