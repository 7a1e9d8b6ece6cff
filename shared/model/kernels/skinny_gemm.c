/* y = w @ x + bias for one row x (a batch-1 decode step), bf16 in and out, fp32 accumulation.
 *
 * At one row a GEMM is a pass over its weight: oneDNN's bf16 primitives read SmolLM2's decode
 * weights at 7.5 GB/s on one thread and 12 GB/s on two, where a plain sum() of the same bytes
 * reads 11.5 and 23 GB/s (docs/performance.md, section 6). Here each thread streams a band of
 * 16 contiguous weight rows at a time against x held in registers (AVX-512 BF16 dot products),
 * and the 16 row sums are reduced together by a transpose-and-add tree (sum16.h).
 *
 *   x    [K] (unit stride), w [N, K] contiguous (torch's [out, in] weight, as stored),
 *   bias [N] or NULL, y [N]
 * Returns 0, or -1 where this CPU is not covered (the caller then uses oneDNN).
 */
#include <stdint.h>

#include "bf16.h"
#include "sum16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#define ROWS 16

/* rows: how many of the band's 16 rows exist (the last band may be short); a constant 16 for
 * full bands, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void band(const uint16_t *x, const uint16_t *w,
                                                       const uint16_t *bias, uint16_t *y,
                                                       int64_t K, int64_t n0, int rows) {
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (K - k)) - 1);
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k);
        for (int r = 0; r < rows; r++) {
            /* the same line of the next band's row: the 16 rows are 16 streams, too many for
             * the hardware prefetcher to run ahead on */
            _mm_prefetch((const char *)(w + (n0 + ROWS + r) * K + k), _MM_HINT_T0);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + r) * K + k);
            acc[r] = _mm512_dpbf16_ps(acc[r], xv, wv);
        }
    }
    float out[ROWS];
    _mm512_storeu_ps(out, sum16_ordered(acc));
    for (int r = 0; r < rows; r++)
        y[n0 + r] = f32_to_bf16(out[r] + (bias ? bf16_to_f32(bias[n0 + r]) : 0.0f));
}

int skinny_gemm(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t N, int64_t K, int nthreads) {
    if (N < 1 || K < 1) return -1;
    const int64_t bands = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t b = 0; b < bands; b++) {
        const int64_t left = N - b * ROWS;
        if (left >= ROWS)
            band(x, w, bias, y, K, b * ROWS, ROWS);
        else
            band(x, w, bias, y, K, b * ROWS, (int)left);
    }
    return 0;
}

#else

int skinny_gemm(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t N, int64_t K, int nthreads) {
    (void)x, (void)w, (void)bias, (void)y, (void)N, (void)K, (void)nthreads;
    return -1; /* no AVX-512 BF16 on the machine this was built for */
}

#endif
