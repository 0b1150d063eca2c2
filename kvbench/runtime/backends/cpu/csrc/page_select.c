/* Query-aware page retrieval inside the fused decode step (decode_layer.c), the C form of
 * kvbench/runtime/cache/page_retrieval.py's select_pages (tests/methods/test_quest.py compares the two):
 *
 *   bound[m, kh, g, j] = sum_d max(q_d * kmin[j, d], q_d * kmax[j, d])     per block j of table (m, kh), query head g
 *   each query head's top `pages` blocks (of the blocks the table holds), united per kv-head, compacted in table
 *   order into sel_tables[m, kh, :] with the tokens they hold in sel_lengths[m, kh]; with ps->per_head (the
 *   official rule, select_pages_per_head) each query head's own blocks into sel_tables[m, kh * G + g, :]
 *
 * Called by every thread of decode_layers_f32's region: three work-shared loops (bounds; per query head, its top blocks;
 * per table, their union), each ending at team_end's barrier.
 * The block summaries are kept up to date by decode_layers_f32's K/V write (page_summary_update). */
#include "decode_ops.h"

#define BOUND_BLOCKS 64  /* blocks per work item of the bound loop */
#define SUMMARY_PREFETCH 8  /* blocks ahead whose summaries the bound loop asks for */

void page_summary_update(uint16_t *summary, const float *k, int64_t row, int bs, int D) {
    uint16_t *mn = summary + (row / bs) * 2 * D, *mx = mn + D;
    const int first = row % bs == 0;  /* the block's first slot: its earlier contents belonged to whoever held the id */
    for (int d = 0; d < D; d++) {
        const uint16_t lo = float_to_half_directed(k[d], 1), hi = float_to_half_directed(k[d], 0);
        if (first || half_to_float(lo) < half_to_float(mn[d])) mn[d] = lo;
        if (first || half_to_float(hi) > half_to_float(mx[d])) mx[d] = hi;
    }
}

#define GROUP_SPECIALIZED 8  /* query heads per kv-head up to which the bound loop is unrolled */

/* The bounds of blocks s0, s1 ([2, D]: min, max) for the G query heads of a kv-head: out0[g * ostride],
 * out1[g * ostride]. qpn [G, 2, D] holds each head's q+ and q-. Each summary vector is loaded once for the whole
 * group (G a constant after inlining: the 2 G accumulators stay in registers). */
static inline __attribute__((always_inline)) void bounds2_group(const float *qpn, const uint16_t *s0, const uint16_t *s1,
                                                                 const int G, const int D, float *out0, float *out1,
                                                                 int64_t ostride) {
    vn a0[GROUP_SPECIALIZED], a1[GROUP_SPECIALIZED];
    for (int g = 0; g < G; g++) a0[g] = a1[g] = (vn){0};
    for (int c = 0; c < D; c += VN) {
        const vn mn0 = load_half_vn(s0 + c), mx0 = load_half_vn(s0 + D + c);
        const vn mn1 = load_half_vn(s1 + c), mx1 = load_half_vn(s1 + D + c);
        for (int g = 0; g < G; g++) {
            const vn qp = *(const vn *)(qpn + g * 2 * D + c), qn = *(const vn *)(qpn + g * 2 * D + D + c);
            a0[g] += qp * mx0;  /* two FMAs each (as a sum of products the compiler makes it mul, fma, add) */
            a0[g] += qn * mn0;
            a1[g] += qp * mx1;
            a1[g] += qn * mn1;
        }
    }
    int g = 0;
    for (; g + 1 < G; g += 2) {
        float o[4];
        hsum4(a0[g], a1[g], a0[g + 1], a1[g + 1], o);
        out0[g * ostride] = o[0], out1[g * ostride] = o[1];
        out0[(g + 1) * ostride] = o[2], out1[(g + 1) * ostride] = o[3];
    }
    if (g < G) {
        float o[4];
        hsum4(a0[g], a1[g], a0[g], a1[g], o);
        out0[g * ostride] = o[0], out1[g * ostride] = o[1];
    }
}

