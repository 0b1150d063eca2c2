/* Query-aware page retrieval inside the fused decode step (decode_layer.c), the C form of
 * kvbench/runtime/cache/page_retrieval.py's select_pages (tests/methods/test_quest.py compares the two):
 *
 *   bound[m, kh, g, j] = sum_d max(q_d * kmin[j, d], q_d * kmax[j, d])     per block j of table (m, kh), query head g
 *   each query head's top `pages` blocks (of the blocks the table holds), united per kv-head, compacted in table
 *   order into sel_tables[m, kh, :] with the tokens they hold in sel_lengths[m, kh]
 *
 * Called by every thread of decode_layers_f32's region: two work-shared loops, each ending at team_end's barrier.
 * The block summaries are kept up to date by decode_layers_f32's K/V write (page_summary_update). */
#include "decode_ops.h"

#define BOUND_BLOCKS 64  /* blocks per work item of the bound loop */

void page_summary_update(float *summary, const float *k, int64_t row, int bs, int D) {
    float *mn = summary + (row / bs) * 2 * D, *mx = mn + D;
    if (row % bs == 0) {  /* the block's first slot: its earlier contents belonged to whoever held the id */
        memcpy(mn, k, sizeof(float) * D);
        memcpy(mx, k, sizeof(float) * D);
        return;
    }
    for (int d = 0; d < D; d++) {
        mn[d] = k[d] < mn[d] ? k[d] : mn[d];
        mx[d] = k[d] > mx[d] ? k[d] : mx[d];
    }
}

/* The bounds of one query head row qh over the summaries of four blocks s0..s3 ([2, D]: min, max), as
 * sum_d max(q_d min_d, q_d max_d) = q+ . max + q- . min (max >= min), vectorized; D a multiple of VN. */
static inline void bound4(const float *qh, const float *s0, const float *s1, const float *s2, const float *s3,
                          const int D, float out[4]) {
    vn a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    const vn zero = {0};
    for (int c = 0; c < D; c += VN) {
        const vn qv = *(const vn *)(qh + c);
        const vn qp = (vn)((vni)qv & (qv > zero)), qn = qv - qp;  /* q+ and q- */
        a0 += qp * *(const vn *)(s0 + D + c) + qn * *(const vn *)(s0 + c);
        a1 += qp * *(const vn *)(s1 + D + c) + qn * *(const vn *)(s1 + c);
        a2 += qp * *(const vn *)(s2 + D + c) + qn * *(const vn *)(s2 + c);
        a3 += qp * *(const vn *)(s3 + D + c) + qn * *(const vn *)(s3 + c);
    }
    hsum4(a0, a1, a2, a3, out);
}

/* The k-th largest of v[0..n-1] (1 <= k <= n); v is reordered. */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                const float t = v[i]; v[i] = v[j]; v[j] = t;
                i++; j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return v[want];
    }
    return v[want];
}

void page_select_team(const float *q, int64_t q_ss, const page_select *ps, const int32_t *tables, int64_t tab_ss,
                      int64_t tab_sh, int64_t tab_sj, const int64_t *lengths, int64_t len_ss, int64_t len_sh,
                      int M, int H, int G, int D, int bs, int pages, int64_t *sel_lengths)
{
    const int64_t MB = ps->MB, U = ps->U, rows = (int64_t)M * H;
    const int64_t per_table = (MB + BOUND_BLOCKS - 1) / BOUND_BLOCKS;
    /* 1. the bounds, (table, run of blocks) per work item */
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < rows * per_table; item++) {
        const int64_t r = item / per_table, m = r / H, kh = r % H;
        const int64_t nb = (lengths[m * len_ss + kh * len_sh] + bs - 1) / bs;
        const int64_t j0 = (item % per_table) * BOUND_BLOCKS;
        const int64_t j1 = j0 + BOUND_BLOCKS < nb ? j0 + BOUND_BLOCKS : nb;
        const int32_t *table = tables + m * tab_ss + kh * tab_sh;
        if (D % VN == 0) {
            for (int64_t j = j0; j < j1; j += 4) {  /* four blocks at a time (the last repeated past j1) */
                const float *s[4];
                for (int i = 0; i < 4; i++) {
                    const int64_t jj = j + i < j1 ? j + i : j1 - 1;
                    s[i] = ps->summary + (int64_t)table[jj * tab_sj] * 2 * D;
                }
                for (int g = 0; g < G; g++) {
                    float out[4];
                    bound4(q + m * q_ss + (kh * G + g) * D, s[0], s[1], s[2], s[3], D, out);
                    float *b = ps->bounds + (r * (G + 1) + g) * MB + j;
                    for (int i = 0; i < 4 && j + i < j1; i++) b[i] = out[i];
                }
            }
            continue;
        }
        for (int64_t j = j0; j < j1; j++) {
            const float *mn = ps->summary + (int64_t)table[j * tab_sj] * 2 * D, *mx = mn + D;
            for (int g = 0; g < G; g++) {
                const float *qh = q + m * q_ss + (kh * G + g) * D;
                float s = 0.f;
                for (int d = 0; d < D; d++) {
                    const float a = qh[d] * mn[d], b = qh[d] * mx[d];
                    s += a > b ? a : b;
                }
                ps->bounds[(r * (G + 1) + g) * MB + j] = s;
            }
        }
    }
    team_end();
    /* 2. per table: each query head's top blocks, their union, compacted in table order */
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < rows; r++) {
        const int64_t m = r / H, kh = r % H;
        const int64_t len = lengths[m * len_ss + kh * len_sh], nb = (len + bs - 1) / bs;
        const int64_t k = pages < nb ? pages : nb;
        const int32_t *table = tables + m * tab_ss + kh * tab_sh;
        uint8_t *chosen = ps->chosen + r * MB;
        float *scratch = ps->bounds + (r * (G + 1) + G) * MB;
        memset(chosen, 0, (size_t)nb);
        for (int g = 0; g < G && k > 0; g++) {
            const float *b = ps->bounds + (r * (G + 1) + g) * MB;
            if (k == nb) {
                memset(chosen, 1, (size_t)nb);
                break;
            }
            memcpy(scratch, b, sizeof(float) * nb);
            const float thr = kth_largest(scratch, nb, k);
            int64_t above = 0;
            for (int64_t j = 0; j < nb; j++) above += b[j] > thr;
            int64_t ties = k - above;  /* blocks equal to the threshold taken, lowest first */
            for (int64_t j = 0; j < nb; j++) {
                if (b[j] > thr) chosen[j] = 1;
                else if (b[j] == thr && ties > 0) { chosen[j] = 1; ties--; }
            }
        }
        int32_t *out = ps->sel_tables + r * U;
        int64_t n = 0, tokens = 0;
        for (int64_t j = 0; j < nb; j++) {
            if (!chosen[j]) continue;
            out[n++] = table[j * tab_sj];
            const int64_t in_block = len - j * bs;
            tokens += in_block < bs ? in_block : bs;
        }
        for (int64_t j = n; j < U; j++) out[j] = 0;  /* the scratch block, as select_pages */
        sel_lengths[m * H + kh] = tokens;
    }
    team_end();
}
