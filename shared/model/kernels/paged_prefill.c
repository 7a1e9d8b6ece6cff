/* Prefill attention straight from the paged KV pool, bf16 and fp32: a chunk of queries per
 * sequence (fresh, or continuing a cached context) over every key it may see, flash-style
 * (online softmax, nothing T x T materialised).
 *
 * Why hand-written: torch's CPU flash attention runs at 35-65 GFLOP/s in bf16 on AMD Zen 4
 * (docs/performance.md, section 8), a fifth to a third of what the same core's bf16 GEMMs reach,
 * and a prompt continuing a cached prefix also paid a gather of its whole context per layer. In
 * fp32 SDPA was 59% of a 4k-token SmolLM2 prefill on Zen 5 (~69 GFLOP/s, one thread).
 *
 * Work item: one sequence, one KV head, 16 query rows (query x head of that KV head's group:
 * grouped-query attention shares every key and value across a group's rows). The 16 rows live
 * in the 16 lanes of every vector, so nothing is ever reduced across lanes:
 *   - the rows' queries are transposed once (bf16: into pairs of head dimensions, the operand
 *     layout of AVX-512 BF16 dot products; fp32: per dimension), and a key's 16 scores are D/2
 *     dot-product steps (fp32: D FMAs) against that key's pairs (dimensions) broadcast from the
 *     pool, where the key lies (fp32 sums);
 *   - the online softmax (running max and sum, in log2 units so that exp is exp2) is
 *     element-wise across rows;
 *   - probabilities times values: bf16, the probabilities rounded to bf16 for this product (as
 *     torch's bf16 flash kernel does; the normaliser keeps them in fp32), per head dimension
 *     dot-product steps over pairs of keys, each value pair broadcast; fp32, an FMA per key and
 *     dimension with the value broadcast from the pool; into the rows' transposed output.
 * Keys go 32 at a time. Causality and the sliding window are per-lane masks.
 *
 * Layouts (element strides; elements bf16 for paged_prefill, fp32 for paged_prefill_f32):
 *   q       [T, H, D], row stride q_row, head stride q_head (D contiguous)
 *   pool    one layer: [2, NB, BS, KVH, D] contiguous; plane 0 = K, plane 1 = V; every key a
 *           query sees is already in it (this step's keys are stored before attention runs)
 *   tables  [S, W] block ids of each sequence, in order
 *   starts, qlens, computed  [S]: first row of the sequence's queries in q and out, their
 *           number, and the position of the first (its cached context length)
 *   out     [T, H * D] contiguous: each query's row, written in place (other rows untouched)
 * Query at position p attends to keys lo..p, lo = max(0, p - window + 1) (window <= 0: lo = 0).
 * Returns 0, or -1 for a shape or a type this build does not cover (the caller keeps SDPA).
 * Built by shared/model/paged_prefill.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256 /* head_dim: even, up to this; a multiple of 16 */
#define LANES 16  /* query rows per work item */
#define KEYS 32   /* keys per step of the online softmax */
#define GROUP 8   /* keys whose scores are accumulated together */

#if defined(__AVX512F__)
#include <immintrin.h>

#include "exp2.h"

typedef struct {
    const char *q, *pool;
    char *out;
    int64_t q_row, q_head, H, KVH, G, D, NB, BS, window, esize; /* esize: 2 bf16, 4 fp32 */
    float scale2; /* softmax scale x log2(e) */
} Layout;

