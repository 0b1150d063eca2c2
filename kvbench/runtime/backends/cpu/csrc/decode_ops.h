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
