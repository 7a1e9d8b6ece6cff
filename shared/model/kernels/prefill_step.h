/* One step of paged prefill attention (paged_prefill.c): a work item's state, and what it does
 * with each 32 keys: where they lie, their scores, the online softmax, probabilities x values.
 * Split from paged_prefill.c, which includes it, to keep each file one concept: this one the
 * arithmetic on registers, that one the work items, their rows and the call's plan. */
#ifndef PDSERVE_PREFILL_STEP_H
#define PDSERVE_PREFILL_STEP_H

#include <stddef.h>
#include <stdint.h>

#define MAX_D 256 /* head_dim: even, up to this; a multiple of 16 */
#define LANES 16  /* query rows per vector */
#define NV 2      /* vectors of rows per work item, at most */
#define KEYS 32   /* keys per step of the online softmax */
#define GROUP 8   /* keys whose scores are accumulated together */
#define AI __attribute__((always_inline))

#if defined(__AVX512F__)
#include <immintrin.h>

#include "exp2.h"

typedef struct {
    const char *q, *pool;
    char *out;
    int64_t q_row, q_head, H, KVH, G, D, NB, BS, window, esize; /* esize: 2 bf16, 4 fp32 */
    float scale2; /* softmax scale x log2(e) */
} Layout;

/* One work item's state: the rows' queries transposed, and the running softmax. Row
 * v * LANES + r is lane r of vector v. */
typedef struct {
    __m512i qt[MAX_D][NV];     /* bf16 (q[2p], q[2p+1]) at p; fp32 q[d] at d */
    __m512 ot[MAX_D][NV];      /* running sum of probability x value, dimension d */
    __m512 s[KEYS][NV];        /* this step's scores (log2 units), then probabilities */
    __m512i p2[KEYS / 2][NV];  /* bf16: probabilities of keys 2j and 2j + 1 */
    __mmask16 valid[KEYS][NV]; /* rows that may see key k of this step */
    const char *k[KEYS], *v[KEYS]; /* where key k of this step and its value lie */
} Work;

/* Where keys k0..k0+n-1 and their values lie (one division per step, not per key). */
static inline void locate(const Layout *L, const int64_t *table, int64_t kvh, int64_t k0, int n,
                          Work *w) {
    const int64_t row = L->KVH * L->D, plane = L->NB * L->BS * row * L->esize;
    int64_t b = k0 / L->BS, off = k0 % L->BS;
    for (int k = 0; k < n; k++) {
        w->k[k] = L->pool + ((table[b] * L->BS + off) * row + kvh * L->D) * L->esize;
        w->v[k] = w->k[k] + plane;
        if (++off == L->BS) off = 0, b++;
    }
}

/* acc + a . b per lane: bf16, a and b hold pairs (one dot-product step); fp32, one FMA. */
static inline AI __m512 dot(__m512 acc, __m512i a, __m512i b, const int f32) {
    (void)f32; /* only read where bf16 is built */
#if defined(__AVX512BF16__)
    if (!f32) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#endif
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

/* Scores of keys k0..k0+n-1 for every row, GROUP keys x nv vectors in registers (a missing key
 * repeats the last one; it is masked later): each key word broadcast from the pool feeds nv
 * products, each query word loaded feeds GROUP. `words`: 32-bit words of a key (bf16: dimension
 * pairs; fp32: dimensions). One vector with GROUP keys ran at two thirds of the dot products'
 * rate: eight sums in flight do not cover their latency. */
static inline AI void score_keys(const Layout *L, int n, Work *w, const int f32, const int nv) {
    const int64_t words = f32 ? L->D : L->D / 2;
    const __m512 scale = _mm512_set1_ps(L->scale2);
    for (int g0 = 0; g0 < n; g0 += GROUP) {
        const uint32_t *kp[GROUP];
        for (int j = 0; j < GROUP; j++)
            kp[j] = (const uint32_t *)w->k[g0 + j < n ? g0 + j : n - 1];
        __m512 acc[GROUP][NV];
        for (int j = 0; j < GROUP; j++)
            for (int v = 0; v < nv; v++) acc[j][v] = _mm512_setzero_ps();
        for (int64_t p = 0; p < words; p++) {
            for (int j = 0; j < GROUP; j++) {
                const __m512i kb = _mm512_set1_epi32((int)kp[j][p]);
                for (int v = 0; v < nv; v++) acc[j][v] = dot(acc[j][v], w->qt[p][v], kb, f32);
            }
        }
        for (int j = 0; j < GROUP && g0 + j < n; j++)
            for (int v = 0; v < nv; v++) w->s[g0 + j][v] = _mm512_mul_ps(acc[j][v], scale);
    }
}

/* One step of the online softmax over keys k0..k0+n-1 for vector v: new max, rescale,
 * probabilities (in w->s); returns the sum of this step's probabilities per lane. The rows that
 * may see key k: w->valid[k][v], or `rows` for every key of a `whole` step. */
static inline __m512 softmax_step(Work *w, int n, int v, int whole, __mmask16 rows, __m512 *m,
                                  __m512 *alpha) {
    __m512 mx = *m;
    for (int k = 0; k < n; k++) {
        const __mmask16 ok = whole ? rows : w->valid[k][v];
        w->s[k][v] = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), ok, w->s[k][v]);
        mx = _mm512_max_ps(mx, w->s[k][v]);
    }
    *alpha = exp2_neg(_mm512_sub_ps(*m, mx));
    *m = mx;
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < n; k++) {
        const __mmask16 ok = whole ? rows : w->valid[k][v];
        w->s[k][v] = _mm512_maskz_mov_ps(ok, exp2_neg(_mm512_sub_ps(w->s[k][v], mx)));
        sum = _mm512_add_ps(sum, w->s[k][v]);
    }
    return sum;
}