/* One work item's state: the rows' queries transposed, and the running softmax. */
typedef struct {
    __m512i qt[MAX_D];         /* lane r: bf16 (q[r][2p], q[r][2p+1]) at p; fp32 q[r][d] at d */
    __m512 ot[MAX_D];          /* lane r: running sum of probability x value, dimension d */
    __m512 s[KEYS];            /* lane r: this step's scores (log2 units), then probabilities */
    __m512i p2[KEYS / 2];      /* bf16: probabilities of keys 2j and 2j + 1 */
    uint32_t v2[KEYS / 2][MAX_D]; /* bf16: values of keys 2j and 2j + 1, dimension d */
    __mmask16 valid[KEYS];     /* rows that may see key k of this step */
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

/* Scores of keys k0..k0+n-1 for every lane, GROUP keys at a time (a missing key repeats the
 * last one; it is masked later). `words`: 32-bit words of a key (bf16: dimension pairs, taken
 * as dot products; fp32: dimensions, as FMAs). */
static inline __attribute__((always_inline)) void score_keys(const Layout *L, int n, Work *w,
                                                             const int f32) {
    const int64_t words = f32 ? L->D : L->D / 2;
    const __m512 scale = _mm512_set1_ps(L->scale2);
    for (int g0 = 0; g0 < n; g0 += GROUP) {
        const uint32_t *kp[GROUP];
        for (int j = 0; j < GROUP; j++)
            kp[j] = (const uint32_t *)w->k[g0 + j < n ? g0 + j : n - 1];
        __m512 acc[GROUP];
        for (int j = 0; j < GROUP; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t p = 0; p < words; p++) {
            for (int j = 0; j < GROUP; j++) {
                const __m512i kb = _mm512_set1_epi32((int)kp[j][p]);
#if defined(__AVX512BF16__)
                if (!f32) {
                    acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)w->qt[p], (__m512bh)kb);
                    continue;
                }
#endif
                acc[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(w->qt[p]), _mm512_castsi512_ps(kb),
                                         acc[j]);
            }
        }
        for (int j = 0; j < GROUP && g0 + j < n; j++) w->s[g0 + j] = _mm512_mul_ps(acc[j], scale);
    }
}

/* One step of the online softmax over keys k0..k0+n-1: new max, rescale, probabilities (in
 * w->s); returns the sum of this step's probabilities per lane. */
static inline __m512 softmax_step(Work *w, int n, __m512 *m, __m512 *alpha) {
    __m512 mx = *m;
    for (int k = 0; k < n; k++) {
        w->s[k] = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), w->valid[k], w->s[k]);
        mx = _mm512_max_ps(mx, w->s[k]);
    }
    *alpha = exp2_neg(_mm512_sub_ps(*m, mx));
    *m = mx;
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < n; k++) {
        w->s[k] = _mm512_maskz_mov_ps(w->valid[k], exp2_neg(_mm512_sub_ps(w->s[k], mx)));
        sum = _mm512_add_ps(sum, w->s[k]);
    }
    return sum;
}

/* fp32: ot = ot x alpha + probabilities x values, 16 dimensions at a time in registers, each
 * value broadcast from the pool where it lies. */
static inline void add_values_f32(const Layout *L, int n, __m512 alpha, Work *w) {
    for (int64_t d0 = 0; d0 < L->D; d0 += 16) {
        __m512 acc[16];
        for (int dd = 0; dd < 16; dd++) acc[dd] = _mm512_mul_ps(w->ot[d0 + dd], alpha);
        for (int k = 0; k < n; k++) {
            const float *v = (const float *)w->v[k] + d0;
            for (int dd = 0; dd < 16; dd++)
                acc[dd] = _mm512_fmadd_ps(w->s[k], _mm512_set1_ps(v[dd]), acc[dd]);
        }
        for (int dd = 0; dd < 16; dd++) w->ot[d0 + dd] = acc[dd];
    }
}

#if defined(__AVX512BF16__)
/* bf16: the step's values as key pairs per dimension (a missing odd key as zeros). */
static inline void pair_values(const Layout *L, int n, Work *w) {
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
    for (int j = 0; 2 * j < n; j++) {
        const uint16_t *a = (const uint16_t *)w->v[2 * j];
        const uint16_t *b = 2 * j + 1 < n ? (const uint16_t *)w->v[2 * j + 1] : NULL;
        for (int64_t d = 0; d < L->D; d += 16) {
            const __m512i av = _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(a + d)));
            const __m512i bv =
                b ? _mm512_castsi256_si512(_mm256_loadu_si256((const void *)(b + d)))
                  : _mm512_setzero_si512();
            _mm512_storeu_si512(w->v2[j] + d, _mm512_permutex2var_epi16(av, idx, bv));
        }
    }
}

