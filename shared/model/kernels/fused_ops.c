/* The element-wise ops of a decoder layer, each fused into one pass over memory, bf16 and fp32.
 *
 * torch runs RMSNorm as seven ops, SwiGLU's product as two and RoPE as five, each converting
 * bf16 <-> fp32 in its own pass over a fresh tensor; at prefill sizes that was as long as the
 * layer's GEMMs (docs/performance.md, "Kernels"). Every function here rounds to bf16 at the same
 * points as the torch formula it replaces (shared/model/llama.py), so results equal torch's
 * except where a sum or expf is computed in another order (RMSNorm's variance, SiLU): there an
 * output may differ in its last bf16 bit.
 *
 * fp32 (the _f32 functions, same arguments): the same formulas with nothing to round; their
 * sums and exp may differ from torch's in the last bit, so they run only where fp32 has already
 * left transformers' bits (shared/model/fused_ops.py) and in the one-call decode stack.
 *
 * Tensors are bf16 (uint16_t) or fp32, rows of `dim` contiguous elements at the given row
 * stride. `nthreads` > 1 splits rows over torch's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* x += delta (when delta is not NULL; rounded to bf16, as torch's add_), then
 * out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight): LlamaRMSNorm's two roundings. */
void add_rms_norm(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                  int64_t rows, int64_t dim, int64_t x_row, int64_t delta_row, float eps,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * x_row;
        uint16_t *o = out + r * dim;
        float sq = 0.0f;
        if (delta != NULL) {
            const uint16_t *d = delta + r * delta_row;
            for (int64_t i = 0; i < dim; i++) {
                const uint16_t s = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(d[i]));
                xr[i] = s;
                const float f = bf16_to_f32(s);
                sq += f * f;
            }
        } else {
            for (int64_t i = 0; i < dim; i++) {
                const float f = bf16_to_f32(xr[i]);
                sq += f * f;
            }
        }
        /* torch: rsqrt(mean + eps) = 1 / sqrt(.) in fp32, each rounded; volatile keeps
         * -ffast-math from turning it into an rsqrt approximation */
        volatile float root = sqrtf(sq / (float)dim + eps);
        const float inv = 1.0f / root;
        for (int64_t i = 0; i < dim; i++) {
            const float y = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * inv));
            o[i] = f32_to_bf16(y * bf16_to_f32(weight[i]));
        }
    }
}

/* out = bf16(bf16(silu(gate)) * up) over rows of [gate | up] (SwiGLU's product, as
 * F.silu(gate).mul_(up)). out: [rows, inter] contiguous. */
void silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
              int64_t row_stride, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * row_stride, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float x = bf16_to_f32(g[i]);
            const float s = bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x))));
            o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}

/* One head: o = x * cos; o[:h] += x[h:] * ssin[:h]; o[h:] += x[:h] * ssin[h:], each product and
 * sum rounded to bf16 as in llama.apply_rotary (bf16 products are exact in fp32). */
static inline float rope_term(uint16_t x, uint16_t x_other, uint16_t c, uint16_t s) {
    const float base = bf16_to_f32(f32_to_bf16(bf16_to_f32(x) * bf16_to_f32(c)));
    return base + bf16_to_f32(f32_to_bf16(bf16_to_f32(x_other) * bf16_to_f32(s)));
}

static inline void rotate_head(const uint16_t *restrict x, const uint16_t *restrict c,
                               const uint16_t *restrict s, uint16_t *restrict o, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) o[i] = f32_to_bf16(rope_term(x[i], x[i + h], c[i], s[i]));
    for (int64_t i = h; i < D; i++) o[i] = f32_to_bf16(rope_term(x[i], x[i - h], c[i], s[i]));
}

/* RoPE on the q and k heads of a fused qkv output, and this step's K/V stored in the pool.
 *   qkv   [T, Hq + 2 Hk, D] at row stride `row` (D contiguous, heads adjacent)
 *   cos, ssin [T, D] contiguous (ssin: the signed sin of llama.RotaryEmbedding)
 *   qk    [T, Hq + Hk, D] contiguous: the rotated q and k heads
 *   k_plane, v_plane: one layer's K and V planes, [slots, Hk, D] contiguous; token t's rotated
 *   k and its v go to slot slots[t].
 * Returns -1 (before writing anything) if a slot is outside 0..num_slots-1. */
int rope_store(const uint16_t *qkv, const uint16_t *cos, const uint16_t *ssin, uint16_t *qk,
               uint16_t *k_plane, uint16_t *v_plane, const int64_t *slots, int64_t T, int64_t Hq,
               int64_t Hk, int64_t D, int64_t row, int64_t num_slots, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int64_t H = Hq + Hk;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + t * D, *s = ssin + t * D;
        for (int64_t h = 0; h < H; h++)
            rotate_head(qkv + t * row + h * D, c, s, qk + (t * H + h) * D, D);
        memcpy(k_plane + slots[t] * Hk * D, qk + (t * H + Hq) * D, (size_t)(Hk * D) * 2);
        memcpy(v_plane + slots[t] * Hk * D, qkv + t * row + H * D, (size_t)(Hk * D) * 2);
    }
    return 0;
}

/* ---- fp32: the same signatures and llama.py's formulas, in fp32 throughout ---------------- */

void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out,
                      int64_t rows, int64_t dim, int64_t x_row, int64_t delta_row, float eps,
                      int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * x_row, *o = out + r * dim, sq = 0.0f;
        const float *d = delta ? delta + r * delta_row : NULL;
        if (d)
            for (int64_t i = 0; i < dim; i++) xr[i] += d[i];
        for (int64_t i = 0; i < dim; i++) sq += xr[i] * xr[i];
        volatile float root = sqrtf(sq / (float)dim + eps); /* torch: 1 / sqrt, not rsqrt */
        const float inv = 1.0f / root;
        /* rounded before the weight, as torch: two loops, which -ffast-math cannot merge into
         * x * (inv * weight) */
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv;
        for (int64_t i = 0; i < dim; i++) o[i] *= weight[i];
    }
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter,
                  int64_t row_stride, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * row_stride, *u = g + inter;
        for (int64_t i = 0; i < inter; i++) out[r * inter + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

int rope_store_f32(const float *qkv, const float *cos, const float *ssin, float *qk,
                   float *k_plane, float *v_plane, const int64_t *slots, int64_t T, int64_t Hq,
                   int64_t Hk, int64_t D, int64_t row, int64_t num_slots, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int64_t H = Hq + Hk, h2 = D / 2;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = ssin + t * D;
        for (int64_t h = 0; h < H; h++) {
            const float *x = qkv + t * row + h * D;
            float *o = qk + (t * H + h) * D;
            for (int64_t i = 0; i < h2; i++) o[i] = x[i] * c[i] + x[i + h2] * s[i];
            for (int64_t i = h2; i < D; i++) o[i] = x[i] * c[i] + x[i - h2] * s[i];
        }
        memcpy(k_plane + slots[t] * Hk * D, qk + (t * H + Hq) * D, (size_t)(Hk * D) * 4);
        memcpy(v_plane + slots[t] * Hk * D, qkv + t * row + H * D, (size_t)(Hk * D) * 4);
    }
    return 0;
}
