/* Prefill attention straight from the paged KV pool, bf16: a chunk of queries per sequence
 * (fresh, or continuing a cached context) over every key it may see, in one pass, flash-style
 * (online softmax, nothing T x T materialised).
 *
 * Why hand-written: torch's CPU flash attention runs at 35-65 GFLOP/s in bf16 on AMD Zen 4
 * (docs/performance.md, section 6), a fifth to a third of what the same core's bf16 GEMMs reach;
 * a prompt continuing a cached prefix also paid a gather of its whole context per layer first.
 *
 * Work item: one sequence, one KV head, up to 16 query rows (query x head of that KV head's
 * group: grouped-query attention shares each key and value across its rows). Per chunk of up to
 * 16 keys (never crossing a pool block): the values are interleaved in pairs once (the operand
 * layout of AVX-512 BF16 dot products), then each row takes its scores (q . k as BF16 dot
 * products on the keys where they lie, exact products summed in fp32; the sixteen keys' sums
 * reduced together, sum16.h), updates its running max and sum, and adds probabilities x values
 * (probabilities rounded to bf16 for that product, as torch's bf16 flash kernel does; the
 * normaliser keeps them in fp32). Scores are kept in log2 units so that exp is exp2.
 *
 * Layouts (element strides):
 *   q       [T, H, D] bf16, row stride q_row, head stride q_head (D contiguous)
 *   pool    one layer: [2, NB, BS, KVH, D] bf16 contiguous; plane 0 = K, plane 1 = V; every key a
 *           query sees is already in it (this step's keys are stored before attention runs)
 *   tables  [S, W] block ids of each sequence, in order
 *   starts, qlens, computed  [S]: first row of the sequence's queries in q and out, their
 *           number, and the position of the first (its cached context length)
 *   out     [T, H * D] bf16 contiguous: each query's row, written in place (other rows untouched)
 * Query at position p attends to keys lo..p, lo = max(0, p - window + 1) (window <= 0: lo = 0).
 * Returns 0, or -1 for a shape it does not cover (the caller keeps SDPA).
 * Built by shared/model/paged_prefill.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAX_D 256   /* head_dim: a multiple of 32 up to this */
#define MAX_ROWS 16 /* query rows per work item */
#define CHUNK 16    /* keys per chunk (at most) */

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "sum16.h"

typedef struct {
    const uint16_t *q, *pool;
    uint16_t *out;
    const int64_t *tables;
    int64_t q_row, q_head, width, H, KVH, G, D, NB, BS, chunk, window;
    float scale2; /* softmax scale x log2(e) */
} Layout;

/* 2^x for x <= 0 (shifted scores): 2^round(x) x a degree-6 polynomial of the remainder
 * (relative error ~1e-7); below -126 the result is ~0, as it should be. */
static inline __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428441e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline const uint16_t *kv_row(const Layout *L, const int64_t *table, int plane,
                                     int64_t key, int64_t kvh) {
    const int64_t block = table[key / L->BS];
    return L->pool + (((plane * L->NB + block) * L->BS + key % L->BS) * L->KVH + kvh) * L->D;
}

/* The chunk's values as pairs of keys interleaved per output element: vp[j][d] = (v[2j][d],
 * v[2j+1][d]), a missing odd key as zeros. D / 16 vectors of 32 bf16 per pair. */
static inline void pair_values(const Layout *L, const int64_t *table, int64_t k0, int n,
                               int64_t kvh, __m512i *vp) {
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
    const int64_t C = L->D / 16;
    for (int j = 0; 2 * j < n; j++) {
        const uint16_t *a = kv_row(L, table, 1, k0 + 2 * j, kvh);
        const uint16_t *b = 2 * j + 1 < n ? kv_row(L, table, 1, k0 + 2 * j + 1, kvh) : NULL;
        for (int64_t c = 0; c < C; c++) {
            const __m512i av = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(a + 16 * c)));
            const __m512i bv = b ? _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(b + 16 * c)))
                                 : _mm512_setzero_si512();
            vp[j * C + c] = _mm512_permutex2var_epi16(av, idx, bv);
        }
    }
}

/* Scores (log2 units) of one query row against the chunk's n keys; lanes past n are junk. */
static inline __m512 scores(const Layout *L, const int64_t *table, const uint16_t *qr,
                            int64_t k0, int n, int64_t kvh) {
    const int64_t C = L->D / 32;
    __m512bh qv[MAX_D / 32];
    for (int64_t c = 0; c < C; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
    __m512 part[16];
    const uint16_t *k = kv_row(L, table, 0, k0, kvh);
    const int64_t stride = L->KVH * L->D; /* consecutive keys of one block */
    for (int t = 0; t < 16; t++) {
        const uint16_t *kt = k + (t < n ? t : 0) * stride;
        __m512 p = _mm512_setzero_ps();
        for (int64_t c = 0; c < C; c++)
            p = _mm512_dpbf16_ps(p, qv[c], (__m512bh)_mm512_loadu_si512(kt + 32 * c));
        part[t] = p;
    }
    return _mm512_mul_ps(sum16_ordered(part), _mm512_set1_ps(L->scale2));
}

typedef struct {
    float m, l;               /* running max (log2 units) and sum of exp2(score - m) */
    float o[MAX_D] __attribute__((aligned(64))); /* running sum of probability x value */
} Row;

/* One row takes one chunk: its valid scores, the online softmax update, probabilities x
 * values. `valid`: lanes whose key this row may see. */
static inline void take_chunk(Row *row, __m512 s, __mmask16 valid, const __m512i *vp, int n,
                              int64_t D) {
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), valid, s);
    const float m_new = fmaxf(row->m, _mm512_reduce_max_ps(s));
    const float alpha = exp2f(row->m - m_new);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp2_neg(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
    row->l = row->l * alpha + _mm512_reduce_add_ps(p);
    row->m = m_new;
    uint32_t pairs[CHUNK / 2];
    _mm256_storeu_si256((void *)pairs, (__m256i)_mm512_cvtneps_pbh(p));
    const int64_t C = D / 16;
    __m512 o[MAX_D / 16];
    const __m512 av = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < C; c++) o[c] = _mm512_mul_ps(_mm512_load_ps(row->o + 16 * c), av);
    for (int j = 0; 2 * j < n; j++) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[j]);
        for (int64_t c = 0; c < C; c++) o[c] = _mm512_dpbf16_ps(o[c], w, (__m512bh)vp[j * C + c]);
    }
    for (int64_t c = 0; c < C; c++) _mm512_store_ps(row->o + 16 * c, o[c]);
}

