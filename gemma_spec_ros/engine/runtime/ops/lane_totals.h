// The one reduction of eight-lane sums that the CPU ops share (cpu_attention.cpp, int8_linear.cpp): each total is
// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), whichever form computes it, so a result does not depend on its neighbours.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

// totals[k] = the total of acc[k]'s eight lanes, for k = 0..7
static inline void lane_totals8(const __m256* acc, float* totals) {
  const __m256 ab = _mm256_hadd_ps(acc[0], acc[1]), cd = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 ef = _mm256_hadd_ps(acc[4], acc[5]), gh = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 abcd = _mm256_hadd_ps(ab, cd), efgh = _mm256_hadd_ps(ef, gh);
  // abcd: [a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567]; efgh alike
  const __m256 low = _mm256_permute2f128_ps(abcd, efgh, 0x20), high = _mm256_permute2f128_ps(abcd, efgh, 0x31);
  _mm256_storeu_ps(totals, _mm256_add_ps(low, high));
}
#endif

// the total of eight lanes in memory: the portable form
static inline float lane_total(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
