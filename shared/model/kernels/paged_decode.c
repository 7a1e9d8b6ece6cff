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
 * Scores, softmax and the weighted sum are accumulated in fp32 for both element types. Where the
 * CPU has them, AVX-512 loops compute sixteen scores at a time (sum16.h) and, for bf16, take the
 * dot products on the keys where they lie (AVX-512 BF16); other CPUs and head sizes run the
 * portable loops.
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
                                                            int bf16, int64_t n, float *dst,
                                                            const char *ahead) {
    /* `ahead`: where the next block starts (or NULL); one of its cache lines is prefetched per
     * line read here, spread out for the reason prefetch_part gives */
    const int64_t esize = bf16 ? 2 : 4, per_line = 64 / esize;
    for (int64_t i0 = 0; i0 < n; i0 += per_line) {
        if (ahead != NULL) __builtin_prefetch(ahead + i0 * esize);
        const int64_t i1 = i0 + per_line < n ? i0 + per_line : n;
        if (bf16) {
            const uint16_t *src = (const uint16_t *)base + off;
            for (int64_t i = i0; i < i1; i++) dst[i] = bf16_to_f32(src[i]);
        } else {
            memcpy(dst + i0, (const float *)base + off + i0, (size_t)(i1 - i0) * sizeof(float));
        }
    }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b,
                                                       int64_t d) {
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "sum16.h"

#define VECTOR_MAX_D 128 /* head_dim multiple of 16 up to this: the vector path */

/* Scores of one query head against `count` key rows `stride` apart; returns the running max.
 * Sixteen keys at a time: each key's products are summed within one vector, and the sixteen
 * vectors are reduced together (sum16.h) into a vector of sixteen scores. */
static inline __attribute__((always_inline)) float score_rows(
    const float *restrict q, const float *restrict k, float *restrict out, int64_t count,
    int64_t stride, const int64_t D, float mx) {
    __m512 qv[VECTOR_MAX_D / 16], part[16];
    for (int64_t c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    __m512 best = _mm512_set1_ps(mx);
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        const int64_t n = count - t0 < 16 ? count - t0 : 16;
        for (int64_t i = 0; i < 16; i++) {
            const float *kt = k + (t0 + (i < n ? i : 0)) * stride;
            __m512 p = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kt));
            for (int64_t c = 1; c < D / 16; c++)
                p = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), p);
            part[i] = p;
        }
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        const __m512 s = sum16_ordered(part);
        _mm512_mask_storeu_ps(out + t0, valid, s);
        best = _mm512_mask_max_ps(best, valid, best, s);
    }
    return _mm512_reduce_max_ps(best);
}

/* acc += sum over `count` value rows of weight x row; two keys at a time into two sets of
 * accumulators, so that consecutive FMAs do not wait on each other. */
static inline __attribute__((always_inline)) void weigh_rows(
    float *restrict acc, const float *restrict w, const float *restrict v, int64_t count,
    int64_t stride, const int64_t D) {
    __m512 a[VECTOR_MAX_D / 16], b[VECTOR_MAX_D / 16];
    for (int64_t c = 0; c < D / 16; c++) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t c = 0; c < D / 16; c++) b[c] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 2 <= count; t += 2) {
        const __m512 w0 = _mm512_set1_ps(w[t]), w1 = _mm512_set1_ps(w[t + 1]);
        const float *v0 = v + t * stride, *v1 = v0 + stride;
        for (int64_t c = 0; c < D / 16; c++) {
            a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * c), a[c]);
            b[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * c), b[c]);
        }
    }
    if (t < count) {
        const __m512 w0 = _mm512_set1_ps(w[t]);
        for (int64_t c = 0; c < D / 16; c++)
            a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v + t * stride + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(a[c], b[c]));
}

#define HAS_VECTOR_PATH 1

#if defined(__AVX512BF16__)
/* score_rows straight from bf16 keys and a bf16 query (no conversion pass over the keys): AVX-512
 * BF16 dot products, exact products summed in fp32; the scale is applied to the sums. */
