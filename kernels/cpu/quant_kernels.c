/* Products with weights kept in llama.cpp's block formats (GGUF): Q8_0, Q4_0,
 * Q5_0 (blocks of 32 values), Q4_K and Q6_K (super-blocks of 256).
 *
 * As llama.cpp computes them: each activation row is quantized per block to
 * int8 with one scale (Q8_0 for the 32-value formats, Q8_K with its 16-value
 * sums for the K formats), each block's dot product is taken in integers, and
 * the scaled block sums are accumulated in float32. ``quant_matmul_f32`` is
 * the same product with float32 activations and each weight block expanded to
 * float32 first: no activation rounding, for checking against a float32
 * reference (kernels.settings.quantize_activations off).
 *
 * A weight matrix is ``m`` rows of ``k`` values, each row its blocks back to
 * back (the layout of a GGUF tensor). Products run ``n`` activation rows at
 * once: every weight block is expanded once and used for all of them, so a
 * decode batch or a prefill chunk reads the weights once per step. Output rows
 * are shared among up to ``threads`` OpenMP threads. Types are the GGML type
 * ids (GGUF's): 2 Q4_0, 6 Q5_0, 8 Q8_0, 12 Q4_K, 14 Q6_K.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define API __attribute__((visibility("default")))

#define TYPE_Q4_0 2
#define TYPE_Q5_0 6
#define TYPE_Q8_0 8
#define TYPE_Q4_K 12
#define TYPE_Q6_K 14

#define QK 32    /* values per block of the 32-value formats */
#define QK_K 256 /* values per super-block of the K formats */

typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;                  /* 18 bytes */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;   /* 22 bytes */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;                       /* 34 bytes */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_k; /* 144 bytes */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_k; /* 210 */
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_k; /* 292 bytes */

_Static_assert(sizeof(block_q4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(block_q5_0) == 22, "Q5_0 block");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(block_q4_k) == 144, "Q4_K block");
_Static_assert(sizeof(block_q6_k) == 210, "Q6_K block");
_Static_assert(sizeof(block_q8_k) == 292, "Q8_K block");

/* IEEE half <-> float, exactly (subnormals, infinities and NaN included). */
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

static inline uint16_t float_to_half(float f) { /* round to nearest even, as numpy does */
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

/* ---------------------------------------------------------------- activations */

/* Q8_0: per 32 values, d = max|x| / 127 (stored as half), q = round(x / d). */
static void quantize_row_q8_0(const float *x, block_q8_0 *y, int64_t k) {
    for (int64_t b = 0; b < k / QK; b++, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = float_to_half(d);
        for (int j = 0; j < QK; j++) y[b].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

/* Q8_K: per 256 values, the scale makes the value of largest magnitude -127 or 127;
 * the sums of each 16 quantized values come with it (for the K formats' minimums). */
static void quantize_row_q8_k(const float *x, block_q8_k *y, int64_t k) {
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (amax == 0.0f) {
            memset(&y[b], 0, sizeof y[b]);
            continue;
        }
        float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            int v = (int)nearbyintf(iscale * x[j]);
            y[b].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += y[b].qs[g * 16 + j];
            y[b].bsums[g] = (int16_t)sum;
        }
        y[b].d = 1.0f / iscale;
    }
}

API int64_t activation_row_bytes(int64_t type, int64_t k) {
    return type == TYPE_Q4_K || type == TYPE_Q6_K ? k / QK_K * (int64_t)sizeof(block_q8_k)
                                                  : k / QK * (int64_t)sizeof(block_q8_0);
}

/* ``rows`` activation rows of ``k`` values, quantized as ``type``'s products want them. */
API void quantize_activations(int64_t type, const float *x, int64_t rows, int64_t k, void *out) {
    int64_t row_bytes = activation_row_bytes(type, k);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *y = (uint8_t *)out + r * row_bytes;
        if (type == TYPE_Q4_K || type == TYPE_Q6_K)
            quantize_row_q8_k(x + r * k, (block_q8_k *)y, k);
        else
            quantize_row_q8_0(x + r * k, (block_q8_0 *)y, k);
    }
}

/* ---------------------------------------------------------------- expansion */

/* One block as int8 values (Q4_K's and Q6_K's sub-block scales and minimums apart). */
static inline float expand_q4_0(const block_q4_0 *b, int8_t *q) {
    for (int j = 0; j < QK / 2; j++) {
        q[j] = (int8_t)((b->qs[j] & 0x0f) - 8);
        q[j + QK / 2] = (int8_t)((b->qs[j] >> 4) - 8);
    }
    return half_to_float(b->d);
}