/* Rows r0..r1-1 of one (sequence, KV head): row r is query r / G, head kvh * G + r % G. */
static void work_item(const Layout *L, const int64_t *table, int64_t start, int64_t computed,
                      int64_t kvh, int64_t r0, int64_t r1) {
    Row rows[MAX_ROWS];
    __m512i vp[(CHUNK / 2) * (MAX_D / 16)];
    const int64_t G = L->G, D = L->D, nrows = r1 - r0;
    for (int64_t r = 0; r < nrows; r++) {
        rows[r].m = -1e30f;
        rows[r].l = 0.0f;
        for (int64_t d = 0; d < D; d++) rows[r].o[d] = 0.0f;
    }
    const int64_t p_first = computed + r0 / G, p_last = computed + (r1 - 1) / G;
    const int64_t lo = L->window > 0 && p_first - L->window + 1 > 0 ? p_first - L->window + 1 : 0;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t k0 = lo - lo % L->chunk; k0 <= p_last; k0 += L->chunk) {
        const int n = (int)(p_last + 1 - k0 < L->chunk ? p_last + 1 - k0 : L->chunk);
        pair_values(L, table, k0, n, kvh, vp);
        const __m512i keys = _mm512_add_epi32(lane, _mm512_set1_epi32((int)k0));
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t i = (r0 + r) / G, pos = computed + i;
            if (k0 > pos || (L->window > 0 && k0 + n - 1 <= pos - L->window)) continue;
            const uint16_t *qr = L->q + (start + i) * L->q_row + (kvh * G + (r0 + r) % G) * L->q_head;
            __mmask16 valid = (__mmask16)((1u << n) - 1);
            valid &= _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32((int)pos));
            if (L->window > 0)
                valid &= _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32((int)(pos - L->window)));
            take_chunk(&rows[r], scores(L, table, qr, k0, n, kvh), valid, vp, n, D);
        }
    }
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t i = (r0 + r) / G, h = kvh * G + (r0 + r) % G;
        uint16_t *dst = L->out + (start + i) * L->H * D + h * D;
        const float inv = 1.0f / rows[r].l;
        for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(rows[r].o[d] * inv);
    }
}

int paged_prefill(const uint16_t *q, const uint16_t *pool, uint16_t *out, const int64_t *tables,
                  const int64_t *starts, const int64_t *qlens, const int64_t *computed,
                  int64_t S, int64_t width, int64_t H, int64_t KVH, int64_t D, int64_t NB,
                  int64_t BS, int64_t q_row, int64_t q_head, float scale, int64_t window,
                  int nthreads) {
    if (S < 1 || H < 1 || KVH < 1 || H % KVH || D % 32 || D > MAX_D || BS < 1) return -1;
    if (BS > CHUNK && BS % CHUNK) return -1; /* a chunk never crosses a block */
    const int64_t G = H / KVH;
    const Layout L = {q, pool, out, tables, q_row, q_head, width, H, KVH, G, D, NB, BS,
                      BS < CHUNK ? BS : CHUNK, window, scale * 1.4426950408889634f};
    /* work items: per sequence, KVH x ceil(qlen * G / MAX_ROWS), numbered in sequence order */
    int64_t *first = malloc((size_t)(S + 1) * sizeof *first);
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < S; s++)
        first[s + 1] = first[s] + KVH * ((qlens[s] * G + MAX_ROWS - 1) / MAX_ROWS);
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(dynamic, 1)
    for (int64_t item = 0; item < first[S]; item++) {
        int64_t s = 0;
        while (first[s + 1] <= item) s++;
        const int64_t local = item - first[s], tiles = (first[s + 1] - first[s]) / KVH;
        const int64_t kvh = local / tiles, r0 = (local % tiles) * MAX_ROWS;
        const int64_t r1 = r0 + MAX_ROWS < qlens[s] * G ? r0 + MAX_ROWS : qlens[s] * G;
        work_item(&L, tables + s * width, starts[s], computed[s], kvh, r0, r1);
    }
    free(first);
    return 0;
}

#else

int paged_prefill(const uint16_t *q, const uint16_t *pool, uint16_t *out, const int64_t *tables,
                  const int64_t *starts, const int64_t *qlens, const int64_t *computed,
                  int64_t S, int64_t width, int64_t H, int64_t KVH, int64_t D, int64_t NB,
                  int64_t BS, int64_t q_row, int64_t q_head, float scale, int64_t window,
                  int nthreads) {
    (void)q, (void)pool, (void)out, (void)tables, (void)starts, (void)qlens, (void)computed;
    (void)S, (void)width, (void)H, (void)KVH, (void)D, (void)NB, (void)BS, (void)q_row;
    (void)q_head, (void)scale, (void)window, (void)nthreads;
    return -1; /* no AVX-512 BF16 on the machine this was built for */
}

#endif
