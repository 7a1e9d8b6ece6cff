/* Decode attention straight from the paged KV pool: one query per sequence, its keys and values
 * read where they lie in the pool's blocks (no gather into a padded copy first).
 *
 * Layouts (element strides, see shared/engine/kv_cache.py):
 *   q      [G, H, D] with row stride q_row and head stride q_head (D contiguous)
 *   pool   one layer: [2, NB, BS, KVH, D] contiguous; plane 0 = K, plane 1 = V
 *   blocks [G, BPS] block ids of each sequence, in order
 *   pos    [G] position of each query: it attends to keys lo..pos, lo = max(0, pos - window + 1)
 *          (window <= 0: lo = 0)
 *   out    [G, H, D] contiguous
 * Query head h reads KV head h / (H / KVH) (grouped-query attention, as SDPA's enable_gqa).
 * Scores, softmax and the weighted sum are accumulated in fp32 for both element types.
 * Built by shared/model/paged_decode.py; the Python side checks every shape before calling.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEADS 256  /* query heads */

static inline __attribute__((always_inline)) void load_rows(const void *base, int64_t off,
                                                            int bf16, int64_t n, float *dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b,
                                                       int64_t d) {
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* Scores of one query head against `count` key rows `stride` apart; returns the running max.
 * Head outer, keys inner: the query stays in registers across the block's keys. */
static inline __attribute__((always_inline)) float score_rows(
    const float *restrict q, const float *restrict k, float *restrict out, int64_t count,
    int64_t stride, const int64_t D, float mx) {
    for (int64_t t = 0; t < count; t++) {
        const float s = dot(q, k + t * stride, D);
        out[t] = s;
        mx = s > mx ? s : mx;
    }
    return mx;
}

/* acc += sum over `count` value rows of weight x row; the accumulator stays in registers. */
static inline __attribute__((always_inline)) void weigh_rows(
    float *restrict acc, const float *restrict w, const float *restrict v, int64_t count,
    int64_t stride, const int64_t D) {
    for (int64_t t = 0; t < count; t++)
        for (int64_t i = 0; i < D; i++) acc[i] += w[t] * v[t * stride + i];
}

typedef struct {
    const void *pool;
    int64_t H, KVH, D, NB, BS, esize;
    int bf16;
} Layout;

/* Start fetching the block after `b` of this sequence's keys (or values) into cache: the block
 * ids come from a table, so the hardware prefetcher cannot see the next one coming. */
static inline void prefetch_block(const Layout *L, const int64_t *table, int64_t b, int64_t last,
                                  int64_t plane) {
    if (b + 1 > last) return;
    const int64_t row = L->KVH * L->D;
    const char *p = (const char *)L->pool + (plane + table[b + 1] * L->BS * row) * L->esize;
    for (int64_t off = 0; off < L->BS * row * L->esize; off += 64) __builtin_prefetch(p + off);
}

/* One sequence: all its query heads over keys lo..pos, block by block; scores [H, n]. Inlined
 * into callers that pass D as a constant (head_dim 64, 128), so its loops are fully unrolled. */
static inline __attribute__((always_inline)) void attend_seq(
    const Layout *L, const int64_t D, const float *qf, const int64_t *table, int64_t pos,
    int64_t lo, float *scores, float *acc, float *rows, void *out) {
    const int64_t H = L->H, BS = L->BS, gq = H / L->KVH, row = L->KVH * D;
    const int64_t n = pos - lo + 1, plane = L->NB * BS * row;
    const int64_t first = lo / BS, last = pos / BS;
    float mx[MAX_HEADS], sum[MAX_HEADS];
    for (int64_t h = 0; h < H; h++) mx[h] = -FLT_MAX, sum[h] = 0.0f;
    for (int64_t b = first; b <= last; b++) {
        prefetch_block(L, table, b, last, 0);
        const int64_t t0 = b == first ? lo % BS : 0, t1 = b == last ? pos % BS + 1 : BS;
        load_rows(L->pool, (table[b] * BS + t0) * row, L->bf16, (t1 - t0) * row, rows);
        const int64_t j0 = b * BS + t0 - lo;
        for (int64_t h = 0; h < H; h++)
            mx[h] = score_rows(qf + h * D, rows + (h / gq) * D, scores + h * n + j0, t1 - t0, row,
                               D, mx[h]);
    }
    for (int64_t h = 0; h < H; h++) {
        float *sh = scores + h * n;
        for (int64_t j = 0; j < n; j++) sh[j] = expf(sh[j] - mx[h]);
        for (int64_t j = 0; j < n; j++) sum[h] += sh[j];
    }
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t b = first; b <= last; b++) {
        prefetch_block(L, table, b, last, plane);
        const int64_t t0 = b == first ? lo % BS : 0, t1 = b == last ? pos % BS + 1 : BS;
        load_rows(L->pool, plane + (table[b] * BS + t0) * row, L->bf16, (t1 - t0) * row, rows);
        const int64_t j0 = b * BS + t0 - lo;
        for (int64_t h = 0; h < H; h++)
            weigh_rows(acc + h * D, scores + h * n + j0, rows + (h / gq) * D, t1 - t0, row, D);
    }
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.0f / sum[h];
        if (L->bf16) {
            uint16_t *dst = (uint16_t *)out + h * D;
            for (int64_t i = 0; i < D; i++) dst[i] = f32_to_bf16(acc[h * D + i] * inv);
        } else {
            float *dst = (float *)out + h * D;
            for (int64_t i = 0; i < D; i++) dst[i] = acc[h * D + i] * inv;
        }
    }
}

static void attend_seq_any(const Layout *L, const float *qf, const int64_t *table, int64_t pos,
                           int64_t lo, float *scores, float *acc, float *rows, void *out) {
    if (L->D == 64)
        attend_seq(L, 64, qf, table, pos, lo, scores, acc, rows, out);
    else if (L->D == 128)
        attend_seq(L, 128, qf, table, pos, lo, scores, acc, rows, out);
    else
        attend_seq(L, L->D, qf, table, pos, lo, scores, acc, rows, out);
}

/* Returns 0, -1 if a shape is out of this kernel's range or -2 if scratch memory could not be
 * had (the caller then uses SDPA). */
int paged_decode(
    const void *q, const void *pool, void *out, const int64_t *blocks, const int64_t *pos,
    int64_t G, int64_t BPS, int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
    int64_t q_row, int64_t q_head, float scale, int64_t window, int bf16, int nthreads) {
    if (KVH <= 0 || H % KVH || H > MAX_HEADS || D <= 0 || BS <= 0) return -1;
    const Layout L = {pool, H, KVH, D, NB, BS, bf16 ? 2 : 4, bf16};
    const int64_t esize = L.esize;
    int64_t max_n = 1;
    for (int64_t s = 0; s < G; s++) max_n = pos[s] + 1 > max_n ? pos[s] + 1 : max_n;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = malloc((size_t)(H * max_n + 2 * H * D + BS * KVH * D) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < G; s++) {
            if (scores == NULL) continue;
            float *qf = scores + H * max_n, *acc = qf + H * D, *rows = acc + H * D;
            for (int64_t h = 0; h < H; h++) {
                load_rows(q, s * q_row + h * q_head, bf16, D, qf + h * D);
                for (int64_t i = 0; i < D; i++) qf[h * D + i] *= scale;
            }
            const int64_t lo = window > 0 && pos[s] - window + 1 > 0 ? pos[s] - window + 1 : 0;
            attend_seq_any(&L, qf, blocks + s * BPS, pos[s], lo, scores, acc, rows,
                           (char *)out + s * H * D * esize);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