static inline float expand_q5_0(const block_q5_0 *b, int8_t *q) {
    uint32_t qh;
    memcpy(&qh, b->qh, sizeof qh);
    for (int j = 0; j < QK / 2; j++) {
        int lo = (b->qs[j] & 0x0f) | (int)(((qh >> j) << 4) & 0x10);
        int hi = (b->qs[j] >> 4) | (int)((qh >> (j + 12)) & 0x10);
        q[j] = (int8_t)(lo - 16);
        q[j + QK / 2] = (int8_t)(hi - 16);
    }
    return half_to_float(b->d);
}

static inline float expand_q8_0(const block_q8_0 *b, int8_t *q) {
    memcpy(q, b->qs, QK);
    return half_to_float(b->d);
}

/* Q4_K: 8 sub-blocks of 32 with 6-bit scales and minimums packed in 12 bytes. */
static inline void q4_k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline void expand_q4_k(const block_q4_k *b, uint8_t *q, int *scales, int *mins) {
    for (int j = 0; j < 8; j++) q4_k_scale_min(b->scales, j, &scales[j], &mins[j]);
    for (int c = 0; c < 4; c++) /* 64 values per 32 bytes: low nibbles, then high */
        for (int l = 0; l < 32; l++) {
            q[c * 64 + l] = b->qs[c * 32 + l] & 0x0f;
            q[c * 64 + 32 + l] = b->qs[c * 32 + l] >> 4;
        }
}

/* Q6_K: 16 sub-blocks of 16 with int8 scales; values are 6 bits (4 in ql, 2 in qh) less 32. */
static inline void expand_q6_k(const block_q6_k *b, int8_t *q) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + h * 64, *qh = b->qh + h * 32;
        int8_t *y = q + h * 128;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)(((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

API int64_t block_values(int64_t type) { return type == TYPE_Q4_K || type == TYPE_Q6_K ? QK_K : QK; }

API int64_t block_bytes(int64_t type) {
    switch (type) {
        case TYPE_Q4_0: return sizeof(block_q4_0);
        case TYPE_Q5_0: return sizeof(block_q5_0);
        case TYPE_Q8_0: return sizeof(block_q8_0);
        case TYPE_Q4_K: return sizeof(block_q4_k);
        case TYPE_Q6_K: return sizeof(block_q6_k);
        default: return 0;
    }
}

/* Row ``r``'s values as float32 (the embedding lookup; the reference product). */
static void dequantize_row(int64_t type, const uint8_t *row, int64_t k, float *y) {
    int64_t nb = k / block_values(type), bb = block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        if (type == TYPE_Q4_K) {
            const block_q4_k *x = (const block_q4_k *)blk;
            uint8_t q[QK_K];
            int sc[8], mn[8];
            expand_q4_k(x, q, sc, mn);
            float d = half_to_float(x->d), dmin = half_to_float(x->dmin);
            for (int j = 0; j < QK_K; j++) y[b * QK_K + j] = d * (float)sc[j / 32] * q[j] - dmin * (float)mn[j / 32];
        } else if (type == TYPE_Q6_K) {
            const block_q6_k *x = (const block_q6_k *)blk;
            int8_t q[QK_K];
            expand_q6_k(x, q);
            float d = half_to_float(x->d);
            for (int j = 0; j < QK_K; j++) y[b * QK_K + j] = d * (float)x->scales[j / 16] * q[j];
        } else {
            int8_t q[QK];
            float d = type == TYPE_Q4_0   ? expand_q4_0((const block_q4_0 *)blk, q)
                      : type == TYPE_Q5_0 ? expand_q5_0((const block_q5_0 *)blk, q)
                                          : expand_q8_0((const block_q8_0 *)blk, q);
            for (int j = 0; j < QK; j++) y[b * QK + j] = d * q[j];
        }
    }
}

/* Rows ``ids`` of a quantized matrix of ``k`` columns, as float32 rows of ``out``. */
API void dequantize_rows(int64_t type, const void *w, int64_t k, const int64_t *ids, int64_t n, float *out) {
    int64_t row_bytes = k / block_values(type) * block_bytes(type);
    for (int64_t i = 0; i < n; i++) dequantize_row(type, (const uint8_t *)w + ids[i] * row_bytes, k, out + i * k);
}

/* ---------------------------------------------------------------- products */

static inline int dot_i8(const int8_t *a, const int8_t *b, int len) {
    int sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < len; j++) sum += a[j] * b[j];
    return sum;
}

static inline int dot_u8_i8(const uint8_t *a, const int8_t *b, int len) {
    int sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < len; j++) sum += a[j] * b[j];
    return sum;
}

