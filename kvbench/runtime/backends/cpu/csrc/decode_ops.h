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

/* The GEMV's register tile: TILE_ROWS weight rows by up to TILE_X rows of x, one vector accumulator each, so each
 * loaded weight vector serves TILE_X rows of x and each x vector TILE_ROWS weight rows.
 *   AVX2 (16 registers): 4 x 2 (8 accumulators, 4 weight vectors, 1 x vector); a 4 x 4 tile spills.
 *   AVX-512 (32 registers): 8 x 3 (24 accumulators, 3 x vectors, 1 weight vector). On a 2-core AVX-512 EPYC (Zen 4)
 *   the 4 x 2 tile held 80-85 GFLOP/s from 4 to 16 rows of x, the 8 x 3 tile 120-155 (bench/bench_gemv.py).
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
