/* Force-included (-include) into an AVX2 build of kernels/cpu so that the AVX-VNNI path of
 * quant_kernels.c compiles and runs on a CPU without AVX-VNNI: its one AVX-VNNI instruction,
 * vpdpbusd (each int32 lane += the four products of its unsigned bytes in ``u`` with the signed
 * bytes in ``s``, no saturation), computed exactly with AVX2 (byte products widened to int16
 * pairs: 255 x 127 and their pair sums fit). Everything else in that path is its own code. */
#include <immintrin.h>

static inline __attribute__((always_inline)) __m256i emulated_dpbusd(__m256i acc, __m256i u, __m256i s) {
    __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00ff)), u_odd = _mm256_srli_epi16(u, 8);
    __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd));
    return _mm256_add_epi32(acc, sums);
}

#define _mm256_dpbusd_avx_epi32 emulated_dpbusd
#define __AVXVNNI__ 1
#define AVXVNNI_EMULATED 1 /* built_isa() does not report AVX-VNNI: no instruction of it is used */
