/* Llama-family decoder layers of a decode step (one new token for each of M sequences), fp32, in a single OpenMP
 * parallel region. The unfused path (kvbench/runtime/model/forward.py) makes about ten calls per layer, each a parallel
 * region of its own or a torch op, and a worker thread that sleeps between regions (kvbench's short-spin policy,
 * kvbench/runtime/backends/cpu/threads.py) must be woken for each; on a 2-core machine that overhead was a large
 * share of a batch-1 decode step (figures: docs/benchmark-results.md). Here the phases (and the layers) are separated
 * by barriers, which both threads reach together. Per layer:
 *
 *   h = RMSNorm(x) * ln_attn;  qkv = h @ W_qkv^T (+ b_qkv)            qkv [M, (Hq + 2H) * D]
 *   rotate q and k heads in place (RoPE, cos / sin rows [M, D]); write k, v rows to the pools at write_rows [M, H]
 *   attn = paged decode attention of q over the layer's tables (after this write)     attn [M, Hq * D]
 *          (page retrieval, `ps` non-NULL and ps->pages[l] > 0: over the blocks page_select.c picks; the write also
 *          keeps the blocks' key summaries, in such a layer only: no other layer's blocks carry one)
 *          (over a codec cache, `codec` non-NULL: the codec decode kernel reads its packed and full-precision
 *          blocks; k_pool / v_pool are then its full-precision pools, where new tokens land, fp16 when
 *          codec->fp_is_half)
 *   x += attn @ W_o^T;  h = RMSNorm(x) * ln_mlp;  act = silu(h @ W_gate^T) * (h @ W_up^T);  x += act @ W_down^T
 *
 * Each projection is fp32 (the C GEMV over the Linear's plain copy) or a GGUF file's quantized blocks, one or more
 * matrices stacked along its output (project_team: quant_matmul.c's kernels through a pointer, work-shared in this
 * region; gate and up then go through a scratch gu [M, 2I] before silu(gate) * up).
 *
 * Same arithmetic, op for op, as the unfused path with the C kernels (tests/runtime/test_fused_decode.py compares
 * the two).
 */
#include <omp.h>

#include "decode_ops.h"

/* Per-phase wall time of decode_layers_f32, for profiling (bench/profile_decode.py): when set, thread 0 adds the
 * seconds of each phase of every layer to phase_seconds[phase] (phases end at a barrier, so thread 0's clock is the
 * team's); NULL (the default) skips the clock. */
enum { PH_NORM_ATTN, PH_QKV, PH_ROPE_WRITE, PH_PAGE_SELECT, PH_ATTENTION, PH_O, PH_NORM_MLP, PH_GATE_UP, PH_DOWN, N_PHASES };
static double *phase_seconds = NULL;
_Thread_local team_sync *current_team_sync = NULL;
void set_phase_clock(double *acc) { phase_seconds = acc; }
int phase_count(void) { return N_PHASES; }
#define PHASE_END(ph)                                                   \
    do {                                                                \
        if (phase_seconds != NULL && omp_get_thread_num() == 0) {       \
            const double now = omp_get_wtime();                         \
            phase_seconds[ph] += now - t_last;                          \
            t_last = now;                                               \
        }                                                               \
    } while (0)

typedef struct {
    const float *ln_attn, *ln_mlp;  /* [E] */
    projection qkv;  /* E -> (Hq + 2H) * D */
    projection o;  /* Hq * D -> E */
    projection gu;  /* E -> 2I: gate rows, then up rows */
    projection down;  /* I -> E */
} layer_weights;

/* Layers l < n_layers in turn, in one parallel region: layer l reads weights lw[l], write_rows + l * wr_sl, tables +
 * l * tab_sl and lengths + l * len_sl (strides in elements). key_scores (or NULL) is written by every layer, so a
 * caller that keeps a layer's scores runs one layer per call. */
