/* Q8 activations for the products with Q8_0, Q4_0 and Q5_0 weights (llama.cpp's scheme, ggml-quants.c's
 * quantize_row_q8_0 and ggml_vec_dot_q{8,4,5}_0_q8_0; kvbench's code): each input row is quantized once to Q8_0 blocks
 * of 32 values, an fp32 scale d = max|x| / 127 and codes q = round-half-even(x / d) in [-127, 127], and each block of
 * the weight row is multiplied with the row's block in integers (exact), then scaled by d_w * d_x and summed in fp32:
 *
 *   y[m, o] = sum_b (d_w[o, b] * d_x[m, b]) * sum_{i < 32} q_w[o, b, i] * q_x[m, b, i]
 *
 * It changes the numbers (the activation's rounding: about 0.4% of a block's largest value per element), so it is an
 * option (quant_linear.py: QuantLinear.activations). Included by quant_matmul.c after the fp32 kernels. AVX2 path:
 * each weight block unpacked to 32 int8 once and multiplied with up to Q8_ROWS input rows (vpsignb / vpmaddubsw /
 * vpmaddwd, one fp32 FMA per block and row); the AVX-512 ISA runs the same AVX2 code; generic C: scalar. */
enum { ACT_FP32 = 0, ACT_Q8 = 1 };
#define Q8_ROWS 4  /* input rows that share each unpacked weight block */

/* whether the Q8-activation kernels take this weight type (the others keep fp32 activations) */
static inline int q8_activation_type(int type) { return type == GGML_Q8_0 || type == GGML_Q4_0 || type == GGML_Q5_0; }

/* one row of K floats (K % 32 == 0) -> codes qs [K] and scales d [K / 32] (quantize_row_q8_0's rounding:
 * d = amax / 127, id = 1 / d, q = round(x * id); a zero block: d = 0, codes 0) */
static inline void quantize_row_q8(const float *restrict x, int64_t K, int8_t *restrict qs, float *restrict d) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int i = 0; i < 32; i++) qs[b * 32 + i] = (int8_t)(int)nearbyintf(xb[i] * id);  /* half to even */
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

static void q8_quantize_rows_avx2(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *xd) {
    for (int64_t m = 0; m < M; m++) quantize_row_q8(x + m * ldx, K, xq + m * K, xd + m * (K / 32));
}
#pragma GCC pop_options
#endif

/* quant_matmul_team's product with Q8 activations (a Q8_0, Q4_0 or Q5_0 weight): each thread quantizes the M input
 * rows into its own buffer (no barrier; a few microseconds against the weight's read), then takes its share of the
 * output rows. `simd`: the AVX2 kernels, else generic C. */
static void qmm_q8_team(int simd, int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                        int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t nb = K / 32;
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc((size_t)(M * nb) * sizeof(float));
#ifdef KV_X86
    if (simd)
        q8_quantize_rows_avx2(x, ldx, M, K, xq, xd);
    else
#endif
        for (int64_t m = 0; m < M; m++) quantize_row_q8(x + m * ldx, K, xq + m * K, xd + m * nb);
#pragma omp for schedule(static) nowait
    for (int64_t o = 0; o < O; o++) {
        for (int64_t m0 = 0; m0 < M; m0 += Q8_ROWS) {
            const int nx = M - m0 < Q8_ROWS ? (int)(M - m0) : Q8_ROWS;
            float d[Q8_ROWS];
#ifdef KV_X86
            if (simd)
                q8_dot_rows_avx2(type, W + o * row_bytes, nb, xq + m0 * K, xd + m0 * nb, K, nx, d);
            else
#endif
                q8_dot_rows_generic(type, W + o * row_bytes, nb, xq + m0 * K, xd + m0 * nb, K, nx, d);
            for (int m = 0; m < nx; m++) {
                const float v = bias ? d[m] + bias[o] : d[m];
                float *yo = y + (m0 + m) * ldy + o;
                *yo = accumulate ? *yo + v : v;
            }
        }
    }
    free(xq);
    free(xd);
}
