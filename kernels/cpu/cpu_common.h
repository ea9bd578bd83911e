/* What the kernel sources share: the API marker, half-precision conversions, and
 * teams of threads that work through a sequence of steps with barriers between them.
 *
 * A team is an OpenMP parallel region whose threads meet at ``team_sync``: a
 * barrier that spins (the steps between barriers take microseconds, and a
 * sleeping thread takes tens of microseconds to wake) and yields the core after
 * a while, so a thread that waits for a descheduled one gives it the core.
 * OpenMP's own barriers would sleep at once under OMP_WAIT_POLICY=PASSIVE, which
 * the engine sets for its other pools (core/thread_pools.py). */

#ifndef RINGLLM_CPU_COMMON_H
#define RINGLLM_CPU_COMMON_H

#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define API __attribute__((visibility("default")))

/* ------------------------------------------------------------------ halves */

/* IEEE half -> float, exactly (subnormals, infinities and NaN included). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float -> IEEE half, rounded to nearest even (as numpy, torch and F16C round). */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, mant = x & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - e), half = mant >> shift, rest = mant & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = (uint32_t)(e << 10) | (mant >> 13), rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
    return (uint16_t)(sign | half);
}

/* n halves -> floats, and back (8 at a time with F16C). */
static inline void halves_to_floats(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}

static inline void floats_to_halves(const float *f, uint16_t *h, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) h[i] = float_to_half(f[i]);
}

/* ------------------------------------------------------------------ q8_0 KV rows */

/* A KV cache's storage (kernels/kv_format.py): float32, float16, or q8_0: each run of 32 values of a
 * head as llama.cpp's block_q8_0, a float16 scale and 32 int8 (34 bytes). */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 2 };
#define Q8_0_VALUES 32
#define Q8_0_BYTES 34

/* n floats (a multiple of 32) -> q8_0 blocks at dst, as llama.cpp's reference quantizes: scale =
 * max|x| / 127, each value times 1/scale rounded half away from zero (roundf). */
static inline void floats_to_q8_0(const float *x, uint8_t *dst, int64_t n) {
    for (int64_t b = 0; b < n; b += Q8_0_VALUES, x += Q8_0_VALUES, dst += Q8_0_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_0_VALUES; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t scale = float_to_half(d);
        memcpy(dst, &scale, sizeof scale);
        int8_t *q = (int8_t *)(dst + 2);
        for (int i = 0; i < Q8_0_VALUES; i++) q[i] = (int8_t)roundf(x[i] * id);
    }
}

/* q8_0 blocks -> n floats: scale * q, one rounding. */
static inline void q8_0_to_floats(const uint8_t *src, float *x, int64_t n) {
    for (int64_t b = 0; b < n; b += Q8_0_VALUES, x += Q8_0_VALUES, src += Q8_0_BYTES) {
        uint16_t scale;
        memcpy(&scale, src, sizeof scale);
        const float d = half_to_float(scale);
        const int8_t *q = (const int8_t *)(src + 2);
#pragma omp simd
        for (int i = 0; i < Q8_0_VALUES; i++) x[i] = d * (float)q[i];
    }
}

/* Value ``at`` (counted in values, not bytes) of a cache of any storage, as float32. */
static inline float kv_value(const void *cache, int64_t kv_format, int64_t at) {
    if (kv_format == KV_F32) return ((const float *)cache)[at];
    if (kv_format == KV_F16) return half_to_float(((const uint16_t *)cache)[at]);
    const uint8_t *block = (const uint8_t *)cache + at / Q8_0_VALUES * Q8_0_BYTES;
    uint16_t scale;
    memcpy(&scale, block, sizeof scale);
    return half_to_float(scale) * (float)((const int8_t *)(block + 2))[at % Q8_0_VALUES];
}

/* n values from value ``at`` of a cache of any storage into ``buf`` as float32 (n and at multiples
 * of 32 for q8_0); a float32 cache is returned in place. */
static inline const float *kv_values(const void *cache, int64_t kv_format, int64_t at, int64_t n, float *buf) {
    if (kv_format == KV_F32) return (const float *)cache + at;
    if (kv_format == KV_F16)
        halves_to_floats((const uint16_t *)cache + at, buf, n);
    else
        q8_0_to_floats((const uint8_t *)cache + at / Q8_0_VALUES * Q8_0_BYTES, buf, n);
    return buf;
}

/* n float32 values to value ``at`` of a cache of any storage. */
static inline void store_kv_values(const float *x, void *cache, int64_t kv_format, int64_t at, int64_t n) {
    if (kv_format == KV_F32)
        memcpy((float *)cache + at, x, n * sizeof(float));
    else if (kv_format == KV_F16)
        floats_to_halves(x, (uint16_t *)cache + at, n);
    else
        floats_to_q8_0(x, (uint8_t *)cache + at / Q8_0_VALUES * Q8_0_BYTES, n);
}

/* ------------------------------------------------------------------ teams */

typedef struct {
    int arrived;
    int phase;
} team_barrier;

/* Pauses before a waiting thread starts yielding its core. */
#define TEAM_SPINS 2000

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

/* Every one of ``threads`` threads calls it; none returns before all have called it. */
static inline void team_sync(team_barrier *b, int threads) {
    if (threads <= 1) return;
    int phase = __atomic_load_n(&b->phase, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->phase, phase + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&b->phase, __ATOMIC_ACQUIRE) == phase; spins++) {
        if (spins < TEAM_SPINS)
            cpu_relax();
        else
            sched_yield();
    }
}

/* This thread's number and the team's size inside a parallel region (0 and 1 outside). */
static inline int team_me(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Thread ``me`` of ``threads``' contiguous share [*begin, *end) of ``count`` items. */
static inline void team_share(int64_t count, int me, int threads, int64_t *begin, int64_t *end) {
    int64_t each = count / threads, extra = count % threads;
    *begin = me * each + (me < extra ? me : extra);
    *end = *begin + each + (me < extra);
}

#endif
