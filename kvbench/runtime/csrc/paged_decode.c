/* Paged decode attention on CPU: one new query token per sequence against its cached K/V, read in
 * place through the block tables (no gather, no copy of cached K/V).
 *
 * Semantics are those of kvbench.runtime.attention.paged_attention_torch with Q == 1 and no mask
 * beyond each table's length (every cached key precedes the query in plain decoding):
 *
 *   q        [S, Hq, D]            fp32, contiguous; Hq = H * G (GQA: query head h*G+g reads kv head h)
 *   k_pool   [N, bs, D]            fp32, contiguous (same for v_pool)
 *   tables   [S, H, MB] int32      any strides (given in elements)
 *   lengths  [S, H] int64          any strides
 *   out      [S, Hq, D]            fp32, contiguous
 *   key_scores [S, H, T] or NULL   fp32, contiguous: probability each key slot received, summed
 *                                  over the G query heads of its kv head (zeros past a length)
 *   scores   [S, H, G, T]          fp32 scratch; T >= every length, a multiple of chunk_slots
 *   partials [S, H, n_chunks, G, D + 2] fp32 scratch (acc[D], max, sum per query head)
 *
 * Work is split into (sequence, kv-head, chunk of chunk_slots keys) items so both cores stay busy
 * even for one sequence; a second pass merges the chunks (flash-decoding style). Heads with no
 * keys give zeros.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 64

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

void paged_decode_attention_f32(
    const float *q, const float *k_pool, const float *v_pool,
    const int32_t *tables, int64_t tab_ss, int64_t tab_sh, int64_t tab_sj,
    const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    int S, int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    float *out, float *key_scores, float *scores, float *partials, int nthreads)
{
    const int64_t n_chunks = T / chunk_slots;
    const int64_t n_items = (int64_t)S * H * n_chunks;
    const int64_t part_stride = (int64_t)G * (D + 2);

#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; item++) {
        const int64_t c = item % n_chunks;
        const int64_t sh = item / n_chunks;
        const int s = (int)(sh / H), h = (int)(sh % H);
        const int64_t len = lengths[s * len_ss + h * len_sh];
        float *part = partials + (sh * n_chunks + c) * part_stride;
        float *sc = scores + sh * G * T;  /* [G, T] */
        const int64_t t0 = c * chunk_slots;
        const int64_t t1 = len < t0 + chunk_slots ? len : t0 + chunk_slots;
        for (int g = 0; g < G; g++) {  /* empty chunk: max -inf, sum 0 */
            memset(part + g * (D + 2), 0, sizeof(float) * D);
            part[g * (D + 2) + D] = -INFINITY;
            part[g * (D + 2) + D + 1] = 0.0f;
        }
        if (t1 <= t0) continue;
        const float *qh = q + ((int64_t)s * H * G + (int64_t)h * G) * D;
        const int32_t *table = tables + s * tab_ss + h * tab_sh;
        float m[MAX_G];
        for (int g = 0; g < G; g++) m[g] = -INFINITY;
        for (int64_t t = t0; t < t1; t++) {  /* scores and running max */
            const float *k = k_pool + ((int64_t)table[(t / bs) * tab_sj] * bs + t % bs) * D;
            for (int g = 0; g < G; g++) {
                const float x = dot(qh + g * D, k, D) * scale;
                sc[g * T + t] = x;
                if (x > m[g]) m[g] = x;
            }
        }
        for (int g = 0; g < G; g++) {  /* exp in place, sum */
            float l = 0.0f;
            float *row = sc + g * T;
            for (int64_t t = t0; t < t1; t++) {
                row[t] = expf(row[t] - m[g]);
                l += row[t];
            }
            part[g * (D + 2) + D] = m[g];
            part[g * (D + 2) + D + 1] = l;
        }
        for (int64_t t = t0; t < t1; t++) {  /* acc = sum_t p_t v_t */
            const float *v = v_pool + ((int64_t)table[(t / bs) * tab_sj] * bs + t % bs) * D;
            for (int g = 0; g < G; g++) {
                const float p = sc[g * T + t];
                float *acc = part + g * (D + 2);
#pragma omp simd
                for (int d = 0; d < D; d++) acc[d] += p * v[d];
            }
        }
    }

    /* merge the chunks of each (sequence, kv-head); normalise key scores with the final max/sum */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t sh = 0; sh < (int64_t)S * H; sh++) {
        const int s = (int)(sh / H), h = (int)(sh % H);
        const int64_t len = lengths[s * len_ss + h * len_sh];
        const float *part = partials + sh * n_chunks * part_stride;
        float w[MAX_G];  /* per query head: 1 / total sum, relative to the global max */
        float gm[MAX_G];
        for (int g = 0; g < G; g++) {
            float M = -INFINITY;
            for (int64_t c = 0; c < n_chunks; c++) {
                const float mc = part[c * part_stride + g * (D + 2) + D];
                if (mc > M) M = mc;
            }
            float *o = out + ((int64_t)s * H * G + (int64_t)h * G + g) * D;
            memset(o, 0, sizeof(float) * D);
            gm[g] = M;
            w[g] = 0.0f;
            if (M == -INFINITY) continue;
            float L = 0.0f;
            for (int64_t c = 0; c < n_chunks; c++) {
                const float *pc = part + c * part_stride + g * (D + 2);
                if (pc[D + 1] == 0.0f) continue;
                const float f = expf(pc[D] - M);
                L += pc[D + 1] * f;
#pragma omp simd
                for (int d = 0; d < D; d++) o[d] += pc[d] * f;
            }
            const float inv = 1.0f / L;
            for (int d = 0; d < D; d++) o[d] *= inv;
            w[g] = inv;
        }
        if (key_scores == NULL) continue;
        float *ks = key_scores + sh * T;
        const float *sc = scores + sh * G * T;
        memset(ks, 0, sizeof(float) * T);
        for (int64_t c = 0; c < n_chunks; c++) {
            const int64_t t0 = c * chunk_slots;
            const int64_t t1 = len < t0 + chunk_slots ? len : t0 + chunk_slots;
            for (int g = 0; g < G; g++) {
                if (w[g] == 0.0f || t1 <= t0) continue;
                const float f = expf(part[c * part_stride + g * (D + 2) + D] - gm[g]) * w[g];
                const float *row = sc + g * T;
                for (int64_t t = t0; t < t1; t++) ks[t] += row[t] * f;
            }
        }
    }
}
