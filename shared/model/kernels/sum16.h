/* The 16 lane sums of 16 AVX-512 vectors as one vector, by a transpose-and-add tree: ~3
 * instructions per sum where a horizontal reduction per vector takes ~8. */
#ifndef PDSERVE_SUM16_H
#define PDSERVE_SUM16_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane 4 * (r % 4) + r / 4 of the result is the sum of v[r]'s lanes (the tree's order; see
 * sum16_ordered for lane r). v is clobbered. */
static inline __attribute__((always_inline)) __m512 sum16(__m512 v[16]) {
    /* each round pairs the vectors, exchanges half of the lanes within each pair and adds */
    for (int i = 0; i < 8; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

/* Lane r of the result is the sum of v[r]'s lanes. */
static inline __attribute__((always_inline)) __m512 sum16_ordered(__m512 v[16]) {
    /* the tree's order is a 4 x 4 transpose of the lane index: its own inverse */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, sum16(v));
}

#endif
#endif
