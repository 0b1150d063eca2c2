/* The body of quant_matmul.c, included once per instruction set with SFX (the names' suffix) and QN (floats per
 * vector: 1 = scalar C, 8 = AVX2, 16 = AVX-512) defined. */
#define QCAT_(a, b) a##_##b
#define QCAT(a, b) QCAT_(a, b)
#define QF(name) QCAT(name, SFX)

#ifndef TILE_W
#define TILE_W 4   /* weight rows a thread expands together */
#define TILE_X 3   /* input rows a register tile multiplies with them (TILE_W x TILE_X accumulators) */
#define CHUNK 256  /* values of a row expanded at a time on the decode path (4 rows: 4 KiB, in L1) */
#endif

#if QN > 1
typedef float QF(vf) __attribute__((vector_size(QN * 4), aligned(4)));
#else
typedef float QF(vf);
#endif

/* fp32 values [k0, k0 + n) of one row (k0, n: whole blocks) into y */
static void QF(dequant_span)(int type, const uint8_t *row, int64_t k0, int64_t n, float *restrict y) {
    const int bv = block_values(type), bb = block_bytes(type);
    const uint8_t *b = row + k0 / bv * bb;
    for (int64_t done = 0; done < n; done += bv, b += bb, y += bv) {
        switch (type) {
        case GGML_Q8_0: {
            const float d = h2f(rd16(b));
            const int8_t *q = (const int8_t *)(b + 2);
            for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
            break;
        }
        case GGML_Q4_0: {
            const float d = h2f(rd16(b));
            const uint8_t *q = b + 2;
            for (int j = 0; j < 16; j++) {
                y[j] = d * (float)((int)(q[j] & 0xF) - 8);
                y[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
            }
            break;
        }
        case GGML_Q5_0: {
            const float d = h2f(rd16(b));
            const uint32_t qh = rd32(b + 2);
            const uint8_t *q = b + 6;
            for (int j = 0; j < 16; j++) {
                const int h0 = (int)(((qh >> j) << 4) & 0x10), h1 = (int)((qh >> (j + 12)) & 0x10);
                y[j] = d * (float)(((q[j] & 0xF) | h0) - 16);
                y[j + 16] = d * (float)(((q[j] >> 4) | h1) - 16);
            }
            break;
        }
        case GGML_Q4_K: {
            const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *q = b + 16;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
                float s1, m1, s2, m2;
                scale_min_k4(is, sc, &s1, &m1);
                scale_min_k4(is + 1, sc, &s2, &m2);
                const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
                for (int l = 0; l < 32; l++) y[j + l] = d1 * (float)(q[l] & 0xF) - o1;
                for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * (float)(q[l] >> 4) - o2;
            }
            break;
        }
        case GGML_Q5_K: {
            const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
            const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + 48;
            int shift = 0;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, shift += 2) {
                float s1, m1, s2, m2;
                scale_min_k4(is, sc, &s1, &m1);
                scale_min_k4(is + 1, sc, &s2, &m2);
                const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
                for (int l = 0; l < 32; l++)
                    y[j + l] = d1 * (float)((ql[l] & 0xF) + (((qh[l] >> shift) & 1) << 4)) - o1;
                for (int l = 0; l < 32; l++)
                    y[j + 32 + l] = d2 * (float)((ql[l] >> 4) + (((qh[l] >> (shift + 1)) & 1) << 4)) - o2;
            }
            break;
        }
        case GGML_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = h2f(rd16(b + 208));
            for (int n0 = 0; n0 < 256; n0 += 128, ql += 64, qh += 32, sc += 8) {
                for (int half = 0; half < 2; half++) { /* l in [0, 16) uses sc[0, 2, 4, 6], [16, 32) sc[1, 3, 5, 7] */
                    const float s1 = d * sc[half], s2 = d * sc[half + 2], s3 = d * sc[half + 4], s4 = d * sc[half + 6];
                    for (int l = half * 16; l < half * 16 + 16; l++) {
                        y[n0 + l] = s1 * (float)((int)((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                        y[n0 + l + 32] = s2 * (float)((int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                        y[n0 + l + 64] = s3 * (float)((int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                        y[n0 + l + 96] = s4 * (float)((int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                    }
                }
            }
            break;
        }
        }
    }
}

static inline float QF(hsum)(QF(vf) v) {
#if QN > 1
    float s = 0.0f;
    for (int i = 0; i < QN; i++) s += v[i];
    return s;
#else
    return v;
#endif
}

/* acc[r][m] += w[r][0:n] . xs[m][0:n] for TILE_W rows w (stride ldw) and TILE_X rows xs (stride ldx); n % QN == 0 */
static inline void QF(dots_tile)(const float *w, int64_t ldw, const float *xs, int64_t ldx, int64_t n,
                                 float acc[TILE_W][TILE_X]) {
    QF(vf) a[TILE_W][TILE_X];
    for (int r = 0; r < TILE_W; r++)
        for (int m = 0; m < TILE_X; m++) a[r][m] = (QF(vf)){0};
    for (int64_t k = 0; k < n; k += QN) {
        QF(vf) xv[TILE_X], wv[TILE_W];
        for (int m = 0; m < TILE_X; m++) memcpy(&xv[m], xs + m * ldx + k, sizeof(QF(vf)));
        for (int r = 0; r < TILE_W; r++) memcpy(&wv[r], w + r * ldw + k, sizeof(QF(vf)));
        for (int r = 0; r < TILE_W; r++)
            for (int m = 0; m < TILE_X; m++) a[r][m] += wv[r] * xv[m];
    }
    for (int r = 0; r < TILE_W; r++)
        for (int m = 0; m < TILE_X; m++) acc[r][m] += QF(hsum)(a[r][m]);
}

/* the TILE_X input rows starting at m0, the last ones repeated where fewer remain (their sums are dropped): a
 * copy only when the tile is ragged */
static inline const float *QF(x_tile)(const float *x, int64_t ldx, int64_t M, int64_t m0, int64_t K,
                                      float *spare) {
    if (M - m0 >= TILE_X) return x + m0 * ldx;
    for (int m = 0; m < TILE_X; m++) memcpy(spare + m * K, x + (m0 + (m0 + m < M ? m : M - 1 - m0)) * ldx, K * 4);
    return spare;
}

static void QF(qmm)(int type, const uint8_t *W, int64_t row_bytes, int64_t O, int64_t K, const float *x,
                    int64_t ldx, int64_t M, float *y, int64_t ldy, int nthreads) {
    const int64_t tiles = (O + TILE_W - 1) / TILE_W;
    const int decode = M <= TILE_X;
#pragma omp parallel num_threads(nthreads)
    {
        /* decode: TILE_W x CHUNK expanded values; prefill: TILE_W whole rows; and a ragged x tile */
        const size_t floats = (size_t)((decode ? TILE_W * CHUNK : TILE_W * K) + TILE_X * K);
        float *wbuf = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        float *spare = wbuf + (decode ? TILE_W * CHUNK : TILE_W * K);
        const float *xt = decode ? QF(x_tile)(x, ldx, M, 0, K, spare) : NULL;
        const int64_t ldxt = decode && M < TILE_X ? K : ldx;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t o0 = t * TILE_W;
            const int nr = O - o0 < TILE_W ? (int)(O - o0) : TILE_W;
            float acc[TILE_W][TILE_X];
            if (decode) {
                memset(acc, 0, sizeof acc);
                for (int64_t k0 = 0; k0 < K; k0 += CHUNK) {
                    const int64_t n = K - k0 < CHUNK ? K - k0 : CHUNK;
                    for (int r = 0; r < TILE_W; r++) /* a ragged last tile repeats its last row */
                        QF(dequant_span)(type, W + (o0 + (r < nr ? r : nr - 1)) * row_bytes, k0, n, wbuf + r * CHUNK);
                    QF(dots_tile)(wbuf, CHUNK, xt + k0, ldxt, n, acc);
                }
                for (int r = 0; r < nr; r++)
                    for (int m = 0; m < M; m++) y[m * ldy + o0 + r] = acc[r][m];
                continue;
            }
            for (int r = 0; r < TILE_W; r++)
                QF(dequant_span)(type, W + (o0 + (r < nr ? r : nr - 1)) * row_bytes, 0, K, wbuf + r * K);
            for (int64_t m0 = 0; m0 < M; m0 += TILE_X) {
                const int nm = M - m0 < TILE_X ? (int)(M - m0) : TILE_X;
                const float *xs = QF(x_tile)(x, ldx, M, m0, K, spare);
                memset(acc, 0, sizeof acc);
                QF(dots_tile)(wbuf, K, xs, nm < TILE_X ? K : ldx, K, acc);
                for (int r = 0; r < nr; r++)
                    for (int m = 0; m < nm; m++) y[(m0 + m) * ldy + o0 + r] = acc[r][m];
            }
        }
        free(wbuf);
    }
}
