/* A small bf16 decode batch (one new token per sequence) through every decoder layer in one call.
 *
 * At batch 1 a layer's kernels take ~300 us on SmolLM2 and the Python around them (module calls,
 * shape checks, tensor allocations, nine ctypes calls) another ~100: a quarter of the step went
 * to dispatch (docs/performance.md, section 8). This file runs the same kernels, in the same
 * order on the same buffers as shared/model/llama.py's layer loop, so its outputs equal that
 * path's bit for bit; it only removes the interpreter between them. It is a unity build: the
 * kernels' sources are included, not linked (each kernel is its own library for the torch path).
 *
 * Per layer (llama.DecoderLayer.forward):
 *   h = RMSNorm(x += pending)           pending: the previous layer's MLP output (none at 0)
 *   qkv = h @ Wqkv^T + b; q, k = rope(q, k); K/V stored at each token's slot
 *   attn = paged decode attention of q over the layer's pool
 *   h = RMSNorm(x += attn @ Wo^T + b)
 *   pending = (silu(gate) * up)(h @ Wgu^T + b) @ Wdown^T + b
 * The final norm and the LM head stay with the caller (`pending` is returned in `out`).
 */
#include <stdint.h>

#include "fused_ops.c"
#include "paged_decode.c"
#include "skinny_gemm.c"

/* One decoder layer's weights (bf16, torch's [out, in] layout, contiguous); biases may be NULL. */
typedef struct {
    const uint16_t *qkv_w, *qkv_b, *o_w, *o_b, *gate_up_w, *gate_up_b, *down_w, *down_b;
    const uint16_t *input_norm, *post_norm;
    int64_t window; /* sliding window of this layer, 0 for full attention */
} DecodeLayer;

/* The step: M sequences with one new token each, their rope rows, slots and block tables. */
typedef struct {
    int64_t M, hidden, Hq, Hk, D, inter;
    int64_t num_blocks, block_size, blocks_per_seq; /* pool: [L, 2, NB, BS, Hk, D] contiguous */
    float eps, scale;
    const uint16_t *cos, *ssin; /* [M, D] */
    const int64_t *slots, *blocks, *pos;
    int64_t parallel_elements; /* element-wise ops fork threads from this many elements */
    int nthreads;
} DecodeStep;

static inline int64_t stack_work_elements(const DecodeStep *s) {
    const int64_t qkv = (s->Hq + 2 * s->Hk) * s->D, qk = (s->Hq + s->Hk) * s->D;
    return s->M * (2 * s->hidden + qkv + qk + s->Hq * s->D + 3 * s->inter);
}

/* Elements of bf16 scratch `work` must hold for this step. */
int64_t decode_stack_work(const DecodeStep *s) { return stack_work_elements(s); }

static inline int ew_threads(const DecodeStep *s, int64_t elements) {
    return elements >= s->parallel_elements ? s->nthreads : 1;
}

/* x [M, hidden] contiguous: the residual stream, updated in place; out [M, hidden]: the last
 * layer's MLP output; pool: every layer's KV, [L, 2, NB, BS, Hk, D]. Returns 0; -1 (before
 * anything is written) where a shape or slot is outside the kernels' range or this CPU lacks
 * AVX-512 BF16; -2 if attention's scratch memory could not be had (the step is then lost). */
int decode_stack_bf16(const DecodeLayer *layers, int64_t num_layers, const DecodeStep *s,
                      uint16_t *x, uint16_t *pool, uint16_t *work, uint16_t *out) {
    const int64_t M = s->M, H = s->hidden, Hq = s->Hq, Hk = s->Hk, D = s->D, I = s->inter;
    const int64_t qkv_w = (Hq + 2 * Hk) * D, qk_w = (Hq + Hk) * D;
    const int64_t slots = s->num_blocks * s->block_size;
    if (M < 1 || M > MB || Hk <= 0 || Hq % Hk || Hq > MAX_HEADS || D <= 0 || D % 2) return -1;
    for (int64_t t = 0; t < M; t++)
        if (s->slots[t] < 0 || s->slots[t] >= slots) return -1;
    uint16_t probe = 0;
    if (skinny_gemm_bf16(&probe, 1, &probe, NULL, &probe, 1, 1, 1, 1) != 0) return -1;

    uint16_t *h = work, *qkv = h + M * H, *qk = qkv + M * qkv_w, *attn = qk + M * qk_w;
    uint16_t *o = attn + M * Hq * D, *gate_up = o + M * H, *act = gate_up + M * 2 * I;
    const int64_t layer_elements = 2 * slots * Hk * D;
    const int nt = s->nthreads;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *w = layers + l;
        uint16_t *k_plane = pool + l * layer_elements, *v_plane = k_plane + layer_elements / 2;
        add_rms_norm(x, l ? out : NULL, w->input_norm, h, M, H, H, H, s->eps,
                     ew_threads(s, M * H));
        skinny_gemm_bf16(h, H, w->qkv_w, w->qkv_b, qkv, M, qkv_w, H, nt);
        rope_store(qkv, s->cos, s->ssin, qk, k_plane, v_plane, s->slots, M, Hq, Hk, D, qkv_w,
                   slots, ew_threads(s, M * qkv_w));
        const int code = paged_decode(qk, k_plane, attn, s->blocks, s->pos, M,
                                      s->blocks_per_seq, Hq, Hk, D, s->num_blocks,
                                      s->block_size, qk_w, D, s->scale, w->window, 1, nt);
        if (code != 0) return code;
        skinny_gemm_bf16(attn, Hq * D, w->o_w, w->o_b, o, M, H, Hq * D, nt);
        add_rms_norm(x, o, w->post_norm, h, M, H, H, H, s->eps, ew_threads(s, M * H));
        skinny_gemm_bf16(h, H, w->gate_up_w, w->gate_up_b, gate_up, M, 2 * I, H, nt);
        silu_mul(gate_up, act, M, I, 2 * I, ew_threads(s, M * I));
        skinny_gemm_bf16(act, I, w->down_w, w->down_b, out, M, H, I, nt);
    }
    return 0;
}
