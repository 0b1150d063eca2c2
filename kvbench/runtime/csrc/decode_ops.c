/* Row-wise ops of the Llama forward on CPU, fp32 (vLLM's CPU backend has the same set).
 * At decode a row is one token: torch spends more on dispatching its composite kernels
 * (rms_norm is five of them) than on the arithmetic, after every weight GEMV has flushed the caches.
 */
#include <math.h>
#include <stdint.h>

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows r of E floats (transformers' LlamaRMSNorm) */
void rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t E, float eps,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * E;
        float *o = out + r * E;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < E; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)E + eps);
#pragma omp simd
        for (int64_t i = 0; i < E; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* In-place rotary embedding (rotate-half convention) of n_heads consecutive heads of D floats at
 * the start of each row: x[r, h, :] = x * cos[r] + rotate_half(x) * sin[r]; row_stride in floats. */
void rotary_f32(float *x, int64_t rows, int64_t row_stride, int64_t n_heads, int64_t D,
                const float *cos_t, const float *sin_t, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + r * D, *s = sin_t + r * D;
        for (int64_t h = 0; h < n_heads; h++) {
            float *v = x + r * row_stride + h * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