/* Adds to acc[i] (i < n) weight row ``row``'s product with activation row i. */
static void row_times_activations(int64_t type, const uint8_t *row, int64_t k, const uint8_t *xq, int64_t x_bytes,
                                  int64_t n, float *acc) {
    int64_t nb = k / block_values(type), bb = block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        if (type == TYPE_Q4_K) {
            const block_q4_k *x = (const block_q4_k *)blk;
            uint8_t q[QK_K];
            int sc[8], mn[8];
            expand_q4_k(x, q, sc, mn);
            float d = half_to_float(x->d), dmin = half_to_float(x->dmin);
            for (int64_t i = 0; i < n; i++) {
                const block_q8_k *a = (const block_q8_k *)(xq + i * x_bytes) + b;
                int sumi = 0, summ = 0;
                for (int s = 0; s < 8; s++) {
                    sumi += sc[s] * dot_u8_i8(q + 32 * s, a->qs + 32 * s, 32);
                    summ += mn[s] * (a->bsums[2 * s] + a->bsums[2 * s + 1]);
                }
                acc[i] += a->d * (d * (float)sumi - dmin * (float)summ);
            }
        } else if (type == TYPE_Q6_K) {
            const block_q6_k *x = (const block_q6_k *)blk;
            int8_t q[QK_K];
            expand_q6_k(x, q);
            float d = half_to_float(x->d);
            for (int64_t i = 0; i < n; i++) {
                const block_q8_k *a = (const block_q8_k *)(xq + i * x_bytes) + b;
                int sumi = 0;
                for (int s = 0; s < 16; s++) sumi += x->scales[s] * dot_i8(q + 16 * s, a->qs + 16 * s, 16);
                acc[i] += d * a->d * (float)sumi;
            }
        } else {
            int8_t q[QK];
            float d = type == TYPE_Q4_0   ? expand_q4_0((const block_q4_0 *)blk, q)
                      : type == TYPE_Q5_0 ? expand_q5_0((const block_q5_0 *)blk, q)
                                          : expand_q8_0((const block_q8_0 *)blk, q);
            for (int64_t i = 0; i < n; i++) {
                const block_q8_0 *a = (const block_q8_0 *)(xq + i * x_bytes) + b;
                acc[i] += d * half_to_float(a->d) * (float)dot_i8(q, a->qs, QK);
            }
        }
    }
}

/* out[i * out_stride + r] = (row r of W) . (activation row i) (+ bias[r]), for r < m, i < n;
 * ``xq`` holds the activations quantized by quantize_activations for this ``type``. */
API void quant_matmul(int64_t type, const void *w, int64_t m, int64_t k, const void *xq, int64_t n, float *out,
                      int64_t out_stride, const float *bias, int64_t threads) {
    int64_t row_bytes = k / block_values(type) * block_bytes(type), x_bytes = activation_row_bytes(type, k);
    int parallel = threads > 1 && m * n * k >= (1 << 18);
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float *acc = malloc((size_t)n * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            memset(acc, 0, (size_t)n * sizeof(float));
            row_times_activations(type, (const uint8_t *)w + r * row_bytes, k, (const uint8_t *)xq, x_bytes, n, acc);
            float b = bias ? bias[r] : 0.0f;
            for (int64_t i = 0; i < n; i++) out[i * out_stride + r] = acc[i] + b;
        }
        free(acc);
    }
}

/* The same product with float32 activations, each weight row expanded to float32 first. */
API void quant_matmul_f32(int64_t type, const void *w, int64_t m, int64_t k, const float *x, int64_t n, float *out,
                          int64_t out_stride, const float *bias, int64_t threads) {
    int64_t row_bytes = k / block_values(type) * block_bytes(type);
    int parallel = threads > 1 && m * n * k >= (1 << 18);
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float *wr = malloc((size_t)k * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            dequantize_row(type, (const uint8_t *)w + r * row_bytes, k, wr);
            for (int64_t i = 0; i < n; i++) {
                const float *xi = x + i * k;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < k; j++) sum += wr[j] * xi[j];
                out[i * out_stride + r] = sum + (bias ? bias[r] : 0.0f);
            }
        }
        free(wr);
    }
}