/* bf16: the step's probabilities as key pairs (rounded to bf16 for this product, as torch's bf16
 * flash kernel does; the normaliser keeps them in fp32). */
static inline void pair_probabilities(Work *w, int n) {
    /* lanes of cvtne2ps: key 2j in elements 0-15, key 2j+1 in 16-31; interleave per row */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    for (int j = 0; 2 * j < n; j++) {
        const __m512 odd = 2 * j + 1 < n ? w->s[2 * j + 1] : _mm512_setzero_ps();
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, w->s[2 * j]);
        w->p2[j] = _mm512_permutexvar_epi16(idx, both);
    }
}

/* bf16: ot = ot x alpha + probabilities x values, 16 dimensions at a time in registers. */
static inline void add_values_bf16(const Layout *L, int n, __m512 alpha, Work *w) {
    const int pairs = (n + 1) / 2;
    for (int64_t d0 = 0; d0 < L->D; d0 += 16) {
        __m512 acc[16];
        for (int dd = 0; dd < 16; dd++) acc[dd] = _mm512_mul_ps(w->ot[d0 + dd], alpha);
        for (int j = 0; j < pairs; j++) {
            const __m512bh pj = (__m512bh)w->p2[j];
            const uint32_t *v = w->v2[j] + d0;
            for (int dd = 0; dd < 16; dd++)
                acc[dd] = _mm512_dpbf16_ps(acc[dd], pj, (__m512bh)_mm512_set1_epi32((int)v[dd]));
        }
        for (int dd = 0; dd < 16; dd++) w->ot[d0 + dd] = acc[dd];
    }
}
#endif

/* probabilities x values into ot, in the element type's way */
static inline __attribute__((always_inline)) void add_values(const Layout *L, int n,
                                                             __m512 alpha, Work *w,
                                                             const int f32) {
    (void)f32; /* only read where bf16 is built */
#if defined(__AVX512BF16__)
    if (!f32) {
        pair_values(L, n, w);
        pair_probabilities(w, n);
        add_values_bf16(L, n, alpha, w);
        return;
    }
#endif
    add_values_f32(L, n, alpha, w);
}

/* Row `row` of KV head kvh's work items: query row / G of the sequence's chunk, head
 * kvh * G + row % G (grouped-query attention: a KV head's G query heads are consecutive rows). */
static inline void place(const Layout *L, int64_t kvh, int64_t row, int64_t *query,
                         int64_t *head) {
    *query = row / L->G;
    *head = kvh * L->G + row % L->G;
}

/* Each row's output (lane r of ot[0..D-1], times 1 / its softmax sum in `inv`) stored as one
 * contiguous run, gathered 16 dimensions at a time from the lanes (bf16: rounded to nearest
 * even). A scalar store per row and dimension, with the row's place found by division each
 * time, took a third of the bf16 kernel's time at 512-token prompts. */
