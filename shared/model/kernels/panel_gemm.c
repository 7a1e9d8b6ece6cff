/* y = x @ w^T + bias on a weight packed once into column panels, for every row count: bf16
 * with fp32 sums on AVX-512 BF16 dot products (VDPBF16PS), and fp32 on AVX-512 FMAs.
 *
 * Why by hand: on AMD Zen 5 (AVX-512 BF16, no AMX) oneDNN's packed bf16 GEMMs run SmolLM2's
 * decode projections at 32 rows at ~480 GFLOP/s on two cores, 62% of what the same library
 * reaches at 1,024 rows (docs/performance.md, "Kernels"). This register-tiled loop runs the same
 * shapes at 600-660 GFLOP/s at 32 rows and ahead of oneDNN at every row count measured (8 to
 * 2,048). fp32 likewise: 1.6x oneDNN at 8 rows, 1.17x at 32, 1.09x at 1,024. On CPUs with AMX,
 * oneDNN's tile kernels are far faster in bf16, and Intel's libraries are tuned for Intel's
 * cores: the caller decides where this runs (shared/model/panel_gemm.py).
 *
 * Packed layout: panels of NR = 48 outputs. bf16: within a panel, for each pair of K (k, k+1),
 * the NR outputs' two weights side by side, wp[panel][k / 2][n][2]: one 64-byte load is 16
 * outputs' weights for two k, the operand VDPBF16PS takes, against x's pair (x[m][k], x[m][k+1])
 * broadcast to every lane; K must be even (the caller checks). fp32: wp[panel][k][n], against
 * x[m][k] broadcast. A tile is MR = 8 rows of x by one panel: 24 accumulators and 3 weight
 * registers of the 32 (AVX-512's register file); the panel (K * 96 or 192 bytes) stays in L1/L2
 * while every row tile passes over it. N is padded to whole panels with zero weights (outputs
 * past N are never stored). Work items (a panel by up to MC rows) are handed out dynamically:
 * on these shared VMs one thread is often delayed, and a static split waits for it.
 *
 * Prefetching (measured on Zen 5, SmolLM2's shapes, two threads: 32 rows 545-581 -> 734-754
 * GFLOP/s, 256 rows ~785 -> ~855, 1,024 ~780 -> ~850; one thread 32 rows 309 -> 424): a decode
 * step's weights come from DRAM, and a panel's first row tile waited on them. Every tile now pulls
 * in its share of the panel LOOKAHEAD panels on (handed out in order to two threads, the panel
 * this thread most likely takes next), and an item's first tile reads its own panel AHEAD k steps
 * ahead (for the panels no earlier item fetched; near the end it runs into the next panel, or past
 * the last: a prefetch never faults).
 *
 * Every output is one accumulator summed over k in order, whatever the number of rows or the
 * row's place in the batch: a row gets the same bits alone or in any batch.
 *
 *   x [M, K] row stride ldx, unit element stride;  wp from panel_pack_<dtype>;  bias [N] or
 *   NULL;  y [M, N] contiguous.  Every entry point returns 0, or -1 where this CPU or K is not
 *   covered.
 */
#include <stdint.h>
#include <string.h>

#define NV 3         /* vectors of 16 outputs per panel */
#define NR (16 * NV) /* outputs per panel */
#define MR 8         /* rows of x per tile */
#define MC 256       /* rows per work item: few panels (small N) still split over threads */
#define AHEAD 32     /* k steps between an item's first tile prefetching its panel and reading it */
#define LOOKAHEAD 2  /* the panel this many on is pulled in while this one is computed */
#define ROW_BYTES (NR * 4) /* a panel row: NR outputs' weights for one fp32 k or one bf16 k pair */

int panel_width(void) { return NR; }

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __mmask16 lanes(int cols, int v) { /* which of vector v's 16 outputs exist */
    const int valid = cols - 16 * v < 0 ? 0 : cols - 16 * v > 16 ? 16 : cols - 16 * v;
    return (__mmask16)((1u << valid) - 1u);
}

/* Weights to prefetch across a tile's k loop: at each k step, the three lines (a panel row's
 * bytes) from `at` + step x `stride`. A stride under a row's bytes spreads a share of a panel over
 * the whole loop; the lines overlap, and measured, that beat fetching each line exactly once
 * (32 rows: 683 against 645 GFLOP/s). `at` NULL: none. */
