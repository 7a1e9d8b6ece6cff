/* Prefill attention straight from the paged KV pool, bf16 and fp32: a chunk of queries per
 * sequence (fresh, or continuing a cached context) over every key it may see, flash-style
 * (online softmax, nothing T x T materialised).
 *
 * Why hand-written: torch's CPU flash attention runs at 35-65 GFLOP/s in bf16 on AMD Zen 4
 * (docs/performance.md, "Kernels"), a fifth to a third of what the same core's bf16 GEMMs reach,
 * and a prompt continuing a cached prefix also paid a gather of its whole context per layer. In
 * fp32 SDPA was 59% of a 4k-token SmolLM2 prefill on Zen 5 (~69 GFLOP/s, one thread).
 *
 * Work item: one sequence, one KV head, up to 32 query rows (query x head of that KV head's
 * group: grouped-query attention shares every key and value across a group's rows). The rows
 * live in the 16 lanes of one or two vectors, so nothing is ever reduced across lanes:
 *   - the rows' queries are transposed once (bf16: into pairs of head dimensions, the operand
 *     layout of AVX-512 BF16 dot products; fp32: per dimension), and a key's scores are D/2
 *     dot-product steps (fp32: D FMAs) against that key's pairs (dimensions) broadcast from the
 *     pool, where the key lies (fp32 sums);
 *   - the online softmax (running max and sum, in log2 units so that exp is exp2) is
 *     element-wise across rows;
 *   - probabilities times values: bf16, the probabilities rounded to bf16 for this product (as
 *     torch's bf16 flash kernel does; the normaliser keeps them in fp32), per head dimension
 *     dot-product steps over pairs of keys, each value pair broadcast from a copy of the values
 *     paired once per call; fp32, an FMA per key and dimension with the value broadcast from the
 *     pool; into the rows' transposed output.
 * Two vectors of rows let every broadcast word feed two products and keep sixteen sums in flight:
 * one vector (16 rows) ran the products at about half the GEMMs' rate, on broadcasts and on the
 * latency of eight chained sums. Keys go 32 at a time. Causality and the sliding window are
 * per-lane masks.
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

#include "prefill_step.h"

#if defined(__AVX512F__)

/* Row `row` of KV head kvh's work items: query row / G of the sequence's chunk, head
 * kvh * G + row % G (grouped-query attention: a KV head's G query heads are consecutive rows). */
static inline void place(const Layout *L, int64_t kvh, int64_t row, int64_t *query,
                         int64_t *head) {
    *query = row / L->G;
    *head = kvh * L->G + row % L->G;
}

/* Each row's output (its lane of ot[0..D-1], times 1 / its softmax sum in `inv`) stored as one
 * contiguous run, gathered 16 dimensions at a time from the lanes (bf16: rounded to nearest
 * even). A scalar store per row and dimension, with the row's place found by division each
 * time, took a third of the bf16 kernel's time at 512-token prompts. */
