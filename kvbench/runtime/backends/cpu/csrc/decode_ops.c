/* Row-wise ops and projections of the Llama forward on CPU, fp32 (vLLM's CPU backend has the same set).
 * At decode a row is one token: torch spends more on dispatching its composite kernels
 * (rms_norm is five of them) than on the arithmetic, after every weight GEMV has flushed the caches.
 *
 * Each op has a `_team` form, a work-shared loop for the threads of an enclosing parallel region (decode_layer.c
 * runs a whole layer in one region), and an `_f32` entry point that opens its own region.
 */
#include "decode_ops.h"

void rms_norm_team(const float *x, const float *weight, float *out, int64_t rows, int64_t E, float eps) {
#pragma omp for schedule(static) nowait
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
    team_end();
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows r of E floats (transformers' LlamaRMSNorm) */
void rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t E, float eps,
                  int nthreads) {
#pragma omp parallel num_threads(nthreads) if (rows >= 64)
    rms_norm_team(x, weight, out, rows, E, eps);
}

/* In-place rotary embedding (rotate-half convention) of n_heads consecutive heads of D floats at
 * the start of each row: x[r, h, :] = x * cos[r] + rotate_half(x) * sin[r]; row_stride in floats. */
void rotary_f32(float *x, int64_t rows, int64_t row_stride, int64_t n_heads, int64_t D,
                const float *cos_t, const float *sin_t, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < n_heads; h++)
            rotate_half_head(x + r * row_stride + h * D, cos_t + r * D, sin_t + r * D, D);
}

void gemv_team(const float *W, const float *x, int64_t x_ss, const float *b, float *y, int64_t y_ss, int64_t O,
               int64_t I, int64_t M, int accumulate) {
    /* output rows done TILE_ROWS at a time by dots_tile; one input row (batch-1 decode) streams faster through
     * dot_f32 */
    const int64_t tiled = I % VN == 0 && M > 1 ? O / TILE_ROWS * TILE_ROWS : 0;
#pragma omp for schedule(static) nowait
    for (int64_t o = 0; o < tiled; o += TILE_ROWS) {
        const float *rows[TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) rows[r] = W + (o + r) * I;
        /* the next tile's rows, when a tile stays in L1 across its passes (with longer rows, down's 1536, the tile is
         * read from L2 at every pass, and the prefetches only compete with it: a batch-16 step was slower with them;
         * figures: docs/benchmark-results.md) */
        const float *next = o + 2 * TILE_ROWS <= tiled && TILE_ROWS * I * (int64_t)sizeof(float) <= L1_TILE_BYTES
                            ? W + (o + TILE_ROWS) * I : NULL;
        const int64_t passes = (M + TILE_X - 1) / TILE_X;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_X) {
            const int nx = M - m0 < TILE_X ? (int)(M - m0) : TILE_X;
            float d[TILE_ROWS][TILE_X];
            prefetch_share_l2(next, TILE_ROWS * I * (int64_t)sizeof(float), m0 / TILE_X, passes);
            dots_tile_rows(rows, x + m0 * x_ss, x_ss, I, nx, d);
            for (int m = 0; m < nx; m++) {
                float *ym = y + (m0 + m) * y_ss + o;
                for (int r = 0; r < TILE_ROWS; r++) {
                    const float acc = d[r][m] + (b ? b[o + r] : 0.0f);
                    ym[r] = accumulate ? ym[r] + acc : acc;
                }
            }
        }
    }
#pragma omp for schedule(static) nowait
    for (int64_t o = tiled; o < O; o++) {
        const float *w = W + o * I;
        for (int64_t m = 0; m < M; m++) {
            float *ym = y + m * y_ss + o;
            const float acc = dot_f32(w, x + m * x_ss, I) + (b ? b[o] : 0.0f);
            *ym = accumulate ? *ym + acc : acc;
        }
    }
    team_end();
}

/* y[m, o] = dot(W[o, :], x[m, :]) (+ b[o]) for a few rows m < M of x [M, I] against W [O, I] (row-major, the
 * transformers layout): a decode step's projection. Each weight row is streamed once and dotted with every row of
 * x (x stays in L1), output rows split statically over the threads (the register tile: decode_ops.h). It replaced
 * oneDNN's GEMV for up to 16 rows because it read the same weights faster (kvbench/runtime/backends/cpu/linear.py;
 * figures: docs/benchmark-results.md). */
void gemv_f32(const float *W, const float *x, const float *b, float *y, int64_t O, int64_t I, int64_t M,
              int nthreads) {
#pragma omp parallel num_threads(nthreads) if (O * I >= 65536)
    gemv_team(W, x, I, b, y, O, O, I, M, 0);
}