typedef struct {
    const char *at;
    int64_t stride;
} Stream;

/* always_inline: as a call, GCC judges it free of effects (a prefetch writes no memory) and
 * deletes it. */
static inline __attribute__((always_inline)) void prefetch_step(Stream s, int64_t step) {
    if (s.at != NULL) {
        const char *from = s.at + step * s.stride;
        _mm_prefetch(from, _MM_HINT_T0);
        _mm_prefetch(from + 64, _MM_HINT_T0);
        _mm_prefetch(from + 128, _MM_HINT_T0);
    }
}

/* Rows 0..mr-1 of x against one panel: `mr` is a constant at every call site (see the
 * driver's switch), so the accumulators stay in registers. `cols` of the NR outputs are
 * stored. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx,
                                                           const float *panel, const float *bias,
                                                           float *y, int64_t ldy, int64_t K,
                                                           const int mr, int cols, Stream own,
                                                           Stream next) {
    __m512 acc[MR][NV];
    for (int v = 0; v < NV; v++) {
        const __m512 init = bias == NULL ? _mm512_setzero_ps()
                                         : _mm512_maskz_loadu_ps(lanes(cols, v), bias + 16 * v);
        for (int m = 0; m < mr; m++) acc[m][v] = init;
    }
    for (int64_t k = 0; k < K; k++) {
        __m512 wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_ps(panel + k * NR + 16 * v);
        prefetch_step(own, k);
        prefetch_step(next, k);
        for (int m = 0; m < mr; m++) {
            const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
            for (int v = 0; v < NV; v++) acc[m][v] = _mm512_fmadd_ps(xb, wv[v], acc[m][v]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++)
            _mm512_mask_storeu_ps(y + m * ldy + 16 * v, lanes(cols, v), acc[m][v]);
}

#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t ldx,
                                                            const uint16_t *panel,
                                                            const uint16_t *bias, uint16_t *y,
                                                            int64_t ldy, int64_t K, const int mr,
                                                            int cols, Stream own, Stream next) {
    __m512 acc[MR][NV];
    for (int v = 0; v < NV; v++) {
        __m512 init = _mm512_setzero_ps();
        if (bias != NULL) { /* bf16 to fp32: the bits shifted into the high half */
            const __m256i b16 = _mm256_maskz_loadu_epi16(lanes(cols, v), bias + 16 * v);
            init = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16));
        }
        for (int m = 0; m < mr; m++) acc[m][v] = init;
    }
    for (int64_t kp = 0; kp < K / 2; kp++) {
        __m512bh wv[NV];
        for (int v = 0; v < NV; v++)
            wv[v] = (__m512bh)_mm512_loadu_si512(panel + (kp * NR + 16 * v) * 2);
        prefetch_step(own, kp);
        prefetch_step(next, kp);
        for (int m = 0; m < mr; m++) {
            int32_t pair;
            memcpy(&pair, x + m * ldx + 2 * kp, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, wv[v]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int v = 0; v < NV; v++) /* round to nearest even, as torch */
            _mm256_mask_storeu_epi16(y + m * ldy + 16 * v, lanes(cols, v),
                                     (__m256i)_mm512_cvtneps_pbh(acc[m][v]));
}
#endif

/* Tile t's prefetch streams: the first tile fetches its own panel ahead of itself, every tile
 * its share of the coming panel. */
#define STREAMS(t)                                                                                \
    (Stream){(t) == 0 ? (const char *)panel + AHEAD * ROW_BYTES : NULL, ROW_BYTES},              \
        (Stream){coming == NULL ? NULL : coming + (t) * share, share / steps}

/* The driver: work items of one panel by up to MC rows, MR rows per tile (the last may be
 * shorter), each tile with its prefetch streams (see the top of the file). */
#define DEFINE_GEMM(NAME, T, TILE, PAIR)                                                          \
    int NAME(const T *x, int64_t ldx, const T *wp, const T *bias, T *y, int64_t M, int64_t N,     \
             int64_t K, int threads) {                                                            \
        if (K % PAIR) return -1;                                                                  \
        const int64_t panels = (N + NR - 1) / NR, chunks = (M + MC - 1) / MC, steps = K / PAIR;   \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic)")                       \
        for (int64_t item = 0; item < panels * chunks; item++) {                                  \
            const int64_t p = item / chunks, m0 = (item % chunks) * MC;                           \
            const int64_t rows = M - m0 < MC ? M - m0 : MC;                                       \
            const int cols = N - p * NR < NR ? (int)(N - p * NR) : NR;                            \
            const T *panel = wp + p * K * NR, *b = bias == NULL ? NULL : bias + p * NR;           \
            const char *coming =                                                                  \
                p + LOOKAHEAD < panels ? (const char *)(panel + LOOKAHEAD * K * NR) : NULL;       \
            const int64_t tiles = (rows + MR - 1) / MR, share = K * NR * sizeof(T) / tiles;      \
            const T *xs = x + m0 * ldx;                                                           \
            T *ys = y + m0 * N + p * NR;                                                          \
            int64_t t = 0;                                                                        \
            for (; (t + 1) * MR <= rows; t++)                                                     \
                TILE(xs + t * MR * ldx, ldx, panel, b, ys + t * MR * N, N, K, MR, cols,           \
                     STREAMS(t));                                                                 \
            xs += t * MR * ldx, ys += t * MR * N;                                                 \
            switch (rows - t * MR) { /* the last rows: a constant count at each call */          \
                case 1: TILE(xs, ldx, panel, b, ys, N, K, 1, cols, STREAMS(t)); break;            \
                case 2: TILE(xs, ldx, panel, b, ys, N, K, 2, cols, STREAMS(t)); break;            \
                case 3: TILE(xs, ldx, panel, b, ys, N, K, 3, cols, STREAMS(t)); break;            \
                case 4: TILE(xs, ldx, panel, b, ys, N, K, 4, cols, STREAMS(t)); break;            \
                case 5: TILE(xs, ldx, panel, b, ys, N, K, 5, cols, STREAMS(t)); break;            \
                case 6: TILE(xs, ldx, panel, b, ys, N, K, 6, cols, STREAMS(t)); break;            \
                case 7: TILE(xs, ldx, panel, b, ys, N, K, 7, cols, STREAMS(t)); break;            \
                default: break;                                                                   \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

/* wp[panel][k / PAIR][n][PAIR]: PAIR consecutive k of one output side by side (bf16: 2). */
#define DEFINE_PACK(NAME, T, PAIR)                                                                \
    int NAME(const T *w, T *wp, int64_t N, int64_t K) {                                           \
        if (K % PAIR) return -1;                                                                  \
        const int64_t panels = (N + NR - 1) / NR;                                                 \
        _Pragma("omp parallel for schedule(static)")                                              \
        for (int64_t p = 0; p < panels; p++)                                                      \
            for (int64_t k0 = 0; k0 < K; k0 += PAIR) {                                            \
                T *dst = wp + p * K * NR + k0 * NR;                                               \
                for (int64_t n = 0; n < NR; n++)                                                  \
                    for (int j = 0; j < PAIR; j++)                                                \
                        dst[n * PAIR + j] = p * NR + n < N ? w[(p * NR + n) * K + k0 + j] : 0;    \
            }                                                                                     \
        return 0;                                                                                 \
    }

DEFINE_PACK(panel_pack_f32, float, 1)
DEFINE_GEMM(panel_gemm_f32, float, tile_f32, 1)
#if defined(__AVX512BF16__)
DEFINE_PACK(panel_pack_bf16, uint16_t, 2)
DEFINE_GEMM(panel_gemm_bf16, uint16_t, tile_bf16, 2)
#endif
#endif

/* Entry points this CPU lacks the instructions for: -1, and the caller keeps the libraries. */
#define DEFINE_MISSING(PACK, GEMM, T)                                                             \
    int PACK(const T *w, T *wp, int64_t N, int64_t K) {                                           \
        (void)w, (void)wp, (void)N, (void)K;                                                      \
        return -1;                                                                                \
    }                                                                                             \
    int GEMM(const T *x, int64_t ldx, const T *wp, const T *bias, T *y, int64_t M, int64_t N,     \
             int64_t K, int threads) {                                                            \
        (void)x, (void)ldx, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K;             \
        (void)threads;                                                                            \
        return -1;                                                                                \
    }
#if !defined(__AVX512F__)
DEFINE_MISSING(panel_pack_f32, panel_gemm_f32, float)
#endif
#if !defined(__AVX512F__) || !defined(__AVX512BF16__)
DEFINE_MISSING(panel_pack_bf16, panel_gemm_bf16, uint16_t)
#endif
