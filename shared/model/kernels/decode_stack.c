/* A small decode batch (one new token per sequence) through every decoder layer in one call,
 * bf16 or fp32.
 *
 * At batch 1 a layer's kernels take ~300 us on SmolLM2 and the Python around them (module calls,
 * shape checks, tensor allocations, nine ctypes calls) another ~100: a quarter of the step went
 * to dispatch (docs/performance.md, "Kernels"). In bf16 this file runs the same kernels, in the
 * same order on the same buffers as shared/model/llama.py's layer loop, so its outputs equal that
 * path's bit for bit; it only removes the interpreter between them. In fp32 RMSNorm, RoPE and
 * SwiGLU's product are fused_ops.c's fp32 loops (where prefill keeps torch's ops, their bits
 * pinned to transformers', they may differ from it in the last bit, as the decode GEMMs already
 * do: shared/model/gemm.py).
 * It is a unity build: the kernels' sources are included, not linked (each kernel is its own
 * library for the layer loop).
 *
 * Per layer (llama.DecoderLayer.forward):
 *   h = RMSNorm(x += pending)           pending: the previous layer's MLP output (none at 0)
 *   qkv = h @ Wqkv^T + b; q, k = rope(q, k); K/V stored at each token's slot
 *   attn = paged decode attention of q over the layer's pool
 *   h = RMSNorm(x += attn @ Wo^T + b)
 *   pending = (silu(gate) * up)(h @ Wgu^T + b) @ Wdown^T + b
 * The final norm and the LM head stay with the caller (`pending` is returned in `out`).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fused_ops.c"
#include "paged_decode.c"
#include "skinny_gemm.c"

/* One decoder layer's weights (bf16 or fp32, torch's [out, in] layout, contiguous); biases may
 * be NULL. */
typedef struct {
    const void *qkv_w, *qkv_b, *o_w, *o_b, *gate_up_w, *gate_up_b, *down_w, *down_b;
    const void *input_norm, *post_norm;
    int64_t window; /* sliding window of this layer, 0 for full attention */
} DecodeLayer;

/* The step: M sequences with one new token each, their rope rows, slots and block tables. */
typedef struct {
    int64_t M, hidden, Hq, Hk, D, inter;
    int64_t num_blocks, block_size, blocks_per_seq; /* pool: [L, 2, NB, BS, Hk, D] contiguous */
    float eps, scale;
    const void *cos, *ssin; /* [M, D], the model's element type */
    const int64_t *slots, *blocks, *pos;
    int64_t parallel_elements; /* element-wise ops fork threads from this many elements */
    int nthreads;
} DecodeStep;

/* Elements (of the model's type) scratch `work` must hold for this step. */
int64_t decode_stack_work(const DecodeStep *s) {
    const int64_t qkv = (s->Hq + 2 * s->Hk) * s->D, qk = (s->Hq + s->Hk) * s->D;
    return s->M * (2 * s->hidden + qkv + qk + s->Hq * s->D + 3 * s->inter);
}

static inline int ew_threads(const DecodeStep *s, int64_t elements) {
    return elements >= s->parallel_elements ? s->nthreads : 1;
}

/* x [M, hidden] contiguous: the residual stream, updated in place; out [M, hidden]: the last
 * layer's MLP output; pool: every layer's KV, [L, 2, NB, BS, Hk, D]; weights in the table of
 * the same element type. Returns 0; -1 (before anything is written) where a shape or slot is
 * outside the kernels' range or this CPU lacks the GEMM's instructions; -2 if attention's
 * scratch memory could not be had (the step is then lost). */
#define DEFINE_STACK(NAME, T, GEMM, NORM, ROPE, SILU, IS_BF16)                                    \
    int NAME(const DecodeLayer *layers, int64_t num_layers, const DecodeStep *s, T *x, T *pool,  \
             T *work, T *out) {                                                                   \
        const int64_t M = s->M, H = s->hidden, Hq = s->Hq, Hk = s->Hk, D = s->D, I = s->inter;   \
        const int64_t qkv_w = (Hq + 2 * Hk) * D, qk_w = (Hq + Hk) * D;                            \
        const int64_t slots = s->num_blocks * s->block_size;                                      \
        if (M < 1 || M > MB || Hk <= 0 || Hq % Hk || Hq > MAX_HEADS || D <= 0 || D % 2)           \
            return -1;                                                                            \
        for (int64_t t = 0; t < M; t++)                                                           \
            if (s->slots[t] < 0 || s->slots[t] >= slots) return -1;                               \
        T probe = 0;                                                                              \
        if (GEMM(&probe, 1, &probe, NULL, &probe, 1, 1, 1, 1) != 0) return -1;                    \
        T *h = work, *qkv = h + M * H, *qk = qkv + M * qkv_w, *attn = qk + M * qk_w;              \
        T *o = attn + M * Hq * D, *gate_up = o + M * H, *act = gate_up + M * 2 * I;               \
        const int64_t layer_elements = 2 * slots * Hk * D;                                        \
        const int nt = s->nthreads;                                                               \
        for (int64_t l = 0; l < num_layers; l++) {                                                \
            const DecodeLayer *w = layers + l;                                                    \
            T *k_plane = pool + l * layer_elements, *v_plane = k_plane + layer_elements / 2;      \
            NORM(x, l ? out : NULL, (const T *)w->input_norm, h, M, H, H, H, s->eps,             \
                 ew_threads(s, M * H));                                                           \
            GEMM(h, H, (const T *)w->qkv_w, (const T *)w->qkv_b, qkv, M, qkv_w, H, nt);           \
            ROPE(qkv, (const T *)s->cos, (const T *)s->ssin, qk, k_plane, v_plane, s->slots, M,   \
                 Hq, Hk, D, qkv_w, slots, ew_threads(s, M * qkv_w));                              \
            const int code = paged_decode(qk, k_plane, attn, s->blocks, s->pos, M,                \
                                          s->blocks_per_seq, Hq, Hk, D, s->num_blocks,            \
                                          s->block_size, qk_w, D, s->scale, w->window, IS_BF16,   \
                                          nt);                                                    \
            if (code != 0) return code;                                                           \
            GEMM(attn, Hq * D, (const T *)w->o_w, (const T *)w->o_b, o, M, H, Hq * D, nt);        \
            NORM(x, o, (const T *)w->post_norm, h, M, H, H, H, s->eps, ew_threads(s, M * H));    \
            GEMM(h, H, (const T *)w->gate_up_w, (const T *)w->gate_up_b, gate_up, M, 2 * I, H,    \
                 nt);                                                                             \
            SILU(gate_up, act, M, I, 2 * I, ew_threads(s, M * I));                                \
            GEMM(act, I, (const T *)w->down_w, (const T *)w->down_b, out, M, H, I, nt);           \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_STACK(decode_stack_bf16, uint16_t, skinny_gemm_bf16, add_rms_norm, rope_store, silu_mul, 1)
DEFINE_STACK(decode_stack_f32, float, skinny_gemm_f32, add_rms_norm_f32, rope_store_f32,
             silu_mul_f32, 0)
