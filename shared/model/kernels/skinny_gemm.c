/* y = w @ x + bias for one row x (a batch-1 decode step), bf16 or fp32, fp32 accumulation.
 *
 * At one row a GEMM is one pass over its weight, and the libraries' one-row paths read it well
 * below the memory bandwidth (docs/performance.md, section 6): on AMD Zen 4, MKL's fp32 sgemv at
 * 11.5 GB/s and oneDNN's bf16 primitives at 8.4 where a sum() of the same bytes reads 25-28.
 * Here each thread takes bands of 16 contiguous weight rows and reads every row start to end
 * before the next (one sequential stream, which hardware prefetchers follow best: reading a
 * band's rows interleaved, chunk by chunk, ran at 13.5 GB/s against 24 on that CPU), dotting it
 * with x (AVX-512 FMAs, or BF16 dot products, two accumulators a row); the 16 row sums of a band
 * are reduced together by a transpose-and-add tree (sum16.h).
 *
 *   x    [K] (unit stride), w [N, K] contiguous (torch's [out, in] weight, as stored),
 *   bias [N] or NULL, y [N]
 * Returns 0, or -1 where this CPU is not covered (the caller then keeps its library path).
 */
#include <stdint.h>

#include "bf16.h"
#include "sum16.h"

#define ROWS 16

#if defined(__AVX512F__)
#include <immintrin.h>

/* One band of `rows` (<= 16) weight rows from n0: a constant 16 at the full-band call site, so
 * that the accumulators stay in registers. STEP elements of K per vector; LOAD(mask, ptr) loads
 * them as DOT's operand type. */
#define DEFINE_BAND(NAME, T, STEP, MASK_T, LOAD, DOT, STORE)                                     \
    static inline __attribute__((always_inline)) void NAME(const T *x, const T *w, const T *bias, \
                                                           T *y, int64_t K, int64_t n0,          \
                                                           int rows) {                           \
        __m512 acc[ROWS];                                                                         \
        const int64_t whole = K - K % (2 * STEP);                                                 \
        const MASK_T tail = (MASK_T)((((uint64_t)1) << (K % STEP)) - 1);                          \
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                              \
        for (int r = 0; r < rows; r++) {                                                          \
            const T *wr = w + (n0 + r) * K;                                                       \
            const MASK_T all = (MASK_T)~(MASK_T)0;                                                \
            __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();                              \
            int64_t k = 0;                                                                        \
            for (; k < whole; k += 2 * STEP) {                                                    \
                a = DOT(a, LOAD(all, x + k), LOAD(all, wr + k));                                  \
                b = DOT(b, LOAD(all, x + k + STEP), LOAD(all, wr + k + STEP));                    \
            }                                                                                     \
            if (K - k >= STEP) {                                                                  \
                a = DOT(a, LOAD(all, x + k), LOAD(all, wr + k));                                  \
                k += STEP;                                                                        \
            }                                                                                     \
            if (k < K) b = DOT(b, LOAD(tail, x + k), LOAD(tail, wr + k));                         \
            acc[r] = _mm512_add_ps(a, b);                                                         \
        }                                                                                         \
        float out[ROWS];                                                                          \
        _mm512_storeu_ps(out, sum16_ordered(acc));                                                \
        for (int r = 0; r < rows; r++) STORE(y, bias, n0 + r, out[r]);                            \
    }

/* Every band of the weight, split over the threads; the last band may be short. */
#define DEFINE_GEMV(NAME, T, BAND)                                                                \
    int NAME(const T *x, const T *w, const T *bias, T *y, int64_t N, int64_t K, int nthreads) {   \
        if (N < 1 || K < 1) return -1;                                                            \
        const int64_t bands = (N + ROWS - 1) / ROWS;                                              \
        _Pragma("omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)")      \
        for (int64_t b = 0; b < bands; b++) {                                                     \
            const int64_t left = N - b * ROWS;                                                    \
            if (left >= ROWS)                                                                     \
                BAND(x, w, bias, y, K, b * ROWS, ROWS);                                           \
            else                                                                                  \
                BAND(x, w, bias, y, K, b * ROWS, (int)left);                                      \
        }                                                                                         \
        return 0;                                                                                 \
    }

#define LOAD_F32(mask, p) _mm512_maskz_loadu_ps((mask), (p))
#define DOT_F32(acc, a, b) _mm512_fmadd_ps((a), (b), (acc))

static inline void store_f32(float *y, const float *bias, int64_t n, float v) {
    y[n] = v + (bias ? bias[n] : 0.0f);
}

DEFINE_BAND(band_f32, float, 16, __mmask16, LOAD_F32, DOT_F32, store_f32)
DEFINE_GEMV(skinny_gemm_f32, float, band_f32)

#if defined(__AVX512BF16__)
#define LOAD_BF16(mask, p) ((__m512bh)_mm512_maskz_loadu_epi16((mask), (p)))
#define DOT_BF16(acc, a, b) _mm512_dpbf16_ps((acc), (a), (b))

static inline void store_bf16(uint16_t *y, const uint16_t *bias, int64_t n, float v) {
    y[n] = f32_to_bf16(v + (bias ? bf16_to_f32(bias[n]) : 0.0f));
}

DEFINE_BAND(band_bf16, uint16_t, 32, __mmask32, LOAD_BF16, DOT_BF16, store_bf16)
DEFINE_GEMV(skinny_gemm_bf16, uint16_t, band_bf16)
#endif

#endif /* __AVX512F__ */

/* Where the machine this was built for lacks the instructions: -1, the caller's library path. */
#if !defined(__AVX512F__)
int skinny_gemm_f32(const float *x, const float *w, const float *bias, float *y, int64_t N,
                    int64_t K, int nthreads) {
    (void)x, (void)w, (void)bias, (void)y, (void)N, (void)K, (void)nthreads;
    return -1;
}
#endif

#if !defined(__AVX512BF16__)
int skinny_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                     int64_t N, int64_t K, int nthreads) {
    (void)x, (void)w, (void)bias, (void)y, (void)N, (void)K, (void)nthreads;
    return -1;
}
#endif
