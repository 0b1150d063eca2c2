/* Paged decode attention on CPU: one new query token per sequence against its cached K/V, read in
 * place through the block tables (no gather, no copy of cached K/V).
 *
 * Semantics are those of kvbench.runtime.backends.torch.attention.paged_attention_torch with Q == 1 and no mask
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
#include "decode_common.h"

/* One work item: keys [t0, t1) of one (sequence, kv-head) table for its G query heads.
 * Walks the table one block-run at a time (rows of a run are contiguous in the pool); the G
 * query rows are reused from registers, the run's K/V rows from L1. Writes exp(score - max) into
 * sc[g * T + t] and (acc[D], max, sum) per query head into part. */
static inline void attend_chunk(const float *restrict qh, const float *restrict k_pool, const float *restrict v_pool,
                                const int32_t *table, int64_t tab_sj, int bs, int G, const int D, float scale,
                                int64_t t0, int64_t t1, int64_t T, float *restrict sc, float *restrict part)
{
    float m[MAX_G];
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    for (int64_t t = t0; t < t1;) {  /* scores and running max */
        const int64_t end = t - t % bs + bs < t1 ? t - t % bs + bs : t1;
        const float *k = k_pool + ((int64_t)table[(t / bs) * tab_sj] * bs + t % bs) * D;
        for (int g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            float *row = sc + g * T;
            float mg = m[g];
            const int64_t n = end - t;
            int64_t j = 0;
            if (D % 16 == 0) {
                for (; j + 4 <= n; j += 4) {  /* four keys at once, their sums reduced together */
                    float x[4];
                    dot4(qg, k + j * D, D, x);
                    for (int i = 0; i < 4; i++) {
                        x[i] *= scale;
                        row[t + j + i] = x[i];
                        mg = x[i] > mg ? x[i] : mg;
                    }
                }
            }
            for (; j < n; j++) {
                float x = 0.0f;
#pragma omp simd reduction(+ : x)
                for (int d = 0; d < D; d++) x += qg[d] * k[j * D + d];
                x *= scale;
                row[t + j] = x;
                mg = x > mg ? x : mg;
            }
            m[g] = mg;
        }
        t = end;
    }
    exp_and_sum(sc, T, G, D, t0, t1, m, part);
    for (int g = 0; g < G; g++) {  /* acc = sum_t p_t v_t, accumulated in registers per query head */
        float acc[D];
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        const float *row = sc + g * T;
        for (int64_t t = t0; t < t1;) {
            const int64_t end = t - t % bs + bs < t1 ? t - t % bs + bs : t1;
            const float *v = v_pool + ((int64_t)table[(t / bs) * tab_sj] * bs + t % bs) * D;
            for (int64_t j = 0; j < end - t; j++) {
                const float p = row[t + j];
#pragma omp simd
                for (int d = 0; d < D; d++) acc[d] += p * v[j * D + d];
            }
            t = end;
        }
        memcpy(part + g * (D + 2), acc, sizeof(float) * D);
    }
}

/* The rows of the block holding slot t of a table, or NULL when t >= t1 (prefetch_rows_l2 asks for them while the
 * block before is worked on). */
static inline const float *block_after(const float *pool, const int32_t *table, int64_t tab_sj, int bs, int D,
                                       int64_t t, int64_t t1)
{
    return t < t1 ? pool + (int64_t)table[(t / bs) * tab_sj] * bs * D : NULL;
}

/* attend_chunk with the head dim (64 or 128) and the group size (1..8) as compile-time constants (see
 * attend_chunk_fast): each K and V row is loaded once for the whole group, the group's accumulators
 * stay in registers. Same arithmetic, in the same order, as attend_chunk. */
