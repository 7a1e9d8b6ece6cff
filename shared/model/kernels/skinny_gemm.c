/* y = x @ w^T + bias for the few rows of x a small decode batch has, bf16 or fp32, fp32
 * accumulation.
 *
 * At a few rows a GEMM is a pass over its weight plus a little arithmetic per weight element,
 * and the libraries read the weight well below the memory bandwidth there (docs/performance.md,
 * "Kernels"): on AMD Zen 4 MKL's fp32 sgemv at 11.5 GB/s and oneDNN's one-row bf16 primitives
 * at 8.4 where a sum() of the same bytes reads 25-28. Here each thread takes bands of 16
 * contiguous weight rows and reads every row start to end before the next: one sequential
 * stream, which hardware prefetchers follow best (reading a band's rows interleaved, chunk by
 * chunk, ran at 13.5 GB/s against 24 on that CPU). Each row is dotted with
 * up to 8 rows of x at once (AVX-512 FMAs, or BF16 dot products; x stays in L1); more rows of x
 * take more passes over the band, which is in L1/L2 by then. The 16 row sums of a band are
 * reduced together by a transpose-and-add tree (sum16.h). Up to 4 rows of x in a pass (the
 * most the engine sends) every output is summed in the same order whatever the number of rows;
 * a pass of 5-8 rows gives each row one accumulator instead of two, so its last bits may differ
 * from the same row's alone. Past a few rows the arithmetic per weight byte no longer
 * hides behind the stream on Zen 4 (8 rows: 8 GB/s) and oneDNN's packed GEMMs are faster: the
 * caller picks the row counts (shared/model/gemm.py).
 *
 *   x    [M, K], row stride ldx, unit element stride;  w [N, K] contiguous (torch's [out, in]
 *   weight, as stored);  bias [N] or NULL;  y [M, N] contiguous
 * Returns 0, or -1 where this CPU is not covered (the caller then keeps its library path).
 */
#include <stdint.h>

#include "bf16.h"
#include "sum16.h"

#define ROWS 16 /* weight rows per band: their sums are reduced together */
#define MB 8     /* rows of x per pass over a band */

#if defined(__AVX512F__)
#include <immintrin.h>

/* One weight row against rows 0..mb-1 of x: sums[m] = lanes to add up for output m. `mb` is a
 * constant at every call site (see BAND's switch), so the accumulators stay in registers; with
 * few rows of x each gets two accumulators, so that consecutive dot products do not wait on
 * each other. STEP elements of K per vector; LOAD(ptr) and LOAD_MASKED(mask, ptr) load them as
 * DOT's operand type (the masked load only for K's tail: on Zen 4 it is the slower one). */
#define DEFINE_ROW(NAME, T, STEP, MASK_T, LOAD, LOAD_MASKED, DOT)                                 \
    static inline __attribute__((always_inline)) void NAME(const T *x, int64_t ldx, const T *wr,  \
                                                           int64_t K, const int mb,               \
                                                           __m512 *sums) {                        \
        const int parts = mb <= 4 ? 2 : 1;                                                        \
        const MASK_T tail = (MASK_T)((((uint64_t)1) << (K % STEP)) - 1);                          \
        __m512 acc[2][MB];                                                                        \
        for (int p = 0; p < parts; p++)                                                           \
            for (int m = 0; m < mb; m++) acc[p][m] = _mm512_setzero_ps();                         \
        int64_t k = 0;                                                                            \
        for (; k + parts * STEP <= K; k += parts * STEP)                                          \
            for (int p = 0; p < parts; p++) {                                                     \
                const __typeof__(LOAD(wr)) wv = LOAD(wr + k + p * STEP);                          \
                for (int m = 0; m < mb; m++)                                                      \
                    acc[p][m] = DOT(acc[p][m], LOAD(x + m * ldx + k + p * STEP), wv);             \
            }                                                                                     \
        for (; k + STEP <= K; k += STEP) {                                                        \
            const __typeof__(LOAD(wr)) wv = LOAD(wr + k);                                         \
            for (int m = 0; m < mb; m++) acc[0][m] = DOT(acc[0][m], LOAD(x + m * ldx + k), wv);   \
        }                                                                                         \
        if (k < K) {                                                                              \
            const __typeof__(LOAD(wr)) wv = LOAD_MASKED(tail, wr + k);                            \
            for (int m = 0; m < mb; m++)                                                          \
                acc[0][m] = DOT(acc[0][m], LOAD_MASKED(tail, x + m * ldx + k), wv);               \
        }                                                                                         \
        for (int m = 0; m < mb; m++)                                                              \
            sums[m] = parts == 2 ? _mm512_add_ps(acc[0][m], acc[1][m]) : acc[0][m];               \
    }

