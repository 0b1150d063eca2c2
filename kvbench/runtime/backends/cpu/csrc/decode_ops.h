/* The row-wise ops and projections of decode_ops.c, for the fused decode layer (decode_layer.c). `_team` functions
 * are work-shared loops: every thread of an enclosing parallel region calls them (a barrier ends each), or one
 * thread outside any region runs them whole. */
#ifndef KVBENCH_DECODE_OPS_H
#define KVBENCH_DECODE_OPS_H
#include "decode_common.h"

/* dot(w, x) over n floats; four native-vector accumulators (independent FMA chains) when n is a multiple of 4 VN */
static inline float dot_f32(const float *restrict w, const float *restrict x, int64_t n) {
    if (n % (4 * VN) == 0) {
        vn a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < n; i += 4 * VN) {
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

/* d[r][m] = dot(w[r], x + m * x_ss) over n floats for the 4 weight rows w[r] and the first NX (1 or 2) rows m of
 * x: a register tile of 4 x NX vector accumulators, so each loaded weight vector serves NX rows of x and each x
 * vector 4 weight rows. 4 x 2 fills an AVX2 register file (8 accumulators, 4 weight vectors, 1 x vector, of 16);
 * a 4 x 4 tile spills. n a multiple of VN; inlined with NX constant. */
static inline __attribute__((always_inline)) void dots_4xn(const float *const w[4], const float *restrict x,
                                                           int64_t x_ss, int64_t n, const int NX, float d[4][2]) {
    const float *restrict w0 = w[0], *restrict w1 = w[1], *restrict w2 = w[2], *restrict w3 = w[3];
    const float *restrict x0 = x, *restrict x1 = x + (NX > 1 ? x_ss : 0);
    vn a00 = {0}, a10 = {0}, a20 = {0}, a30 = {0}, a01 = {0}, a11 = {0}, a21 = {0}, a31 = {0};
    for (int64_t i = 0; i < n; i += VN) {
        const vn v0 = *(const vn *)(w0 + i), v1 = *(const vn *)(w1 + i);
        const vn v2 = *(const vn *)(w2 + i), v3 = *(const vn *)(w3 + i);
        const vn y0 = *(const vn *)(x0 + i);
        a00 += v0 * y0;
        a10 += v1 * y0;
        a20 += v2 * y0;
        a30 += v3 * y0;
        if (NX > 1) {
            const vn y1 = *(const vn *)(x1 + i);
            a01 += v0 * y1;
            a11 += v1 * y1;
            a21 += v2 * y1;
            a31 += v3 * y1;
        }
    }
    float s[4];
    hsum4(a00, a10, a20, a30, s);
    for (int r = 0; r < 4; r++) d[r][0] = s[r];
    if (NX > 1) {
        hsum4(a01, a11, a21, a31, s);
        for (int r = 0; r < 4; r++) d[r][1] = s[r];
    }
}

/* dots_4xn for nx = 1 or 2 rows of x, with NX constant */
static inline void dots_4xn_rows(const float *const w[4], const float *restrict x, int64_t x_ss, int64_t n, int nx,
                                 float d[4][2]) {
    if (nx == 1)
        dots_4xn(w, x, x_ss, n, 1, d);
    else
        dots_4xn(w, x, x_ss, n, 2, d);
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
#endif