static inline AI void store_rows(const Layout *L, int64_t start, int64_t kvh, int64_t r0,
                                 int nrows, const __m512 *inv, const Work *w, const int f32) {
    (void)f32; /* only read where bf16 is built */
    const float *ot = (const float *)w->ot; /* dimension d, row r at ot[d * NV * LANES + r] */
    const __m512i dims = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(NV * LANES));
    float invs[NV * LANES];
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(invs + v * LANES, inv[v]);
    for (int r = 0; r < nrows; r++) {
        int64_t i, h;
        place(L, kvh, r0 + r, &i, &h);
        char *dst = L->out + ((start + i) * L->H * L->D + h * L->D) * L->esize;
        const __m512 scale = _mm512_set1_ps(invs[r]);
        for (int64_t d0 = 0; d0 < L->D; d0 += 16) {
            const __m512i at =
                _mm512_add_epi32(dims, _mm512_set1_epi32((int)(d0 * NV * LANES + r)));
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

/* The rows' queries transposed into w->qt (rows past nrows zero), their positions in pos (-1:
 * sees no key). */
static inline void load_queries(const Layout *L, int64_t start, int64_t computed, int64_t kvh,
                                int64_t r0, int nrows, int nv, Work *w, int32_t *pos) {
    const int64_t words = L->esize == 4 ? L->D : L->D / 2;
    uint32_t rows[NV * LANES][MAX_D];
    for (int r = 0; r < nv * LANES; r++) {
        if (r < nrows) {
            int64_t i, h;
            place(L, kvh, r0 + r, &i, &h);
            memcpy(rows[r], L->q + ((start + i) * L->q_row + h * L->q_head) * L->esize,
                   (size_t)(L->D * L->esize));
            pos[r] = (int32_t)(computed + i);
        } else {
            memset(rows[r], 0, (size_t)(L->D * L->esize));
            pos[r] = -1;
        }
    }
    for (int64_t p = 0; p < words; p++) {
        for (int v = 0; v < nv; v++) {
            uint32_t col[LANES];
            for (int r = 0; r < LANES; r++) col[r] = rows[v * LANES + r][p];
            w->qt[p][v] = _mm512_loadu_si512(col);
        }
    }
}

/* The first key a query at `position` may see (window), rounded down to a key pair: where a work
 * item's steps start, and (for the sequence's first query) where its value pairs start. */
static inline int64_t first_pair_key(const Layout *L, int64_t position) {
    const int64_t lo = L->window > 0 && position - L->window + 1 > 0 ? position - L->window + 1 : 0;
    return lo & ~(int64_t)1;
}

/* Value pairs of one (sequence, KV head): its keys from first_pair_key(its first query) on. */
static inline int64_t pair_count(const Layout *L, int64_t computed, int64_t qlen) {
    return (computed + qlen - first_pair_key(L, computed) + 1) / 2;
}

/* Where sequence s's value pairs for KV head kvh start in the call's pairs buffer (`paired`:
 * plan's offsets, each sequence's KVH equal shares). */
static inline uint32_t *pairs_of(const Layout *L, uint32_t *pairs, const int64_t *paired,
                                 int64_t s, int64_t kvh) {
    return pairs + paired[s] + kvh * ((paired[s + 1] - paired[s]) / L->KVH);
}

/* Rows r0..r0+nrows-1 (nrows <= nv x LANES) of one (sequence, KV head), placed by `place`;
 * bf16 reads values from that (sequence, KV head)'s `pairs` (fp32: NULL). */
static inline AI void work_item(const Layout *L, const int64_t *table, const uint32_t *pairs,
                                int64_t start, int64_t computed, int64_t kvh, int64_t r0,
                                int nrows, Work *w, const int f32, const int nv) {
    int32_t pos[NV * LANES];
    load_queries(L, start, computed, kvh, r0, nrows, nv, w, pos);
    __m512i posv[NV];
    __m512 m[NV], l[NV], alpha[NV];
    __mmask16 exists[NV]; /* the rows of each vector that hold a query */
    for (int v = 0; v < nv; v++) {
        posv[v] = _mm512_loadu_si512(pos + v * LANES);
        exists[v] = _mm512_cmpge_epi32_mask(posv[v], _mm512_setzero_si512());
        m[v] = _mm512_set1_ps(-1e30f), l[v] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < L->D; d++)
        for (int v = 0; v < nv; v++) w->ot[d][v] = _mm512_setzero_ps();
    const int64_t first = computed + r0 / L->G, last = computed + (r0 + nrows - 1) / L->G;
    /* steps start at a key pair (a key before the window is masked) */
    const int64_t lo = first_pair_key(L, first), paired_from = first_pair_key(L, computed);
    for (int64_t k0 = lo; k0 <= last; k0 += KEYS) {
        const int n = (int)(last + 1 - k0 < KEYS ? last + 1 - k0 : KEYS);
        /* a step every row sees whole (before the diagonal, inside the window) needs no masks
         * per key: one for the rows that exist */
        const int whole = k0 + n - 1 <= first && (L->window <= 0 || k0 > last - L->window);
        for (int k = 0; k < n && !whole; k++) {
            const __m512i key = _mm512_set1_epi32((int)(k0 + k));
            for (int v = 0; v < nv; v++) {
                __mmask16 ok = _mm512_cmple_epi32_mask(key, posv[v]);
                if (L->window > 0)
                    ok &= _mm512_cmpgt_epi32_mask(
                        key, _mm512_sub_epi32(posv[v], _mm512_set1_epi32((int)L->window)));
                w->valid[k][v] = ok;
            }
        }
        locate(L, table, kvh, k0, n, w);
        score_keys(L, n, w, f32, nv);
        for (int v = 0; v < nv; v++) {
            const __m512 sum = softmax_step(w, n, v, whole, exists[v], &m[v], &alpha[v]);
            l[v] = _mm512_fmadd_ps(l[v], alpha[v], sum);
        }
        const uint32_t *step_pairs = f32 ? NULL : pairs + (k0 - paired_from) / 2 * L->D;
        add_values(L, n, alpha, step_pairs, w, f32, nv);
    }
    __m512 inv[NV] = {_mm512_setzero_ps()};
    for (int v = 0; v < nv; v++) inv[v] = _mm512_div_ps(_mm512_set1_ps(1.0f), l[v]);
    store_rows(L, start, kvh, r0, nrows, inv, w, f32);
}

/* The four instances: element type x vectors of rows (an item of at most 16 rows, a short
 * chunk's, keeps one vector's registers and work). */
typedef void (*Item)(const Layout *, const int64_t *, const uint32_t *, int64_t, int64_t,
                     int64_t, int64_t, int, Work *);
#define INSTANCE(NAME, F32, VECTORS)                                                              \
    static void NAME(const Layout *L, const int64_t *table, const uint32_t *pairs, int64_t start, \
                     int64_t computed, int64_t kvh, int64_t r0, int nrows, Work *w) {             \
        work_item(L, table, pairs, start, computed, kvh, r0, nrows, w, F32, VECTORS);             \
    }
INSTANCE(item_bf16_1, 0, 1)
INSTANCE(item_bf16_2, 0, 2)
INSTANCE(item_f32_1, 1, 1)
INSTANCE(item_f32_2, 1, 2)
static const Item ITEMS[2][NV] = {{item_bf16_1, item_bf16_2}, {item_f32_1, item_f32_2}};

/* The call's plan: first[s], the number of the sequence's first work item (per sequence, KVH x
 * ceil(qlen * G / ROWS), in sequence order; first[S] all of them), and paired[s], where the
 * sequence's value pairs start in the bf16 pairs buffer (KVH x pair_count x D words: the keys
 * its queries may see; paired[S] the buffer's size, that of those values in the pool, allocated
 * and freed by each call; a failed allocation returns -1 and the caller runs SDPA). */
static void plan(const Layout *L, const int64_t *qlens, const int64_t *computed, int64_t S,
                 int64_t *first, int64_t *paired) {
    const int64_t ROWS = NV * LANES;
    first[0] = paired[0] = 0;
    for (int64_t s = 0; s < S; s++) {
        first[s + 1] = first[s] + L->KVH * ((qlens[s] * L->G + ROWS - 1) / ROWS);
        paired[s + 1] = paired[s] + L->KVH * pair_count(L, computed[s], qlens[s]) * L->D;
    }
}

static int run(const Layout *L, const int64_t *tables, const int64_t *starts,
               const int64_t *qlens, const int64_t *computed, int64_t S, int64_t width,
               int nthreads) {
    const int64_t KVH = L->KVH, ROWS = NV * LANES, f32 = L->esize == 4;
    int64_t *first = malloc((size_t)(2 * S + 2) * sizeof *first), *paired = first + S + 1;
    if (first == NULL) return -1;
    plan(L, qlens, computed, S, first, paired);
    uint32_t *pairs = f32 ? NULL : malloc((size_t)paired[S] * sizeof *pairs);
    int failed = !f32 && pairs == NULL;
#pragma omp parallel num_threads(nthreads) if (!failed && nthreads > 1 && first[S] > 1)
    {
        Work *w = failed ? NULL : aligned_alloc(64, sizeof(Work));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#if defined(__AVX512BF16__)
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (f32 || w == NULL ? 0 : S * KVH); task++) {
            const int64_t s = task / KVH, kvh = task % KVH;
            pair_values(L, tables + s * width, kvh, first_pair_key(L, computed[s]),
                        computed[s] + qlens[s], pairs_of(L, pairs, paired, s, kvh));
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < first[S]; item++) {
            if (w == NULL) continue;
            int64_t s = 0;
            while (first[s + 1] <= item) s++;
            const int64_t local = item - first[s], tiles = (first[s + 1] - first[s]) / KVH;
            const int64_t kvh = local / tiles, r0 = (local % tiles) * ROWS;
            const int64_t left = qlens[s] * L->G - r0;
            const int nrows = (int)(left < ROWS ? left : ROWS);
            const uint32_t *own = f32 ? NULL : pairs_of(L, pairs, paired, s, kvh);
            ITEMS[f32][(nrows - 1) / LANES](L, tables + s * width, own, starts[s], computed[s],
                                             kvh, r0, nrows, w);
        }
        free(w);
    }
    free(pairs);
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