#define ROWS_OF_BAND(ROW, mb)                                                                     \
    for (int r = 0; r < rows; r++) {                                                              \
        __m512 s[MB];                                                                             \
        ROW(x + m0 * ldx, ldx, w + (n0 + r) * K, K, mb, s);                                       \
        for (int m = 0; m < mb; m++) part[m][r] = s[m];                                           \
    }                                                                                             \
    break;

/* One band of `rows` (<= 16) weight rows from n0 against every row of x, MB rows per pass. */
#define DEFINE_BAND(NAME, T, ROW, STORE)                                                          \
    static void NAME(const T *x, int64_t ldx, const T *w, const T *bias, T *y, int64_t M,         \
                     int64_t N, int64_t K, int64_t n0, int rows) {                                \
        __m512 part[MB][ROWS];                                                                    \
        for (int64_t m0 = 0; m0 < M; m0 += MB) {                                                  \
            const int mb = M - m0 < MB ? (int)(M - m0) : MB;                                      \
            switch (mb) {                                                                         \
                case 1: ROWS_OF_BAND(ROW, 1)                                                      \
                case 2: ROWS_OF_BAND(ROW, 2)                                                      \
                case 3: ROWS_OF_BAND(ROW, 3)                                                      \
                case 4: ROWS_OF_BAND(ROW, 4)                                                      \
                case 5: ROWS_OF_BAND(ROW, 5)                                                      \
                case 6: ROWS_OF_BAND(ROW, 6)                                                      \
                case 7: ROWS_OF_BAND(ROW, 7)                                                      \
                default: ROWS_OF_BAND(ROW, 8)                                                     \
            }                                                                                     \
            for (int m = 0; m < mb; m++) {                                                        \
                for (int r = rows; r < ROWS; r++) part[m][r] = _mm512_setzero_ps();               \
                float out[ROWS];                                                                  \
                _mm512_storeu_ps(out, sum16_ordered(part[m]));                                    \
                for (int r = 0; r < rows; r++) STORE(y + (m0 + m) * N, bias, n0 + r, out[r]);     \
            }                                                                                     \
        }                                                                                         \
    }

/* Every band of the weight, split over the threads; the last band may be short. */
#define DEFINE_GEMM(NAME, T, BAND)                                                                \
    int NAME(const T *x, int64_t ldx, const T *w, const T *bias, T *y, int64_t M, int64_t N,      \
             int64_t K, int nthreads) {                                                           \
        if (M < 1 || N < 1 || K < 1) return -1;                                                   \
        const int64_t bands = (N + ROWS - 1) / ROWS;                                              \
        _Pragma("omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)")      \
        for (int64_t b = 0; b < bands; b++) {                                                     \
            const int64_t left = N - b * ROWS;                                                    \
            BAND(x, ldx, w, bias, y, M, N, K, b * ROWS, left < ROWS ? (int)left : ROWS);          \
        }                                                                                         \
        return 0;                                                                                 \
    }

#define LOAD_F32(p) _mm512_loadu_ps(p)
#define LOAD_MASKED_F32(mask, p) _mm512_maskz_loadu_ps((mask), (p))
#define DOT_F32(acc, a, b) _mm512_fmadd_ps((a), (b), (acc))

static inline void store_f32(float *y, const float *bias, int64_t n, float v) {
    y[n] = v + (bias ? bias[n] : 0.0f);
}

DEFINE_ROW(row_f32, float, 16, __mmask16, LOAD_F32, LOAD_MASKED_F32, DOT_F32)
DEFINE_BAND(band_f32, float, row_f32, store_f32)
DEFINE_GEMM(skinny_gemm_f32, float, band_f32)

#if defined(__AVX512BF16__)
#define LOAD_BF16(p) ((__m512bh)_mm512_loadu_si512(p))
#define LOAD_MASKED_BF16(mask, p) ((__m512bh)_mm512_maskz_loadu_epi16((mask), (p)))
#define DOT_BF16(acc, a, b) _mm512_dpbf16_ps((acc), (a), (b))

static inline void store_bf16(uint16_t *y, const uint16_t *bias, int64_t n, float v) {
    y[n] = f32_to_bf16(v + (bias ? bf16_to_f32(bias[n]) : 0.0f));
}

DEFINE_ROW(row_bf16, uint16_t, 32, __mmask32, LOAD_BF16, LOAD_MASKED_BF16, DOT_BF16)
DEFINE_BAND(band_bf16, uint16_t, row_bf16, store_bf16)
DEFINE_GEMM(skinny_gemm_bf16, uint16_t, band_bf16)
#endif

#endif /* __AVX512F__ */

/* Where the machine this was built for lacks the instructions: -1, the caller's library path. */
#if !defined(__AVX512F__)
int skinny_gemm_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
    return -1;
}
#endif

#if !defined(__AVX512BF16__)
int skinny_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias,
                     uint16_t *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
    return -1;
}
#endif