/* bounds2_group for a run of blocks j0..j1-1 of one table; out: [G, ostride] from column j0 */
static inline __attribute__((always_inline)) void bounds_run(const float *qpn, const uint16_t *summary,
                                                              const int32_t *table, int64_t tab_sj, int64_t j0,
                                                              int64_t j1, int64_t nb, const int G, const int D,
                                                              float *out, int64_t ostride) {
    for (int64_t j = j0; j < j1; j += 2) {  /* two blocks at a time (the last repeated past j1) */
        const int64_t jn = j + 1 < j1 ? j + 1 : j;
        const uint16_t *s0 = summary + (int64_t)table[j * tab_sj] * 2 * D;
        const uint16_t *s1 = summary + (int64_t)table[jn * tab_sj] * 2 * D;
        /* the hardware prefetcher does not follow a table's blocks through the pool: ask for the summaries
         * SUMMARY_PREFETCH blocks ahead */
        for (int64_t jp = j + SUMMARY_PREFETCH; jp < j + SUMMARY_PREFETCH + 2 && jp < nb; jp++) {
            const char *sp = (const char *)(summary + (int64_t)table[jp * tab_sj] * 2 * D);
            for (int64_t c = 0; c < (int64_t)sizeof(uint16_t) * 2 * D; c += 64) __builtin_prefetch(sp + c, 0, 3);
        }
        bounds2_group(qpn, s0, s1, G, D, out + j, out + jn, ostride);
    }
}

/* float -> uint32 with the same order (-0 taken as +0, so equal floats get equal keys); NaN not expected */
static inline uint32_t order_key(float v) {
    v += 0.0f;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

static inline int32_t count_at_least(const uint32_t *key, int64_t n, uint32_t t) {
    int32_t c = 0;
    for (int64_t j = 0; j < n; j++) c += key[j] >= t;  /* vectorized */
    return c;
}

/* Mark in chosen[0..n-1] the k largest of b[0..n-1] (1 <= k < n), ties at the k-th value taken lowest index first
 * (tests/methods/test_quest.py compares a brute-force top-k). The k-th largest is found by bisecting its order key
 * (key[] scratch, n entries): each probe counts the keys at or above a value, a vectorized pass without branches,
 * and the search stops as soon as a probe counts exactly k (a quickselect's data-dependent branches mispredict on
 * bounds like these). */
static void mark_top_k(const float *b, int64_t n, int64_t k, uint32_t *key, uint8_t *chosen) {
    uint32_t lo = UINT32_MAX, hi = 0;
    for (int64_t j = 0; j < n; j++) {
        key[j] = order_key(b[j]);
        lo = key[j] < lo ? key[j] : lo;
        hi = key[j] > hi ? key[j] : hi;
    }
    /* invariant: at least k keys >= lo, fewer than k keys >= top */
    uint64_t top = (uint64_t)hi + 1;
    uint32_t thr = lo;
    int exact = 0;
    while (top - lo > 1) {
        const uint32_t mid = (uint32_t)(lo + (top - lo) / 2);
        const int32_t c = count_at_least(key, n, mid);
        if (c == k) {  /* the k largest are the keys >= mid: the k-th is the least of them */
            uint32_t least = UINT32_MAX;
            for (int64_t j = 0; j < n; j++) least = key[j] >= mid && key[j] < least ? key[j] : least;
            thr = least;
            exact = 1;
            break;
        }
        if (c > k) lo = mid;
        else top = mid;
    }
    if (!exact) thr = lo;
    const int32_t at_least = count_at_least(key, n, thr);
    if (at_least == k) {  /* no tie to break */
        for (int64_t j = 0; j < n; j++) chosen[j] = key[j] >= thr;
        return;
    }
    int64_t ties = k - (thr == UINT32_MAX ? 0 : count_at_least(key, n, thr + 1));
    for (int64_t j = 0; j < n; j++) {
        const int take_tie = (key[j] == thr) & (ties > 0);
        chosen[j] = (key[j] > thr) | take_tie;
        ties -= take_tie;
    }
}

void page_select_team(const float *q, int64_t q_ss, const page_select *ps, const int32_t *tables, int64_t tab_ss,
                      int64_t tab_sh, int64_t tab_sj, const int64_t *lengths, int64_t len_ss, int64_t len_sh,
                      int M, int H, int G, int D, int bs, int pages, int64_t *sel_lengths, int64_t *kv_blocks)
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
        if (D % VN == 0 && G <= GROUP_SPECIALIZED) {
            float qpn[G * 2 * D] __attribute__((aligned(64)));  /* each query head's q+ and q- */
            for (int g = 0; g < G; g++)
                for (int d = 0; d < D; d++) {
                    const float v = q[m * q_ss + (kh * G + g) * D + d];
                    qpn[g * 2 * D + d] = v > 0.f ? v : 0.f;
                    qpn[g * 2 * D + D + d] = v > 0.f ? 0.f : v;
                }
            float *out = ps->bounds + r * 2 * G * MB;
            switch (G) {  /* G a constant in each copy */
#define BOUNDS_G(n) case n: bounds_run(qpn, ps->summary, table, tab_sj, j0, j1, nb, n, D, out, MB); break;
                BOUNDS_G(1) BOUNDS_G(2) BOUNDS_G(3) BOUNDS_G(4) BOUNDS_G(5) BOUNDS_G(6) BOUNDS_G(7) BOUNDS_G(8)
#undef BOUNDS_G
            }
            continue;
        }
        for (int64_t j = j0; j < j1; j++) {
            const uint16_t *mn = ps->summary + (int64_t)table[j * tab_sj] * 2 * D, *mx = mn + D;
            for (int g = 0; g < G; g++) {
                const float *qh = q + m * q_ss + (kh * G + g) * D;
                float s = 0.f;
                for (int d = 0; d < D; d++) {
                    const float a = qh[d] * half_to_float(mn[d]), b = qh[d] * half_to_float(mx[d]);
                    s += a > b ? a : b;
                }
                ps->bounds[(r * 2 * G + g) * MB + j] = s;
            }
        }
    }
    team_end();
    /* 2. per (table, query head): its top blocks, marked in chosen[r, g] */
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < rows * G; item++) {
        const int64_t r = item / G, g = item % G, m = r / H, kh = r % H;
        const int64_t nb = (lengths[m * len_ss + kh * len_sh] + bs - 1) / bs;
        const int64_t k = pages < nb ? pages : nb;
        uint8_t *chosen = ps->chosen + item * MB;
        if (k == nb) {  /* every block (or none) */
            memset(chosen, 1, (size_t)nb);
            continue;
        }
        mark_top_k(ps->bounds + (r * 2 * G + g) * MB, nb, k, (uint32_t *)(ps->bounds + (r * 2 * G + G + g) * MB),
                   chosen);
    }
    team_end();
    /* 3. per table: the union of its query heads' blocks, compacted in table order (per_head: per query head, its
     * own blocks, into table r * G + g) */
    const int64_t outs = ps->per_head ? rows * G : rows;