static inline __attribute__((always_inline)) void attend_chunk_grouped(
    const float *restrict qh, const float *restrict k_pool, const float *restrict v_pool,
    const int32_t *table, int64_t tab_sj, int bs, const int G, const int D, float scale,
    int64_t t0, int64_t t1, int64_t T, float *restrict sc, float *restrict part)
{
    float m[GROUP_MAX];
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    for (int64_t t = t0; t < t1;) {
        const int64_t end = t - t % bs + bs < t1 ? t - t % bs + bs : t1;
        const float *k = k_pool + ((int64_t)table[(t / bs) * tab_sj] * bs + t % bs) * D;
        score_rows(qh, k, end - t, G, D, scale, sc + t, T, m, block_after(k_pool, table, tab_sj, bs, D, end, t1));
        t = end;
    }
    prefetch_rows_l2(block_after(v_pool, table, tab_sj, bs, D, t0, t1), 0, bs, D);  /* while the exps are computed */
    exp_and_sum(sc, T, G, D, t0, t1, m, part);
    vn acc[GROUP_MAX][128 / VN];  /* acc = sum_t p_t v_t per query head (D <= 128) */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / VN; c++) acc[g][c] = (vn){0};
    for (int64_t t = t0; t < t1;) {
        const int64_t end = t - t % bs + bs < t1 ? t - t % bs + bs : t1;
        const float *v = v_pool + ((int64_t)table[(t / bs) * tab_sj] * bs + t % bs) * D;
        accumulate_rows(v, end - t, G, D, sc + t, T, acc, block_after(v_pool, table, tab_sj, bs, D, end, t1));
        t = end;
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / VN; c++) memcpy(part + g * (D + 2) + c * VN, &acc[g][c], sizeof(vn));
}
#define GROUPED_CASE(GG)                                                                                   \
    case GG:                                                                                               \
        if (D == 64)                                                                                       \
            attend_chunk_grouped(qh, k_pool, v_pool, table, tab_sj, bs, GG, 64, scale, t0, t1, T, sc, part);  \
        else                                                                                               \
            attend_chunk_grouped(qh, k_pool, v_pool, table, tab_sj, bs, GG, 128, scale, t0, t1, T, sc, part); \
        return 1;

/* the grouped kernel for head dims 64 / 128 and groups of 1..8 query heads; 0 when it does not apply */
static int attend_chunk_fast(const float *qh, const float *k_pool, const float *v_pool, const int32_t *table,
                             int64_t tab_sj, int bs, int G, int D, float scale, int64_t t0, int64_t t1, int64_t T,
                             float *sc, float *part)
{
    if (D != 64 && D != 128) return 0;
    switch (G) {
        GROUPED_CASE(1) GROUPED_CASE(2) GROUPED_CASE(3) GROUPED_CASE(4)
        GROUPED_CASE(5) GROUPED_CASE(6) GROUPED_CASE(7) GROUPED_CASE(8)
        default: return 0;
    }
}

void paged_decode_attention_team(
    const float *q, int64_t q_ss, const float *k_pool, const float *v_pool,
    const int32_t *tables, int64_t tab_ss, int64_t tab_sh, int64_t tab_sj,
    const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    int S, int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    float *out, float *key_scores, float *scores, float *partials)
{
    const int64_t n_chunks = T / chunk_slots;
    const int64_t n_items = (int64_t)S * H * n_chunks;

#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < n_items; item++) {
        work_item w;
        if (!work_item_at(item, n_chunks, chunk_slots, H, G, D, T, q, q_ss, tables, tab_ss, tab_sh, lengths, len_ss,
                          len_sh, scores, partials, &w))
            continue;
        if (attend_chunk_fast(w.qh, k_pool, v_pool, w.table, tab_sj, bs, G, D, scale, w.t0, w.t1, T, w.sc, w.part))
            continue;
        /* constant head dims let the compiler keep a query row and an accumulator in registers */
        if (D == 64)
            attend_chunk(w.qh, k_pool, v_pool, w.table, tab_sj, bs, G, 64, scale, w.t0, w.t1, T, w.sc, w.part);
        else if (D == 128)
            attend_chunk(w.qh, k_pool, v_pool, w.table, tab_sj, bs, G, 128, scale, w.t0, w.t1, T, w.sc, w.part);
        else
            attend_chunk(w.qh, k_pool, v_pool, w.table, tab_sj, bs, G, D, scale, w.t0, w.t1, T, w.sc, w.part);
    }
    team_end();
    merge_chunks(lengths, len_ss, len_sh, S, H, G, D, T, chunk_slots, out, key_scores, scores, partials);
}

/* One parallel region: the chunks, then their merge. */
void paged_decode_attention_f32(
    const float *q, const float *k_pool, const float *v_pool,
    const int32_t *tables, int64_t tab_ss, int64_t tab_sh, int64_t tab_sj,
    const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    int S, int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    float *out, float *key_scores, float *scores, float *partials, int nthreads)
{
#pragma omp parallel num_threads(nthreads)
    paged_decode_attention_team(q, (int64_t)H * G * D, k_pool, v_pool, tables, tab_ss, tab_sh, tab_sj, lengths,
                                len_ss, len_sh, S, H, G, D, bs, scale, T, chunk_slots, out, key_scores, scores,
                                partials);
}