static inline __attribute__((always_inline)) void store_rows(const Layout *L, int64_t start,
                                                             int64_t kvh, int64_t r0, int nrows,
                                                             __m512 inv, const Work *w,
                                                             const int f32) {
    (void)f32; /* only read where bf16 is built */
    const float *ot = (const float *)w->ot; /* ot[d] lane r at ot[d * LANES + r] */
    const __m512i dims = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(LANES));
    float invs[LANES];
    _mm512_storeu_ps(invs, inv);
    for (int r = 0; r < nrows; r++) {
        int64_t i, h;
        place(L, kvh, r0 + r, &i, &h);
        char *dst = L->out + ((start + i) * L->H * L->D + h * L->D) * L->esize;
        const __m512 scale = _mm512_set1_ps(invs[r]);
        for (int64_t d0 = 0; d0 < L->D; d0 += 16) {
            const __m512i at = _mm512_add_epi32(dims, _mm512_set1_epi32((int)(d0 * LANES + r)));
            const __m512 o = _mm512_mul_ps(_mm512_i32gather_ps(at, ot, 4), scale);
#if defined(__AVX512BF16__)
            if (!f32) {
                _mm256_storeu_si256((void *)(dst + d0 * 2), (__m256i)_mm512_cvtneps_pbh(o));
                continue;
            }
#endif
            _mm512_storeu_ps(dst + d0 * 4, o);
        }
    }
}

/* Rows r0..r0+nrows-1 (nrows <= LANES) of one (sequence, KV head), placed by `place`. */
static inline __attribute__((always_inline)) void work_item(const Layout *L,
                                                            const int64_t *table, int64_t start,
                                                            int64_t computed, int64_t kvh,
                                                            int64_t r0, int nrows, Work *w,
                                                            const int f32) {
    const int64_t G = L->G, D = L->D, words = f32 ? D : D / 2;
    uint32_t rows[LANES][MAX_D];
    int32_t pos[LANES];
    for (int r = 0; r < LANES; r++) {
        if (r < nrows) {
            int64_t i, h;
            place(L, kvh, r0 + r, &i, &h);
            memcpy(rows[r], L->q + ((start + i) * L->q_row + h * L->q_head) * L->esize,
                   (size_t)(D * L->esize));
            pos[r] = (int32_t)(computed + i);
        } else {
            memset(rows[r], 0, (size_t)(D * L->esize));
            pos[r] = -1; /* sees no key */
        }
    }
    for (int64_t p = 0; p < words; p++) {
        uint32_t col[LANES];
        for (int r = 0; r < LANES; r++) col[r] = rows[r][p];
        w->qt[p] = _mm512_loadu_si512(col);
    }
    for (int64_t d = 0; d < D; d++) w->ot[d] = _mm512_setzero_ps();
    const __m512i posv = _mm512_loadu_si512(pos);
    const int64_t first = computed + r0 / G, last = computed + (r0 + nrows - 1) / G;
    const int64_t lo = L->window > 0 && first - L->window + 1 > 0 ? first - L->window + 1 : 0;
    __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps(), alpha;
    for (int64_t k0 = lo; k0 <= last; k0 += KEYS) {
        const int n = (int)(last + 1 - k0 < KEYS ? last + 1 - k0 : KEYS);
        for (int k = 0; k < n; k++) {
            const __m512i key = _mm512_set1_epi32((int)(k0 + k));
            __mmask16 v = _mm512_cmple_epi32_mask(key, posv);
            if (L->window > 0)
                v &= _mm512_cmpgt_epi32_mask(
                    key, _mm512_sub_epi32(posv, _mm512_set1_epi32((int)L->window)));
            w->valid[k] = v;
        }
        locate(L, table, kvh, k0, n, w);
        score_keys(L, n, w, f32);
        const __m512 sum = softmax_step(w, n, &m, &alpha);
        l = _mm512_fmadd_ps(l, alpha, sum);
        add_values(L, n, alpha, w, f32);
    }
    store_rows(L, start, kvh, r0, nrows, _mm512_div_ps(_mm512_set1_ps(1.0f), l), w, f32);
}

static void work_item_bf16(const Layout *L, const int64_t *table, int64_t start,
                           int64_t computed, int64_t kvh, int64_t r0, int nrows, Work *w) {
    work_item(L, table, start, computed, kvh, r0, nrows, w, 0);
}