#pragma omp for schedule(static) nowait
    for (int64_t o = 0; o < outs; o++) {
        const int64_t r = ps->per_head ? o / G : o, m = r / H, kh = r % H;
        const int64_t len = lengths[m * len_ss + kh * len_sh], nb = (len + bs - 1) / bs;
        const int32_t *table = tables + m * tab_ss + kh * tab_sh;
        uint8_t *chosen = ps->chosen + (ps->per_head ? o : r * G) * MB;  /* union: query head 0's row collects it */
        if (!ps->per_head)
            for (int g = 1; g < G; g++)
                for (int64_t j = 0; j < nb; j++) chosen[j] |= chosen[g * MB + j];
        int32_t *out = ps->sel_tables + o * U;
        int64_t n = 0, tokens = 0;
        for (int64_t j = 0; j < nb; j++) {
            if (!chosen[j]) continue;
            out[n++] = table[j * tab_sj];
            const int64_t in_block = len - j * bs;
            tokens += in_block < bs ? in_block : bs;
        }
        for (int64_t j = n; j < U; j++) out[j] = 0;  /* the scratch block, as select_pages */
        sel_lengths[o] = tokens;  /* [M, H] or [M, H * G]: o = m * H + kh (* G + g) */
    }
    team_end();
    if (!ps->per_head || kv_blocks == NULL)
        return;
    /* 4. per_head: the blocks a kv-head's query heads read, each counted once (what the read figures count) */
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < rows; r++) {
        const int64_t m = r / H, kh = r % H, nb = (lengths[m * len_ss + kh * len_sh] + bs - 1) / bs;
        const uint8_t *chosen = ps->chosen + r * G * MB;
        int64_t n = 0;
        for (int64_t j = 0; j < nb; j++) {
            uint8_t any = 0;
            for (int g = 0; g < G; g++) any |= chosen[g * MB + j];
            n += any != 0;
        }
        kv_blocks[r] = n;
    }
    team_end();
}