static inline __attribute__((always_inline)) float score_rows_bf16(
    const uint16_t *restrict q, const uint16_t *restrict k, float *restrict out, int64_t count,
    int64_t stride, const int64_t D, float scale, float mx) {
    __m512bh qv[VECTOR_MAX_D / 32];
    __m512 part[16];
    for (int64_t c = 0; c < D / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    const __m512 sv = _mm512_set1_ps(scale);
    __m512 best = _mm512_set1_ps(mx);
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        const int64_t n = count - t0 < 16 ? count - t0 : 16;
        for (int64_t i = 0; i < 16; i++) {
            const uint16_t *kt = k + (t0 + (i < n ? i : 0)) * stride;
            __m512 p = _mm512_setzero_ps();
            for (int64_t c = 0; c < D / 32; c++)
                p = _mm512_dpbf16_ps(p, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
            part[i] = p;
        }
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        const __m512 sc = _mm512_mul_ps(sum16_ordered(part), sv);
        _mm512_mask_storeu_ps(out + t0, valid, sc);
        best = _mm512_mask_max_ps(best, valid, best, sc);
    }
    return _mm512_reduce_max_ps(best);
}
#define HAS_BF16_PATH 1
#endif

#else
#define HAS_VECTOR_PATH 0
#endif

/* The portable forms of the two loops above (and the only ones for other head sizes). */
static inline __attribute__((always_inline)) float score_rows_scalar(
    const float *restrict q, const float *restrict k, float *restrict out, int64_t count,
    int64_t stride, const int64_t D, float mx) {
    for (int64_t t = 0; t < count; t++) {
        const float s = dot(q, k + t * stride, D);
        out[t] = s;
        mx = s > mx ? s : mx;
    }
    return mx;
}

static inline __attribute__((always_inline)) void weigh_rows_scalar(
    float *restrict acc, const float *restrict w, const float *restrict v, int64_t count,
    int64_t stride, const int64_t D) {
    for (int64_t t = 0; t < count; t++)
        for (int64_t i = 0; i < D; i++) acc[i] += w[t] * v[t * stride + i];
}

#if !HAS_VECTOR_PATH
#define score_rows score_rows_scalar
#define weigh_rows weigh_rows_scalar
#endif
#ifndef HAS_BF16_PATH
#define HAS_BF16_PATH 0
/* never called without AVX-512 BF16 (vec == 2 is not chosen): keeps the callers compiling */
static inline float score_rows_bf16(const uint16_t *q, const uint16_t *k, float *out,
                                    int64_t count, int64_t stride, int64_t D, float scale,
                                    float mx) {
    (void)q, (void)k, (void)out, (void)count, (void)stride, (void)D, (void)scale;
    return mx;
}
#endif

/* Lines part..part+1 of `parts` of the `bytes` starting at `ahead` (NULL: none): a block's
 * prefetch spread over the work on the block before it, so as not to flood the line-fill
 * buffers (a burst of ~100 prefetches stalled the kernel for a third of its time). */
static inline void prefetch_part(const char *ahead, int64_t bytes, int64_t part, int64_t parts) {
    if (ahead == NULL) return;
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t l = part * lines / parts; l < (part + 1) * lines / parts; l++)
        __builtin_prefetch(ahead + l * 64);
}

typedef struct {
    const void *pool;
    int64_t H, KVH, D, NB, BS, esize;
    int bf16;
} Layout;

/* Where the block after `b` of this sequence's keys (or values) starts, or NULL after the last:
 * the block ids come from a table, so the hardware prefetcher cannot see the next one coming. */
static inline const char *next_block(const Layout *L, const int64_t *table, int64_t b,
                                     int64_t last, int64_t plane) {
    if (b + 1 > last) return NULL;
    const int64_t row = L->KVH * L->D;
    return (const char *)L->pool + (plane + table[b + 1] * L->BS * row) * L->esize;
}

/* Rows t0..t1-1 of block b of this sequence's keys (plane 0) or values (plane = the plane's
 * offset) as fp32 rows `row` apart: where they lie for fp32 on the vector path (the caller
 * prefetches the next block), else converted or copied into `rows` (the next block prefetched on
 * the way). Copying fp32 rows out first cost a pass over every key and value. */
static inline __attribute__((always_inline)) const float *block_rows(
    const Layout *L, int vec, const int64_t *table, int64_t b, int64_t t0, int64_t t1,
    int64_t last, int64_t plane, float *rows) {
    const int64_t row = L->KVH * L->D, at = plane + (table[b] * L->BS + t0) * row;
    if (vec == 1 && !L->bf16) return (const float *)L->pool + at;
    load_rows(L->pool, at, L->bf16, (t1 - t0) * row, rows, next_block(L, table, b, last, plane));
    return rows;
}

/* One sequence: all its query heads over keys lo..pos, block by block; scores [H, n]. Inlined
 * into callers that pass D as a constant (head_dim 64, 128), so its loops are fully unrolled. */
