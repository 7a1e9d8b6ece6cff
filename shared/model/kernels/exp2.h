/* 2^x for x <= 0, sixteen lanes: the softmax's shifted scores in log2 units. */
#ifndef PDSERVE_EXP2_H
#define PDSERVE_EXP2_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* 2^round(x) x a degree-6 Taylor polynomial of the remainder in [-0.5, 0.5] (relative error
 * ~1e-7); below -126 the result is ~0 (2^-126), as a masked-out score's should be. */
static inline __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428441e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
#endif