void decode_layers_f32(
    float *x, int64_t M, int64_t E, int64_t I, const layer_weights *lw, int n_layers, float eps,
    const float *cos_t, const float *sin_t, float *k_pool, float *v_pool, const int64_t *write_rows, int64_t wr_sl,
    const int32_t *tables, int64_t tab_sl, int64_t tab_ss, int64_t tab_sh, int64_t tab_sj,
    const int64_t *lengths, int64_t len_sl, int64_t len_ss, int64_t len_sh,
    int H, int G, int D, int bs, float scale, int64_t T, int chunk_slots,
    const codec_pools *codec, float *h, float *qkv, float *attn, float *act, float *gu, float *key_scores,
    float *scores,
    float *partials, const page_select *ps, int nthreads)
{
    const int64_t Hq = (int64_t)H * G, O_qkv = (Hq + 2 * H) * D, n_rot = Hq + H;
    const int half_pools = codec != NULL && codec->fp_is_half;  /* k_pool / v_pool hold fp16 bits */
    team_sync sync = {0, 0, 0};
#pragma omp parallel num_threads(nthreads)
    {
    if (omp_get_thread_num() == 0) sync.nthreads = omp_get_num_threads();
#pragma omp barrier
    current_team_sync = &sync;  /* every work-shared loop below ends at team_end's barrier (decode_common.h) */
    double t_last = phase_seconds != NULL ? omp_get_wtime() : 0.0;
    for (int l = 0; l < n_layers; l++) {
        const layer_weights *w = lw + l;
        const int64_t *rows = write_rows + l * wr_sl;
        rms_norm_team(x, w->ln_attn, h, M, E, eps);
        PHASE_END(PH_NORM_ATTN);
        project_team(&w->qkv, h, E, qkv, O_qkv, E, M, 0);
        PHASE_END(PH_QKV);
#pragma omp for schedule(static) nowait
        for (int64_t item = 0; item < M * n_rot; item++) {  /* (row, q or k head) */
            const int64_t m = item / n_rot, j = item % n_rot;
            float *row = qkv + m * O_qkv;
            rotate_half_head(row + j * D, cos_t + m * D, sin_t + m * D, D);
            if (j >= Hq) {  /* a k head, now rotated: store it and its v head */
                const int64_t kh = j - Hq, dst = rows[m * H + kh] * D;
                const float *kr = row + j * D, *vr = row + (Hq + H + kh) * D;
                if (half_pools) {  /* a codec cache's fp16 full-precision blocks */
                    for (int d = 0; d < D; d++) {
                        ((uint16_t *)k_pool)[dst + d] = float_to_half(kr[d]);
                        ((uint16_t *)v_pool)[dst + d] = float_to_half(vr[d]);
                    }
                } else {
                    memcpy(k_pool + dst, kr, sizeof(float) * D);
                    memcpy(v_pool + dst, vr, sizeof(float) * D);
                    if (ps != NULL && ps->pages[l] > 0)  /* a retrieving layer: the block's min / max key */
                        page_summary_update(ps->summary, kr, rows[m * H + kh], bs, D);
                }
            }
        }
        team_end();
        PHASE_END(PH_ROPE_WRITE);
        const int pages = ps != NULL ? ps->pages[l] : 0;
        if (pages > 0) {  /* only each query head's top blocks, united per kv-head (page_select.c) */
            /* per_head: one table per query head, read as Hq kv-heads of one query head each */
            const int Ht = ps->per_head ? H * G : H, Gt = ps->per_head ? 1 : G;
            int64_t *sel_len = ps->sel_lengths + (int64_t)l * M * Ht;
            int64_t *kv_blocks = ps->kv_blocks != NULL ? ps->kv_blocks + (int64_t)l * M * H : NULL;
            page_select_team(qkv, O_qkv, ps, tables + l * tab_sl, tab_ss, tab_sh, tab_sj, lengths + l * len_sl,
                             len_ss, len_sh, (int)M, H, G, D, bs, pages, sel_len, kv_blocks);
            PHASE_END(PH_PAGE_SELECT);
            paged_decode_attention_team(qkv, O_qkv, k_pool, v_pool, ps->sel_tables, Ht * ps->U, ps->U, 1, sel_len,
                                        Ht, 1, (int)M, Ht, Gt, D, bs, scale, ps->T, (int)ps->chunk, attn, NULL,
                                        ps->scores, ps->partials);
        } else if (codec)
            codec_decode_attention_team(qkv, O_qkv, codec, tables + l * tab_sl, tab_ss, tab_sh, tab_sj,
                                        lengths + l * len_sl, len_ss, len_sh, (int)M, H, G, D, bs, scale, T,
                                        chunk_slots, attn, key_scores, scores, partials);
        else
            paged_decode_attention_team(qkv, O_qkv, k_pool, v_pool, tables + l * tab_sl, tab_ss, tab_sh, tab_sj,
                                        lengths + l * len_sl, len_ss, len_sh, (int)M, H, G, D, bs, scale, T,
                                        chunk_slots, attn, key_scores, scores, partials);
        PHASE_END(PH_ATTENTION);
        project_team(&w->o, attn, Hq * D, x, E, Hq * D, M, 1);
        PHASE_END(PH_O);
        rms_norm_team(x, w->ln_mlp, h, M, E, eps);
        PHASE_END(PH_NORM_MLP);
        gate_up_project_team(&w->gu, h, E, act, gu, I, E, M);
        PHASE_END(PH_GATE_UP);
        project_team(&w->down, act, I, x, E, I, M, 1);
        PHASE_END(PH_DOWN);
    }
    current_team_sync = NULL;
    }
}