void gate_up_silu_team(const float *W, const float *b, const float *x, int64_t x_ss, float *act, int64_t I,
                       int64_t E, int64_t M) {
    /* TILE_ROWS / 2 outputs at a time by dots_tile (their gate rows, then their up rows); one input row: dot_f32 */
    enum { P = TILE_ROWS / 2 };
    const int64_t tiled = E % VN == 0 && M > 1 ? I / P * P : 0;
#pragma omp for schedule(static) nowait
    for (int64_t o = 0; o < tiled; o += P) {
        const float *rows[TILE_ROWS];
        for (int r = 0; r < P; r++) {
            rows[r] = W + (o + r) * E;
            rows[P + r] = W + (I + o + r) * E;
        }
        const int has_next = o + 2 * P <= tiled;  /* the next tile: P gate rows and P up rows */
        const int64_t passes = (M + TILE_X - 1) / TILE_X, half = P * E * (int64_t)sizeof(float);
        for (int64_t m0 = 0; m0 < M; m0 += TILE_X) {
            const int nx = M - m0 < TILE_X ? (int)(M - m0) : TILE_X;
            float d[TILE_ROWS][TILE_X];  /* d[0 .. P-1]: gates o .. o+P-1; d[P ..]: their ups */
            prefetch_share_l2(has_next ? W + (o + P) * E : NULL, half, m0 / TILE_X, passes);
            prefetch_share_l2(has_next ? W + (I + o + P) * E : NULL, half, m0 / TILE_X, passes);
            dots_tile_rows(rows, x + m0 * x_ss, x_ss, E, nx, d);
            for (int m = 0; m < nx; m++) {
                for (int r = 0; r < P; r++) {
                    const float g = d[r][m] + (b ? b[o + r] : 0.0f);
                    const float u = d[P + r][m] + (b ? b[I + o + r] : 0.0f);
                    act[(m0 + m) * I + o + r] = g / (1.0f + expf(-g)) * u;
                }
            }
        }
    }
#pragma omp for schedule(static) nowait
    for (int64_t o = tiled; o < I; o++) {
        const float *wg = W + o * E, *wu = W + (I + o) * E;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * x_ss;
            const float g = dot_f32(wg, xm, E) + (b ? b[o] : 0.0f);
            const float u = dot_f32(wu, xm, E) + (b ? b[I + o] : 0.0f);
            act[m * I + o] = g / (1.0f + expf(-g)) * u;
        }
    }
    team_end();
}

static quant_matmul_fn quant_matmul_team = NULL;  /* set once the quantized kernels' library is loaded */
void set_quant_matmul(quant_matmul_fn fn) { quant_matmul_team = fn; }

void project_team(const projection *p, const float *x, int64_t x_ss, float *y, int64_t y_ss, int64_t I, int64_t M,
                  int accumulate) {
    if (p->n_parts == 1 && p->part[0].type == 0) {
        gemv_team((const float *)p->part[0].data, x, x_ss, p->bias, y, y_ss, p->part[0].rows, I, M, accumulate);
        return;
    }
    /* each part's rows: its own work-shared loop (no barrier), then one for them all; quant_matmul_team's -1 (a
     * type or shape it lacks) cannot occur: kernels.Projection.quantized takes only QuantMatrix parts (shape checked)
     * of the projection's input size */
    int64_t row = 0;
    for (int i = 0; i < p->n_parts; i++) {
        const projection_part *q = p->part + i;
        quant_matmul_team(q->isa, q->type, (const uint8_t *)q->data, q->row_bytes, q->rows, I, x, x_ss, M, y + row,
                          y_ss, p->bias ? p->bias + row : NULL, accumulate, q->act);
        row += q->rows;
    }
    team_end();
}

void gate_up_project_team(const projection *p, const float *x, int64_t x_ss, float *act, float *gu, int64_t I,
                          int64_t E, int64_t M) {
    if (p->n_parts == 1 && p->part[0].type == 0) {
        gate_up_silu_team((const float *)p->part[0].data, p->bias, x, x_ss, act, I, E, M);
        return;
    }
    project_team(p, x, x_ss, gu, 2 * I, E, M, 0);  /* gu [M, 2I]: gates, then ups */
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < M * I; item++) {  /* (row m, output o) */
        const int64_t m = item / I, o = item % I;
        const float g = gu[m * 2 * I + o], u = gu[m * 2 * I + I + o];
        act[item] = g / (1.0f + expf(-g)) * u;
    }
    team_end();
}

/* The index of the largest of x[0..n) as torch.argmax gives it: the first NaN if there is one, else the first
 * occurrence of the maximum (n >= 1). Two passes over the row, the second from L1/L2 and stopping at the hit. */
static int64_t argmax_row(const float *restrict x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    int64_t i = 0;
    for (; i + VN <= n; i += VN) {  /* whole vectors with no hit are skipped in one test each */
        int hit = 0;
        for (int k = 0; k < VN; k++) hit |= nan ? x[i + k] != x[i + k] : x[i + k] == m;
        if (hit) break;
    }
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;  /* not reached: some element is the maximum or NaN */
}

/* out[r] = argmax of row r of x [rows, n] (argmax_row): greedy sampling of a decode step's logits, in place of
 * torch's argmax, whose dispatch and parallel region cost more than the work after a step's weights have flushed
 * the caches (figures: docs/benchmark-results.md). */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}

/* floats per vector the kernels were built for (VN) */
int vector_width(void) { return VN; }