static void work_item_f32(const Layout *L, const int64_t *table, int64_t start, int64_t computed,
                          int64_t kvh, int64_t r0, int nrows, Work *w) {
    work_item(L, table, start, computed, kvh, r0, nrows, w, 1);
}

static int run(const Layout *L, const int64_t *tables, const int64_t *starts,
               const int64_t *qlens, const int64_t *computed, int64_t S, int64_t width,
               int nthreads) {
    const int64_t G = L->G, KVH = L->KVH;
    /* work items: per sequence, KVH x ceil(qlen * G / LANES), numbered in sequence order */
    int64_t *first = malloc((size_t)(S + 1) * sizeof *first);
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < S; s++)
        first[s + 1] = first[s] + KVH * ((qlens[s] * G + LANES - 1) / LANES);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && first[S] > 1)
    {
        Work *w = aligned_alloc(64, sizeof(Work));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < first[S]; item++) {
            if (w == NULL) continue;
            int64_t s = 0;
            while (first[s + 1] <= item) s++;
            const int64_t local = item - first[s], tiles = (first[s + 1] - first[s]) / KVH;
            const int64_t kvh = local / tiles, r0 = (local % tiles) * LANES;
            const int64_t left = qlens[s] * G - r0;
            const int nrows = (int)(left < LANES ? left : LANES);
            if (L->esize == 4)
                work_item_f32(L, tables + s * width, starts[s], computed[s], kvh, r0, nrows, w);
            else
                work_item_bf16(L, tables + s * width, starts[s], computed[s], kvh, r0, nrows, w);
        }
        free(w);
    }
    free(first);
    return failed ? -1 : 0;
}

/* Both entry points: the arguments of the layouts above, elements of their type. */
#define ENTRY(NAME, T, ESIZE, COVERED)                                                            \
    int NAME(const T *q, const T *pool, T *out, const int64_t *tables, const int64_t *starts,     \
             const int64_t *qlens, const int64_t *computed, int64_t S, int64_t width, int64_t H,  \
             int64_t KVH, int64_t D, int64_t NB, int64_t BS, int64_t q_row, int64_t q_head,       \
             float scale, int64_t window, int nthreads) {                                         \
        if (!(COVERED) || S < 1 || H < 1 || KVH < 1 || H % KVH || D % 16 || D > MAX_D || BS < 1)  \
            return -1;                                                                            \
        const Layout L = {(const char *)q, (const char *)pool, (char *)out, q_row, q_head, H,     \
                          KVH, H / KVH, D, NB, BS, window, ESIZE,                                 \
                          scale * 1.4426950408889634f};                                           \
        return run(&L, tables, starts, qlens, computed, S, width, nthreads);                     \
    }

#if defined(__AVX512BF16__)
ENTRY(paged_prefill, uint16_t, 2, 1)
#else
ENTRY(paged_prefill, uint16_t, 2, 0) /* built without AVX-512 BF16: bf16 is not covered */
#endif
ENTRY(paged_prefill_f32, float, 4, 1)

#else

/* built without AVX-512: neither type is covered (the caller keeps SDPA) */
#define MISSING(NAME, T)                                                                          \
    int NAME(const T *q, const T *pool, T *out, const int64_t *tables, const int64_t *starts,     \
             const int64_t *qlens, const int64_t *computed, int64_t S, int64_t width, int64_t H,  \
             int64_t KVH, int64_t D, int64_t NB, int64_t BS, int64_t q_row, int64_t q_head,       \
             float scale, int64_t window, int nthreads) {                                         \
        (void)q, (void)pool, (void)out, (void)tables, (void)starts, (void)qlens, (void)computed;  \
        (void)S, (void)width, (void)H, (void)KVH, (void)D, (void)NB, (void)BS, (void)q_row;       \
        (void)q_head, (void)scale, (void)window, (void)nthreads;                                  \
        return -1;                                                                                \
    }
MISSING(paged_prefill, uint16_t)
MISSING(paged_prefill_f32, float)

#endif