#if defined(__AVX512BF16__)
/* bf16: a sequence's values of one KV head as key pairs per dimension, keys from..N-1 (`from`
 * even; a missing last key as zeros): pairs[j][d] = (v[from + 2j][d], v[from + 2j + 1][d]), the
 * operand layout of the dot products. Done once per call, not per work item: pairing each step's
 * values in every item took an eighth of the kernel's time. */
static void pair_values(const Layout *L, const int64_t *table, int64_t kvh, int64_t from,
                        int64_t N, uint32_t *pairs) {
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
    const int64_t row = L->KVH * L->D, plane = L->NB * L->BS * row * L->esize;
    for (int64_t j = 0; from + 2 * j < N; j++) {
        const uint16_t *v[2] = {NULL, NULL};
        for (int i = 0; i < 2 && from + 2 * j + i < N; i++) {
            const int64_t key = from + 2 * j + i, b = table[key / L->BS], off = key % L->BS;
            v[i] = (const uint16_t *)(L->pool + plane + ((b * L->BS + off) * row + kvh * L->D) * 2);
        }
        for (int64_t d = 0; d < L->D; d += 16) {
            const __m512i av = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(v[0] + d)));
            const __m512i bv =
                v[1] ? _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(v[1] + d)))
                     : _mm512_setzero_si512();
            _mm512_storeu_si512(pairs + j * L->D + d, _mm512_permutex2var_epi16(av, idx, bv));
        }
    }
}

/* bf16: the step's probabilities as key pairs (rounded to bf16 for this product, as torch's bf16
 * flash kernel does; the normaliser keeps them in fp32). */
static inline void pair_probabilities(Work *w, int n, int nv) {
    /* lanes of cvtne2ps: key 2j in elements 0-15, key 2j+1 in 16-31; interleave per row */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    for (int j = 0; 2 * j < n; j++) {
        for (int v = 0; v < nv; v++) {
            const __m512 odd = 2 * j + 1 < n ? w->s[2 * j + 1][v] : _mm512_setzero_ps();
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, w->s[2 * j][v]);
            w->p2[j][v] = _mm512_permutexvar_epi16(idx, both);
        }
    }
}
#endif

/* ot = ot x alpha + probabilities x values, `dims` dimensions x nv vectors in registers: per
 * step, the probabilities (bf16: of a key pair; fp32: of a key) times each dimension's value
 * word broadcast (bf16: the pair's, from `pairs`, this step's first; fp32: the key's, from the
 * pool). */
static inline AI void add_values(const Layout *L, int n, const __m512 *alpha,
                                 const uint32_t *pairs, Work *w, const int f32, const int nv) {
    const int dims = nv > 1 ? 8 : 16, steps = f32 ? n : (n + 1) / 2;
#if defined(__AVX512BF16__)
    if (!f32) pair_probabilities(w, n, nv);
#endif
    for (int64_t d0 = 0; d0 < L->D; d0 += dims) {
        __m512 acc[16][NV];
        for (int dd = 0; dd < dims; dd++)
            for (int v = 0; v < nv; v++) acc[dd][v] = _mm512_mul_ps(w->ot[d0 + dd][v], alpha[v]);
        for (int j = 0; j < steps; j++) {
            const uint32_t *val = f32 ? (const uint32_t *)w->v[j] + d0 : pairs + j * L->D + d0;
            __m512i a[NV];
            for (int v = 0; v < nv; v++) a[v] = f32 ? _mm512_castps_si512(w->s[j][v]) : w->p2[j][v];
            for (int dd = 0; dd < dims; dd++) {
                const __m512i b = _mm512_set1_epi32((int)val[dd]);
                for (int v = 0; v < nv; v++) acc[dd][v] = dot(acc[dd][v], a[v], b, f32);
            }
        }
        for (int dd = 0; dd < dims; dd++)
            for (int v = 0; v < nv; v++) w->ot[d0 + dd][v] = acc[dd][v];
    }
}

#endif /* __AVX512F__ */
#endif
