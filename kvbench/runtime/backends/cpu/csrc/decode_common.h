/* Helpers shared by the CPU decode kernels (paged_decode.c, codec_decode.c, decode_ops.c): native float vectors,
 * horizontal sums, a vectorizable exp, and the flash-decoding merge of per-chunk partial results. */
#ifndef KVBENCH_DECODE_COMMON_H
#define KVBENCH_DECODE_COMMON_H
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 64

/* The barrier that ends each work-shared loop of the kernels (`team_end`). Inside decode_layers_f32's parallel
 * region it is a barrier of our own, which spins, then polls with sched_yield, and never sleeps. libgomp's barrier,
 * under kvbench's GOMP_SPINCOUNT=1000 (kvbench/runtime/backends/cpu/threads.py), puts a thread that waits more
 * than a few microseconds to sleep, and on a VM the sleeping vCPU takes tens of microseconds to wake: a decode
 * step has eight barriers per layer, 240 for SmolLM2. A yielding waiter leaves its core to any other runnable
 * thread, so a competing process still gets the core (the reason for the short spin); under load StepThreads
 * (threads.py) also moves a step to one thread, where the barrier returns at once. Outside that region (the
 * `_f32` entry points each open their own) it is libgomp's `omp barrier`. */
typedef struct {
    atomic_int arrived;  /* threads at the current barrier */
    atomic_int generation;  /* barriers completed */
    int nthreads;
} team_sync;
extern _Thread_local team_sync *current_team_sync;  /* this thread's team, set for decode_layers_f32's region */
#define TEAM_SPIN_PAUSES 2000  /* pause instructions before a waiter starts yielding */

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline void team_end(void) {
    team_sync *t = current_team_sync;
    if (t == NULL) {
#pragma omp barrier
        return;
    }
    if (t->nthreads == 1) return;
    const int gen = atomic_load_explicit(&t->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) == t->nthreads - 1) {
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&t->generation, gen + 1, memory_order_release);  /* publishes the reset too */
        return;
    }
    for (int spins = 0; atomic_load_explicit(&t->generation, memory_order_acquire) == gen;) {
        if (spins < TEAM_SPIN_PAUSES) {
            cpu_pause();
            spins++;
        } else {
            sched_yield();
        }
    }
}

/* One native vector register of floats, VN lanes (GCC/Clang vector extensions): 16 with AVX-512, else 8. A 64-byte
 * vector on an AVX2-only machine is lowered through stack spills by GCC, which made the GEMV and decode attention
 * markedly slower there (figures: docs/benchmark-results.md). */
#if defined(KVBENCH_VN)
#define VN KVBENCH_VN /* 8 or 16, set by KVBENCH_CPU_KERNEL_VECTOR (kvbench/runtime/backends/cpu/kernels.py) */
#elif defined(__AVX512F__)
#define VN 16
#else
#define VN 8
#endif
typedef float vn __attribute__((vector_size(VN * 4), aligned(4)));
typedef int32_t vni __attribute__((vector_size(VN * 4)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vni){__VA_ARGS__})
#endif

