/* The body of quant_matmul.c, included once per instruction set with SFX (the names' suffix) and QN (floats per
 * vector: 4 = generic C, 8 = AVX2, 16 = AVX-512) defined. GCC's vector extensions: each operation below works on
 * QN lanes at once (a lane per value of the block). */
#define QCAT_(a, b) a##_##b
#define QCAT(a, b) QCAT_(a, b)
#define QF(name) QCAT(name, SFX)

#ifndef TILE_W
#define TILE_W 4   /* weight rows a thread expands and multiplies together */
#define TILE_X 2   /* input rows of a register tile (TILE_W x TILE_X vector accumulators) */
#endif

typedef float QF(vf) __attribute__((vector_size(QN * 4)));
typedef int32_t QF(vi) __attribute__((vector_size(QN * 4)));
typedef uint8_t QF(vu8) __attribute__((vector_size(QN)));

static inline QF(vu8) QF(load_u8)(const uint8_t *p) {
    QF(vu8) v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void QF(store)(float *p, QF(vf) v) { memcpy(p, &v, sizeof v); }
/* QN bytes widened to 32-bit lanes (0..255, or -128..127 when `sign`): the bit operations below run on these lanes,
 * where every instruction set has vector shifts (AVX2 has none for bytes). One vpmovzxbd / vpmovsxbd where there is
 * one (GCC 12 widens a byte vector lane by lane otherwise); QKIND: 0 generic, 1 AVX2, 2 AVX-512, 3 AVX2 in pairs */
static inline __attribute__((always_inline)) QF(vi) QF(widen)(const uint8_t *p, int sign) {
#if QKIND == 1 || QKIND == 3
    const __m128i b0 = _mm_loadl_epi64((const __m128i *)p);
    const __m256i lo = sign ? _mm256_cvtepi8_epi32(b0) : _mm256_cvtepu8_epi32(b0);
#if QKIND == 1
    return (QF(vi))lo;
#else
    const __m128i b1 = _mm_loadl_epi64((const __m128i *)(p + 8));
    const __m256i hi = sign ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
    QF(vi) r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#endif
#elif QKIND == 2
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (QF(vi))(sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
    QF(vi) r;
    for (int i = 0; i < QN; i++) r[i] = sign ? (int32_t)(int8_t)p[i] : (int32_t)p[i];
    return r;
#endif
}
static inline QF(vi) QF(load_wide)(const uint8_t *p) { return QF(widen)(p, 0); }
static inline QF(vf) QF(tof)(QF(vi) v) { return __builtin_convertvector(v, QF(vf)); }

/* fp32 values [k0, k0 + n) of one row (k0, n: whole blocks) into y */
static void QF(dequant_span)(int type, const uint8_t *row, int64_t k0, int64_t n, float *restrict y) {
#define EMIT(off, slot, v) QF(store)(y + (off), (v))
#include "quant_blocks.h"
#undef EMIT
}

/* acc[m][slot] += the row's values [k0, k0 + n) * x[m][k0 ...] lane-wise for nx <= TILE_X input rows (stride ldx),
 * each block expanded in registers (no store): the decode GEMV. Inlined with a constant nx. */
static inline __attribute__((always_inline)) void QF(dot_span)(int type, const uint8_t *row, int64_t k0, int64_t n,
                                                               const float *y, int64_t ldx, int nx,
                                                               QF(vf) acc[TILE_X][4]) {
#define EMIT(off, slot, v)                                                \
    do {                                                                  \
        const QF(vf) w_ = (v);                                            \
        for (int m_ = 0; m_ < nx; m_++) {                                 \
            QF(vf) x_;                                                    \
            memcpy(&x_, y + m_ * ldx + (off), sizeof x_);                 \
            acc[m_][slot] += w_ * x_;                                     \
        }                                                                 \
    } while (0)
#include "quant_blocks.h"
#undef EMIT
}

static inline float QF(hsum)(const QF(vf) *v) {
    float s = 0.0f;
    for (int i = 0; i < QN; i++) s += (*v)[i];
    return s;
}

/* a[r][m] += w[r][0:n] * x[m][0:n] lane-wise for TILE_W rows w (stride ldw) and nx <= TILE_X rows x (stride ldx);
 * n % QN == 0. Always inlined with a constant nx, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void QF(dots)(const float *w, int64_t ldw, const float *x, int64_t ldx,
                                                           int64_t n, int nx, QF(vf) a[TILE_W][TILE_X]) {
    for (int64_t k = 0; k < n; k += QN) {
        QF(vf) xv[TILE_X];
        for (int m = 0; m < nx; m++) memcpy(&xv[m], x + m * ldx + k, sizeof xv[m]);
        for (int r = 0; r < TILE_W; r++) {
            QF(vf) wv;
            memcpy(&wv, w + r * ldw + k, sizeof wv);
            for (int m = 0; m < nx; m++) a[r][m] += wv * xv[m];
        }
    }
}

/* y[m * ldy + o] (+)= W[o, :] . x[m * ldx + :] (+ bias[o]) for o < O, m < M: a work-shared loop over tiles of
 * TILE_W weight rows (`omp for nowait`: every thread of the enclosing parallel region calls it, and the caller ends
 * it with a barrier; one thread outside any region runs it whole). With `accumulate`, y += (dot + bias): the order
 * of an op-by-op `x + (x @ W^T + b)`. The fused decode step (decode_layer.c) calls it inside its one region. */
static void QF(qmm_team)(int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                         int64_t ldx, int64_t M, float *y, int64_t ldy, const float *bias, int accumulate) {
    const int64_t tiles = (O + TILE_W - 1) / TILE_W;
    const int decode = M <= TILE_X;
    /* prefill: TILE_W whole rows expanded (decode needs none) */
    float *wbuf = decode ? NULL : aligned_alloc(64, ((size_t)TILE_W * K * 4 + 63) / 64 * 64);
#define QSTORE(m, o, v)                                              \
    do {                                                             \
        const float v_ = bias ? (v) + bias[o] : (v);                 \
        float *y_ = y + (m) * ldy + (o);                             \
        *y_ = accumulate ? *y_ + v_ : v_;                            \
    } while (0)
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o0 = t * TILE_W;
        const int nr = O - o0 < TILE_W ? (int)(O - o0) : TILE_W;
        if (decode) { /* each weight byte read once, its blocks expanded in registers */
            for (int r = 0; r < nr; r++) {
                QF(vf) acc[TILE_X][4] = {{{0}}};
                if (M == 1)
                    QF(dot_span)(type, W + (o0 + r) * row_bytes, 0, K, x, ldx, 1, acc);
                else
                    QF(dot_span)(type, W + (o0 + r) * row_bytes, 0, K, x, ldx, 2, acc);
                for (int m = 0; m < M; m++) {
                    const QF(vf) t = (acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]);
                    QSTORE(m, o0 + r, QF(hsum)(&t));
                }
            }
            continue;
        }
        for (int r = 0; r < TILE_W; r++) /* prefill: the tile's rows expanded once, then every input row */
            QF(dequant_span)(type, W + (o0 + (r < nr ? r : nr - 1)) * row_bytes, 0, K, wbuf + r * K);
        for (int64_t m0 = 0; m0 < M; m0 += TILE_X) {
            const int nm = M - m0 < TILE_X ? (int)(M - m0) : TILE_X;
            QF(vf) a[TILE_W][TILE_X] = {{{0}}};
            if (nm == 1)
                QF(dots)(wbuf, K, x + m0 * ldx, ldx, K, 1, a);
            else
                QF(dots)(wbuf, K, x + m0 * ldx, ldx, K, 2, a);
            for (int r = 0; r < nr; r++)
                for (int m = 0; m < nm; m++) QSTORE(m0 + m, o0 + r, QF(hsum)(&a[r][m]));
        }
    }
#undef QSTORE
    free(wbuf);
}

static void QF(qmm)(int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    QF(qmm_team)(type, W, row_bytes, O, K, x, ldx, M, y, ldy, NULL, 0);
}
