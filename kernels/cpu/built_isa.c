/* What a build of the kernels may execute, for kernels/cpu/library.py's cache: a source of
 * its own, so that a library of it alone is a quick build with the same answer (its tests). */

#include <stdint.h>

#include "cpu_common.h"

/* The instruction-set extensions this build may use, bit k for ISA_FLAGS[k] in
 * kernels/cpu/library.py, which refuses a library that needs one the CPU lacks
 * (a cache shared by machines of different CPUs). It returns a constant, so
 * calling it runs no vector instruction on any x86-64. */
API uint64_t built_isa(void) {
    uint64_t bits = 0;
#ifdef __AVX__
    bits |= 1ull << 0;
#endif
#ifdef __AVX2__
    bits |= 1ull << 1;
#endif
#ifdef __FMA__
    bits |= 1ull << 2;
#endif
#ifdef __F16C__
    bits |= 1ull << 3;
#endif
#ifdef __AVX512F__
    bits |= 1ull << 4;
#endif
#ifdef __AVX512BW__
    bits |= 1ull << 5;
#endif
#ifdef __AVX512DQ__
    bits |= 1ull << 6;
#endif
#ifdef __AVX512VL__
    bits |= 1ull << 7;
#endif
#ifdef __AVX512VNNI__
    bits |= 1ull << 8;
#endif
#if defined(__AVXVNNI__) && !defined(AVXVNNI_EMULATED) /* a test build computes vpdpbusd with AVX2 */
    bits |= 1ull << 9;
#endif
#ifdef __AVX512BF16__
    bits |= 1ull << 10;
#endif
#ifdef __AVX512FP16__
    bits |= 1ull << 11;
#endif
    return bits;
}