/* the four horizontal sums of a0..a3, reduced together (a third of the shuffles of four separate sums) */
static inline void hsum4(vn a0, vn a1, vn a2, vn a3, float out[4]) {
#if VN == 16
    const vn s01 = SHUFFLE(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                 + SHUFFLE(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vn s23 = SHUFFLE(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                 + SHUFFLE(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vn t = SHUFFLE(s01, s23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + SHUFFLE(s01, s23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vn u = t + SHUFFLE(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const vn w = u + SHUFFLE(u, u, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = w[0];
    out[1] = w[4];
    out[2] = w[8];
    out[3] = w[12];
#else
    const vn s01 = SHUFFLE(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const vn s23 = SHUFFLE(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    const vn t = SHUFFLE(s01, s23, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(s01, s23, 2, 3, 10, 11, 6, 7, 14, 15);
    const vn u = t + SHUFFLE(t, t, 1, 0, 3, 2, 5, 4, 7, 6);  /* lanes 0, 4, 2, 6: a0, a1, a2, a3 */
    out[0] = u[0];
    out[1] = u[4];
    out[2] = u[2];
    out[3] = u[6];
#endif
}

/* dot products of one query row with four consecutive key rows; D a multiple of VN */
static inline void dot4(const float *q, const float *k, const int D, float out[4]) {
    vn a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int c = 0; c < D; c += VN) {
        const vn qv = *(const vn *)(q + c);
        a0 += qv * *(const vn *)(k + c);
        a1 += qv * *(const vn *)(k + D + c);
        a2 += qv * *(const vn *)(k + 2 * D + c);
        a3 += qv * *(const vn *)(k + 3 * D + c);
    }
    hsum4(a0, a1, a2, a3, out);
}

/* exp for x <= 0 (scores minus their running max), vectorizable: Cephes' expf polynomial, ~1 ulp */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

/* unaligned vector loads and stores (a memcpy through the stack stalls store forwarding at every load) */
typedef float vn_unaligned __attribute__((vector_size(VN * 4), aligned(4)));
static inline vn load_vn(const float *p) { return *(const vn_unaligned *)p; }
static inline void store_vn(float *p, vn x) { *(vn_unaligned *)p = x; }

static inline vn select_vn(vni mask, vn a, vn b) { return (vn)(((vni)a & mask) | ((vni)b & ~mask)); }

/* the largest lane and the sum of the lanes, by halving shuffles: log2(VN) dependent steps instead of VN */
static inline vn max_vn(vn a, vn b) { return select_vn(a > b, a, b); }
static inline float max_lanes(vn x) {
#if VN == 16
    x = max_vn(x, SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = max_vn(x, SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = max_vn(x, SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = max_vn(x, SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
    x = max_vn(x, SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
    x = max_vn(x, SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
    x = max_vn(x, SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
    return x[0];
}
static inline float sum_lanes(vn x) {
#if VN == 16
    x += SHUFFLE(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    x += SHUFFLE(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += SHUFFLE(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x += SHUFFLE(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    return x[0];
}

/* exp_nonpos (decode_common.h: Cephes' expf polynomial for x <= 0) on a whole vector: GCC does not vectorize the
 * scalar one inside these loops */
static inline vn exp_nonpos_vn(vn x) {
    const vn lo = (vn){0} - 87.0f;
    x = select_vn(x < lo, lo, x);
    const vn t = x * 1.44269504088896341f + 0.5f;
    vni ni = __builtin_convertvector(t, vni);  /* toward zero: one less where that rounded up (t < 0) */
    ni += (vni)(__builtin_convertvector(ni, vn) > t);
    const vn n = __builtin_convertvector(ni, vn);
    const vn r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vn p = (vn){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vn)((ni + 127) << 23);
}

/* Scores of keys [t0, t1) for each of G query heads (rows of sc, stride T) become exp(score - m[g])
 * in place; their max and sum go to part's (max, sum) slots after each head's D accumulators. Whole vectors
 * (exp_nonpos_vn; the last partial one through a padded copy, so every score takes the same arithmetic). */
static inline void exp_and_sum(float *restrict sc, int64_t T, int G, int D, int64_t t0, int64_t t1,
                               const float *m, float *restrict part)
{
    for (int g = 0; g < G; g++) {
        float *row = sc + g * T;
        const float mg = m[g];
        vn acc = {0};
        int64_t t = t0;
        for (; t + VN <= t1; t += VN) {
            const vn e = exp_nonpos_vn(load_vn(row + t) - mg);
            store_vn(row + t, e);
            acc += e;
        }
        if (t < t1) {
            float tail[VN];
            const int n = (int)(t1 - t);
            for (int k = 0; k < VN; k++) tail[k] = k < n ? row[t + k] - mg : -INFINITY;
            vn e = exp_nonpos_vn(load_vn(tail));
            for (int k = n; k < VN; k++) e[k] = 0.0f;  /* exp_nonpos_vn clamps -inf to e^-87 */
            for (int k = 0; k < n; k++) row[t + k] = e[k];
            acc += e;
        }
        part[g * (D + 2) + D] = mg;
        part[g * (D + 2) + D + 1] = sum_lanes(acc);
    }
}

#define GROUP_MAX 8  /* query heads per kv-head the register-blocked paths take */

/* The scores of four rows from their accumulators a[g][0..3] (one per row): sc_t[g * T + i] = (sum of a[g][i] +
 * bias[g]) * scale for the first `rows` rows (bias NULL: none), and m[g] raised to their maximum. */
static inline __attribute__((always_inline)) void store_scores4(vn a[][4], const int G, const float *bias,
                                                                int rows, float scale, float *restrict sc_t,
                                                                int64_t T, float *restrict m)
{
    for (int g = 0; g < G; g++) {
        float x[4];
        hsum4(a[g][0], a[g][1], a[g][2], a[g][3], x);
        for (int i = 0; i < rows; i++) {
            const float v = (bias ? x[i] + bias[g] : x[i]) * scale;
            sc_t[g * T + i] = v;
            m[g] = v > m[g] ? v : m[g];
        }
    }
}

/* Ask for rows [j, j + rows) of `next` (rows of D floats) into L2, one prefetch per cache line; nothing when next is
 * NULL. The decode kernels call it while they work on row j of a block with `next` the next block of the table, so
 * the next block arrives spread over the current one: blocks sit anywhere in the pool, where the hardware
 * prefetcher cannot follow. This read K/V faster than asking for the whole next block into L1 at the start of each
 * block, or than no software prefetch at all (figures: docs/benchmark-results.md). */
static inline __attribute__((always_inline)) void prefetch_rows_l2(const float *next, int64_t j, int rows,
                                                                   const int D) {
    if (next == NULL) return;
    for (int i = 0; i < rows * D; i += 16) __builtin_prefetch(next + j * D + i, 0, 2);
}

/* Scores of n consecutive K rows k [n, D] for the G query heads qh [G, D]: sc_t[g * T + j] = scale * (q_g . k_j),
 * and m[g] raised to their maximum. Four rows at a time, each row loaded once for the whole group, the sums of the
 * four reduced together, the same rows of `next` prefetched (prefetch_rows_l2; NULL: none). G <= GROUP_MAX, D a
 * multiple of VN; inlined with G and D constant where it matters. */
static inline __attribute__((always_inline)) void score_rows(const float *restrict qh, const float *restrict k,
                                                             int64_t n, const int G, const int D, float scale,
                                                             float *restrict sc_t, int64_t T, float *restrict m,
                                                             const float *next)
{
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch_rows_l2(next, j, 4, D);
        vn a[GROUP_MAX][4];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) a[g][i] = (vn){0};
        const float *kj = k + j * D;
        for (int c = 0; c < D; c += VN) {
            const vn k0 = *(const vn *)(kj + c), k1 = *(const vn *)(kj + D + c);
            const vn k2 = *(const vn *)(kj + 2 * D + c), k3 = *(const vn *)(kj + 3 * D + c);
            for (int g = 0; g < G; g++) {
                const vn qv = *(const vn *)(qh + g * D + c);
                a[g][0] += qv * k0;
                a[g][1] += qv * k1;
                a[g][2] += qv * k2;
                a[g][3] += qv * k3;
            }
        }
        for (int g = 0; g < G; g++) {  /* store_scores4 inlined by hand: calling it here measured slower */
            float x[4];
            hsum4(a[g][0], a[g][1], a[g][2], a[g][3], x);
            float *row = sc_t + g * T + j;
            for (int i = 0; i < 4; i++) {
                row[i] = x[i] * scale;
                m[g] = row[i] > m[g] ? row[i] : m[g];
            }
        }
    }
    for (; j < n; j++)
        for (int g = 0; g < G; g++) {
            float x = 0.0f;
            for (int d = 0; d < D; d++) x += qh[g * D + d] * k[j * D + d];
            sc_t[g * T + j] = x * scale;
            m[g] = x * scale > m[g] ? x * scale : m[g];
        }
}

/* acc[g] += sum_j p[g, j] * v_j over n consecutive V rows v [n, D], p[g, j] = sc_t[g * T + j]; acc [G][D / VN];
 * the same rows of `next` prefetched (prefetch_rows_l2; NULL: none) */
static inline __attribute__((always_inline)) void accumulate_rows(const float *restrict v, int64_t n, const int G,
                                                                  const int D, const float *restrict sc_t, int64_t T,
                                                                  vn acc[][128 / VN], const float *next)
{
    for (int64_t j = 0; j < n; j++) {
        prefetch_rows_l2(next, j, 1, D);
        for (int c = 0; c < D / VN; c++) {
            const vn vv = *(const vn *)(v + j * D + c * VN);
            for (int g = 0; g < G; g++) acc[g][c] += sc_t[g * T + j] * vv;
        }
    }
}

/* a chunk with no keys: zero accumulators, max -inf, sum 0 */
static inline void empty_partial(float *part, int G, int D) {
    for (int g = 0; g < G; g++) {
        memset(part + g * (D + 2), 0, sizeof(float) * D);
        part[g * (D + 2) + D] = -INFINITY;
        part[g * (D + 2) + D + 1] = 0.0f;
    }
}

/* One work item of the decode kernels: keys [t0, t1) of one (sequence, kv-head) table, with that table's query rows
 * qh [G, D] (sequence s's rows start at q + s * q_ss), block ids (table, stride tab_sj), scores sc [G, T] and this
 * chunk's partial (acc[D], max, sum per query head). Items run chunk-fastest: item = (s * H + h) * n_chunks + chunk. */
typedef struct {
    int64_t t0, t1;
    const float *qh;
    const int32_t *table;
    float *sc, *part;
} work_item;

/* Fill *w for `item`; when its chunk holds no keys, write the empty partial and return 0. */
static inline int work_item_at(int64_t item, int64_t n_chunks, int chunk_slots, int H, int G, int D, int64_t T,
                               const float *q, int64_t q_ss, const int32_t *tables, int64_t tab_ss, int64_t tab_sh,
                               const int64_t *lengths, int64_t len_ss, int64_t len_sh, float *scores,
                               float *partials, work_item *w)
{
    const int64_t c = item % n_chunks, sh = item / n_chunks;
    const int s = (int)(sh / H), h = (int)(sh % H);
    const int64_t len = lengths[s * len_ss + h * len_sh];
    w->part = partials + (sh * n_chunks + c) * (int64_t)G * (D + 2);
    w->t0 = c * chunk_slots;
    w->t1 = len < w->t0 + chunk_slots ? len : w->t0 + chunk_slots;
    if (w->t1 <= w->t0) {
        empty_partial(w->part, G, D);
        return 0;
    }
    w->qh = q + s * q_ss + (int64_t)h * G * D;
    w->table = tables + s * tab_ss + h * tab_sh;
    w->sc = scores + sh * G * T;
    return 1;
}

/* The second pass of both kernels: merge the n_chunks partials (acc[D], max, sum per query head) of each
 * (sequence, kv-head) into out [S, H*G, D], and, when key_scores is not NULL, normalise the exp'd scores of
 * every chunk (scores [S, H, G, T]) by the final max and sum into key_scores [S, H, T]. A work-shared loop ended by
 * team_end's barrier: called by every thread of the enclosing parallel region (after the chunks' loop and its
 * barrier), or serially outside. */
static inline void merge_chunks(const int64_t *lengths, int64_t len_ss, int64_t len_sh, int S, int H, int G,
                                int D, int64_t T, int chunk_slots, float *out, float *key_scores,
                                const float *scores, const float *partials)
{
    const int64_t n_chunks = T / chunk_slots;
    const int64_t part_stride = (int64_t)G * (D + 2);
#pragma omp for schedule(static) nowait
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
    team_end();
}
/* Decode attention over fp32 pools for the threads of an enclosing parallel region (paged_decode.c; the arguments of
 * paged_decode_attention_f32, plus q_ss: floats between consecutive sequences' query rows). */
void paged_decode_attention_team(
    const float *q, int64_t q_ss, const float *k_pool, const float *v_pool,
    const int32_t *tables, int64_t tab_ss, int64_t tab_sh, int64_t tab_sj,
    const int64_t *lengths, int64_t len_ss, int64_t len_sh,
    int S, int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    float *out, float *key_scores, float *scores, float *partials);

#endif
