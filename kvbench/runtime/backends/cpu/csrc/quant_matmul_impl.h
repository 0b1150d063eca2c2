/* The body of quant_matmul.c, included once per instruction set with SFX (the names' suffix) and QN (floats per
 * vector: 4 = generic C, 8 = AVX2, 16 = AVX-512) defined. GCC's vector extensions: each operation below works on
 * QN lanes at once (a lane per value of the block). */
#define QCAT_(a, b) a##_##b
#define QCAT(a, b) QCAT_(a, b)
#define QF(name) QCAT(name, SFX)

#ifndef TILE_W
#define TILE_W 4   /* weight rows a thread expands and multiplies together */
#define TILE_X 2   /* input rows of a register tile (TILE_W x TILE_X vector accumulators) */
#define CHUNK 256  /* values of a row expanded at a time on the decode path (4 rows: 4 KiB, in L1) */
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

/* fp32 values [k0, k0 + n) of one row (k0, n: whole blocks) into y (ggml's dequantize_row_* per type) */
static void QF(dequant_span)(int type, const uint8_t *row, int64_t k0, int64_t n, float *restrict y) {
    const int bv = block_values(type), bb = block_bytes(type);
    const uint8_t *b = row + k0 / bv * bb;
    const uint8_t *end = b + n / bv * bb;
    switch (type) {
    case GGML_Q8_0:
        for (; b < end; b += bb, y += 32) {
            const float d = h2f(rd16(b));
            for (int i = 0; i < 32; i += QN) {
                QF(store)(y + i, QF(tof)(QF(widen)(b + 2 + i, 1)) * d);
            }
        }
        break;
    case GGML_Q4_0:
        for (; b < end; b += bb, y += 32) {
            const float d = h2f(rd16(b));
            for (int i = 0; i < 16; i += QN) { /* QN <= 16: byte i holds values i (low nibble) and i + 16 (high) */
                const QF(vi) q = QF(load_wide)(b + 2 + i);
                QF(store)(y + i, QF(tof)((q & 0xF) - 8) * d);
                QF(store)(y + 16 + i, QF(tof)((q >> 4) - 8) * d);
            }
        }
        break;
    case GGML_Q5_0: {
        QF(vi) lane;
        for (int i = 0; i < QN; i++) lane[i] = i;
        for (; b < end; b += bb, y += 32) {
            const float d = h2f(rd16(b));
            const uint32_t qh = rd32(b + 2); /* bit e: the fifth bit of value e */
            for (int i = 0; i < 16; i += QN) {
                const QF(vi) q = QF(load_wide)(b + 6 + i);
                const QF(vi) h0 = ((qh >> (lane + i)) & 1) << 4, h1 = ((qh >> (lane + i + 16)) & 1) << 4;
                QF(store)(y + i, QF(tof)(((q & 0xF) | h0) - 16) * d);
                QF(store)(y + 16 + i, QF(tof)(((q >> 4) | h1) - 16) * d);
            }
        }
        break;
    }
    case GGML_Q4_K:
        for (; b < end; b += bb, y += 256) {
            const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *q = b + 16;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
                float s1, m1, s2, m2;
                scale_min_k4(is, sc, &s1, &m1);
                scale_min_k4(is + 1, sc, &s2, &m2);
                const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
                for (int l = 0; l < 32; l += QN) {
                    const QF(vi) v = QF(load_wide)(q + l);
                    QF(store)(y + j + l, QF(tof)(v & 0xF) * d1 - o1);
                    QF(store)(y + j + 32 + l, QF(tof)(v >> 4) * d2 - o2);
                }
            }
        }
        break;
    case GGML_Q5_K:
        for (; b < end; b += bb, y += 256) {
            const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + 48;
            int shift = 0;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, shift += 2) {
                float s1, m1, s2, m2;
                scale_min_k4(is, sc, &s1, &m1);
                scale_min_k4(is + 1, sc, &s2, &m2);
                const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
                for (int l = 0; l < 32; l += QN) {
                    const QF(vi) v = QF(load_wide)(ql + l), h = QF(load_wide)(qh + l);
                    const QF(vi) lo = (v & 0xF) | (((h >> shift) & 1) << 4);
                    const QF(vi) hi = (v >> 4) | (((h >> (shift + 1)) & 1) << 4);
                    QF(store)(y + j + l, QF(tof)(lo) * d1 - o1);
                    QF(store)(y + j + 32 + l, QF(tof)(hi) * d2 - o2);
                }
            }
        }
        break;
    case GGML_Q6_K:
        for (; b < end; b += bb, y += 256) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = h2f(rd16(b + 208));
            for (int n0 = 0; n0 < 256; n0 += 128, ql += 64, qh += 32, sc += 8) {
                for (int l = 0; l < 32; l += QN) { /* values l..l+QN-1 share sub-scales (16 values each) */
                    const int is = l / 16;
                    const QF(vi) a = QF(load_wide)(ql + l), c = QF(load_wide)(ql + l + 32), h = QF(load_wide)(qh + l);
                    const QF(vi) q1 = (a & 0xF) | ((h & 3) << 4), q2 = (c & 0xF) | (((h >> 2) & 3) << 4);
                    const QF(vi) q3 = (a >> 4) | (((h >> 4) & 3) << 4), q4 = (c >> 4) | (((h >> 6) & 3) << 4);
                    QF(store)(y + n0 + l, QF(tof)(q1 - 32) * (d * sc[is]));
                    QF(store)(y + n0 + l + 32, QF(tof)(q2 - 32) * (d * sc[is + 2]));
                    QF(store)(y + n0 + l + 64, QF(tof)(q3 - 32) * (d * sc[is + 4]));
                    QF(store)(y + n0 + l + 96, QF(tof)(q4 - 32) * (d * sc[is + 6]));
                }
            }
        }
        break;
    }
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

static void QF(qmm)(int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, int nthreads) {
    const int64_t tiles = (O + TILE_W - 1) / TILE_W;
    const int decode = M <= TILE_X;
#pragma omp parallel num_threads(nthreads)
    {
        /* decode: TILE_W x CHUNK expanded values; prefill: TILE_W whole rows */
        const size_t floats = (size_t)(decode ? TILE_W * CHUNK : TILE_W * K);
        float *wbuf = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t o0 = t * TILE_W;
            const int nr = O - o0 < TILE_W ? (int)(O - o0) : TILE_W;
            if (decode) { /* each weight byte read once, expanded CHUNK values at a time */
                QF(vf) a[TILE_W][TILE_X] = {{{0}}};
                for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
                    const int64_t n = K - k0 < CHUNK ? K - k0 : CHUNK;
                    for (int r = 0; r < TILE_W; r++) /* a ragged last tile repeats its last row */
                        QF(dequant_span)(type, W + (o0 + (r < nr ? r : nr - 1)) * row_bytes, k0, n, wbuf + r * CHUNK);
                    if (M == 1)
                        QF(dots)(wbuf, CHUNK, x + k0, ldx, n, 1, a);
                    else
                        QF(dots)(wbuf, CHUNK, x + k0, ldx, n, 2, a);
                }
                for (int r = 0; r < nr; r++)
                    for (int m = 0; m < M; m++) y[m * ldy + o0 + r] = QF(hsum)(&a[r][m]);
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
                    for (int m = 0; m < nm; m++) y[(m0 + m) * ldy + o0 + r] = QF(hsum)(&a[r][m]);
            }
        }
        free(wbuf);
    }
}
