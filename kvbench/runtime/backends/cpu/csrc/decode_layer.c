/* Llama-family decoder layers of a decode step (one new token for each of M sequences), fp32, in a single OpenMP
 * parallel region. The unfused path (kvbench/runtime/model.py) makes about ten calls per layer, each a parallel
 * region of its own or a torch op: on the 2-core dev machine that overhead was a third of a batch-1 decode step,
 * because a worker thread that sleeps between regions (kvbench's short-spin policy, kvbench/runtime/threads.py)
 * must be woken for each. Here the phases (and the layers) are separated by barriers, which both threads reach
 * together. Per layer:
 *
 *   h = RMSNorm(x) * ln_attn;  qkv = h @ W_qkv^T (+ b_qkv)            qkv [M, (Hq + 2H) * D]
 *   rotate q and k heads in place (RoPE, cos / sin rows [M, D]); write k, v rows to the pools at write_rows [M, H]
 *   attn = paged decode attention of q over the layer's tables (after this write)     attn [M, Hq * D]
 *          (over a codec cache, `codec` non-NULL: the codec decode kernel reads its packed and full-precision
 *          blocks; k_pool / v_pool are then its full-precision pools, where new tokens land, fp16 when
 *          codec->fp_is_half)
 *   x += attn @ W_o^T;  h = RMSNorm(x) * ln_mlp;  act = silu(h @ W_gate^T) * (h @ W_up^T);  x += act @ W_down^T
 *
 * Same arithmetic, op for op, as the unfused path with the C kernels (tests/runtime/test_fused_decode.py compares
 * the two).
 */
#include "decode_ops.h"

typedef struct {
    const float *ln_attn, *ln_mlp;  /* [E] */
    const float *w_qkv, *b_qkv;  /* [(Hq + 2H) * D, E], bias or NULL */
    const float *w_o, *b_o;  /* [E, Hq * D] */
    const float *w_gu, *b_gu;  /* [2I, E]: gate rows, then up rows */
    const float *w_down, *b_down;  /* [E, I] */
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
    const codec_pools *codec, float *h, float *qkv, float *attn, float *act, float *key_scores, float *scores,
    float *partials, int nthreads)
{
    const int64_t Hq = (int64_t)H * G, O_qkv = (Hq + 2 * H) * D, n_rot = Hq + H;
    const int half_pools = codec != NULL && codec->fp_is_half;  /* k_pool / v_pool hold fp16 bits */
#pragma omp parallel num_threads(nthreads)
    for (int l = 0; l < n_layers; l++) {
        const layer_weights *w = lw + l;
        const int64_t *rows = write_rows + l * wr_sl;
        rms_norm_team(x, w->ln_attn, h, M, E, eps);
        gemv_team(w->w_qkv, h, E, w->b_qkv, qkv, O_qkv, O_qkv, E, M, 0);
#pragma omp for schedule(static)
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
                }
            }
        }
        if (codec)
            codec_decode_attention_team(qkv, O_qkv, codec, tables + l * tab_sl, tab_ss, tab_sh, tab_sj,
                                        lengths + l * len_sl, len_ss, len_sh, (int)M, H, G, D, bs, scale, T,
                                        chunk_slots, attn, key_scores, scores, partials);
        else
            paged_decode_attention_team(qkv, O_qkv, k_pool, v_pool, tables + l * tab_sl, tab_ss, tab_sh, tab_sj,
                                        lengths + l * len_sl, len_ss, len_sh, (int)M, H, G, D, bs, scale, T,
                                        chunk_slots, attn, key_scores, scores, partials);
        gemv_team(w->w_o, attn, Hq * D, w->b_o, x, E, E, Hq * D, M, 1);
        rms_norm_team(x, w->ln_mlp, h, M, E, eps);
        gate_up_silu_team(w->w_gu, w->b_gu, h, E, act, I, E, M);
        gemv_team(w->w_down, act, I, w->b_down, x, E, E, I, M, 1);
    }
}