static inline __attribute__((always_inline)) void attend_seq(
    const Layout *L, const int64_t D, const int vec, const float *qf, const uint16_t *qb,
    int64_t q_head, float scale, const int64_t *table, int64_t pos, int64_t lo, float *scores,
    float *acc, float *rows, void *out) {
    const int64_t H = L->H, BS = L->BS, gq = H / L->KVH, row = L->KVH * D;
    const int64_t n = pos - lo + 1, plane = L->NB * BS * row;
    const int64_t first = lo / BS, last = pos / BS;
    float mx[MAX_HEADS], sum[MAX_HEADS];
    for (int64_t h = 0; h < H; h++) mx[h] = -FLT_MAX, sum[h] = 0.0f;
    for (int64_t b = first; b <= last; b++) {
        const int64_t t0 = b == first ? lo % BS : 0, t1 = b == last ? pos % BS + 1 : BS;
        const int64_t j0 = b * BS + t0 - lo;
        if (vec == 2) {  /* bf16 dot products on the keys where they lie */
            const uint16_t *keys = (const uint16_t *)L->pool + (table[b] * BS + t0) * row;
            const char *ahead = next_block(L, table, b, last, 0);
            for (int64_t h = 0; h < H; h++) {
                prefetch_part(ahead, BS * row * 2, h, H);
                mx[h] = score_rows_bf16(qb + h * q_head, keys + (h / gq) * D,
                                        scores + h * n + j0, t1 - t0, row, D, scale, mx[h]);
            }
            continue;
        }
        const float *keys = block_rows(L, vec, table, b, t0, t1, last, 0, rows);
        /* rows read in place: this loop prefetches the next block (block_rows did otherwise) */
        const char *ahead = keys == rows ? NULL : next_block(L, table, b, last, 0);
        for (int64_t h = 0; h < H; h++) {
            prefetch_part(ahead, BS * row * 4, h, H);
            mx[h] = vec ? score_rows(qf + h * D, keys + (h / gq) * D, scores + h * n + j0,
                                     t1 - t0, row, D, mx[h])
                        : score_rows_scalar(qf + h * D, keys + (h / gq) * D, scores + h * n + j0,
                                            t1 - t0, row, D, mx[h]);
        }
    }
    for (int64_t h = 0; h < H; h++) {
        float *sh = scores + h * n;
        for (int64_t j = 0; j < n; j++) sh[j] = expf(sh[j] - mx[h]);
        for (int64_t j = 0; j < n; j++) sum[h] += sh[j];
    }
    memset(acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t b = first; b <= last; b++) {
        const int64_t t0 = b == first ? lo % BS : 0, t1 = b == last ? pos % BS + 1 : BS;
        const float *values = block_rows(L, vec, table, b, t0, t1, last, plane, rows);
        const char *ahead = values == rows ? NULL : next_block(L, table, b, last, plane);
        const int64_t j0 = b * BS + t0 - lo;
        for (int64_t h = 0; h < H; h++) {
            prefetch_part(ahead, BS * row * 4, h, H);
            if (vec)
                weigh_rows(acc + h * D, scores + h * n + j0, values + (h / gq) * D, t1 - t0, row,
                           D);
            else
                weigh_rows_scalar(acc + h * D, scores + h * n + j0, values + (h / gq) * D,
                                  t1 - t0, row, D);
        }
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

/* 2: bf16 dot products on the keys in place, 1: fp32 vector loops, 0: portable loops. */
static int vector_path(const Layout *L) {
    const int64_t D = L->D;
    return HAS_BF16_PATH && L->bf16 && D % 32 == 0 && D <= 128 ? 2
           : HAS_VECTOR_PATH && D % 16 == 0 && D <= 128   ? 1
                                                          : 0;
}

static void attend_seq_any(const Layout *L, int vec, const float *qf, const uint16_t *qb,
                           int64_t q_head, float scale, const int64_t *table, int64_t pos,
                           int64_t lo, float *scores, float *acc, float *rows, void *out) {
    const int64_t D = L->D;
#define ATTEND(d, v) \
    attend_seq(L, d, v, qf, qb, q_head, scale, table, pos, lo, scores, acc, rows, out)
    if (D == 64 && vec == 2)
        ATTEND(64, 2);
    else if (D == 128 && vec == 2)
        ATTEND(128, 2);
    else if (D == 64 && vec == 1)
        ATTEND(64, 1);
    else if (D == 128 && vec == 1)
        ATTEND(128, 1);
    else if (vec == 2)
        ATTEND(D, 2);
    else if (vec == 1)
        ATTEND(D, 1);
    else
        ATTEND(D, 0);
#undef ATTEND
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
    const int vec = vector_path(&L);
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
            for (int64_t h = 0; vec != 2 && h < H; h++) {  /* path 2 reads the bf16 query */
                load_rows(q, s * q_row + h * q_head, bf16, D, qf + h * D, NULL);
                for (int64_t i = 0; i < D; i++) qf[h * D + i] *= scale;
            }
            const int64_t lo = window > 0 && pos[s] - window + 1 > 0 ? pos[s] - window + 1 : 0;
            attend_seq_any(&L, vec, qf, (const uint16_t *)q + s * q_row, q_head, scale,
                           blocks + s * BPS, pos[s], lo, scores, acc, rows,
                           (char *)out + s * H * D * esize);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
