/* CPU kernels for the decode path: the per-layer work between the matrix
 * products, one call each instead of a handful of torch calls.
 *
 * Compiled on the machine that runs them (kernels/cpu/__init__.py), with
 * -ffp-contract=off so that a*b + c*d is two roundings, as in torch's own
 * element-wise kernels: the rotary embedding below is then bitwise the one
 * transformers computes. Sums (norms, dot products) are vectorised reductions
 * (`omp simd`): lane-wise partial sums like torch's own reductions, though not
 * in the same order, so they agree to rounding. Only attention uses OpenMP
 * threads (the runtime torch has already loaded); built without OpenMP, it
 * runs on the calling thread.
 *
 * All tensors are float32 (caches included) and all indices int64 unless
 * noted; "stride" means elements between consecutive rows.
 *
 * The functions marked API are the library's interface, and their prototypes
 * here are the only declaration of it: kernels/cpu/__init__.py reads them
 * from this file to type the ctypes calls (pointers, int64_t, float). The
 * library is built with -fvisibility=hidden, so nothing else is exported.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* exp over arrays, in 8-lane vectors (GCC vector extensions: libm's expf does
 * not vectorise without -ffast-math). x = n*ln2 + r with |r| <= ln2/2; e^r by
 * its Taylor series to r^7 (relative error below 2e-7 on that interval),
 * times 2^n built in the exponent bits; n is rounded with the 1.5*2^23 trick,
 * so the vector and scalar versions agree exactly. Inputs below -87 give
 * about 1e-38 (softmax and silu need no more), inputs above 88 saturate. */
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));
#define VLANES 8
#define API __attribute__((visibility("default")))

#define EXP_BODY(T, TI, x, out)                                                      \
    do {                                                                             \
        T n_ = (x) * 1.4426950408889634f + 12582912.0f;                              \
        n_ = n_ - 12582912.0f;                                                       \
        T r_ = (x) - n_ * 0.693145751953125f;                                        \
        r_ = r_ - n_ * 1.428606765330187e-06f;                                       \
        T p_ = r_ * (1.0f / 5040.0f) + (1.0f / 720.0f);                              \
        p_ = p_ * r_ + (1.0f / 120.0f);                                              \
        p_ = p_ * r_ + (1.0f / 24.0f);                                               \
        p_ = p_ * r_ + (1.0f / 6.0f);                                                \
        p_ = p_ * r_ + 0.5f;                                                         \
        p_ = p_ * r_ + 1.0f;                                                         \
        p_ = p_ * r_ + 1.0f;                                                         \
        out = p_ * exp_scale_##T(n_);                                                \
    } while (0)

static inline vfloat clamp_v(vfloat x) {
    vfloat lo = x - x - 87.0f, hi = x - x + 88.0f;
    vint below = x < lo, above = x > hi;
    vint bits = ((vint)x & ~below & ~above) | ((vint)lo & below) | ((vint)hi & above);
    return (vfloat)bits;
}

static inline vfloat exp_scale_vfloat(vfloat n) {
    return (vfloat)((__builtin_convertvector(n, vint) + 127) << 23);
}

static inline float exp_scale_float(float n) {
    int32_t bits = ((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float exp_scalar(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    float y;
    EXP_BODY(float, int32_t, x, y);
    return y;
}

/* y[i] = exp(x[i]) for n floats; y may be x. */
static void exp_array(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + VLANES <= n; i += VLANES) {
        vfloat v, e;
        memcpy(&v, x + i, sizeof v);
        v = clamp_v(v);
        EXP_BODY(vfloat, vint, v, e);
        memcpy(y + i, &e, sizeof e);
    }
    for (; i < n; i++) y[i] = exp_scalar(x[i]);
}

static void rms_norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* out = w * x / sqrt(mean(x^2) + eps) over rows of n: `outer` groups of `inner`
 * rows (row (a, b) at x + a*outer_stride + b*inner_stride); out is contiguous. */
API void rms_norm(const float *x, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
              const float *w, float *out, int64_t n, float eps) {
    for (int64_t a = 0; a < outer; a++)
        for (int64_t b = 0; b < inner; b++)
            rms_norm_row(x + a * outer_stride + b * inner_stride, w, out + (a * inner + b) * n, n, eps);
}

/* residual += x, then out = rms_norm(residual): the residual add fused with
 * the next layer norm (residual, x and out are contiguous [rows, n]). */
API void add_rms_norm(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                  float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *h = residual + r * n;
        for (int64_t i = 0; i < n; i++) h[i] = h[i] + xr[i];
    }
    for (int64_t r = 0; r < rows; r++) rms_norm_row(residual + r * n, w, out + r * n, n, eps);
}

/* Rotate, in place, the first `heads` heads of each token's row of qkv by the
 * token's position: x*cos + roll(x, half)*sin_signed, where sin_signed has its
 * first half negated (that is x*cos + rotate_half(x)*sin, term by term). */
API void rotary(float *qkv, int64_t tokens, int64_t tok_stride, int64_t heads, int64_t head_dim,
            const float *cos_table, const float *sin_table, const int64_t *positions) {
    int64_t half = head_dim / 2;
    float tmp[1024];
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * head_dim;
        const float *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x = qkv + t * tok_stride + h * head_dim;
            memcpy(tmp, x, head_dim * sizeof(float));
            for (int64_t i = 0; i < half; i++) {
                float a = tmp[i] * c[i];
                float b = tmp[i + half] * s[i];
                x[i] = a + b;
            }
            for (int64_t i = half; i < head_dim; i++) {
                float a = tmp[i] * c[i];
                float b = tmp[i - half] * s[i];
                x[i] = a + b;
            }
        }
    }
}

/* Copy each token's key and value (contiguous rows of `row` floats, one per
 * token at the given strides) to its cache slot; a negative slot is padding. */
API void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens, int64_t row,
              float *k_cache, float *v_cache, const int64_t *slots) {
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + slot * row, v + t * v_stride, row * sizeof(float));
    }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i], gate_up = [gate | up] rows of 2*n. */
API void silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n;
        const float *u = g + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = -g[i];
        exp_array(o, o, n);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = (g[i] / (1.0f + o[i])) * u[i];
    }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* s = softmax(s) over its n scores, in place (max subtracted first). */
static inline __attribute__((always_inline)) void softmax(float *s, int64_t n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) s[j] -= m;
    exp_array(s, s, n);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; j++) total += s[j];
    float inv = 1.0f / total;
#pragma omp simd
    for (int64_t j = 0; j < n; j++) s[j] *= inv;
}

/* One decode's attention (see paged_decode_attention). Always inlined with a
 * constant head_dim for the common sizes, so that the dot products and the
 * value accumulation compile to fixed-length vector code. */
static inline __attribute__((always_inline)) void decode_one(
    const float *qd, float *od, const int32_t *table, int64_t len, int64_t kv_heads, int64_t group,
    const int64_t head_dim, const float *k_cache, const float *v_cache, int64_t block_size, float scale,
    float *scratch) {
    int64_t heads = kv_heads * group;
    int64_t kv_row = kv_heads * head_dim;
    /* scores[h][j] = scale * q_h . k_j, walking the blocks (no division per key) */
    for (int64_t j0 = 0, b = 0; j0 < len; j0 += block_size, b++) {
        const float *block = k_cache + (int64_t)table[b] * block_size * kv_row;
        int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t t = 0; t < n; t++) {
            const float *row = block + t * kv_row;
            for (int64_t kh = 0, h = 0; kh < kv_heads; kh++)
                for (int64_t g = 0; g < group; g++, h++)
                    scratch[h * len + j0 + t] = dot(qd + h * head_dim, row + kh * head_dim, head_dim) * scale;
        }
    }
    for (int64_t h = 0; h < heads; h++) softmax(scratch + h * len, len);
    memset(od, 0, sizeof(float) * heads * head_dim);
    for (int64_t j0 = 0, b = 0; j0 < len; j0 += block_size, b++) {  /* out_h = sum_j p[h][j] * v_j */
        const float *block = v_cache + (int64_t)table[b] * block_size * kv_row;
        int64_t n = len - j0 < block_size ? len - j0 : block_size;
        for (int64_t t = 0; t < n; t++) {
            const float *row = block + t * kv_row;
            for (int64_t kh = 0, h = 0; kh < kv_heads; kh++) {
                const float *v = row + kh * head_dim;
                for (int64_t g = 0; g < group; g++, h++) {
                    float p = scratch[h * len + j0 + t];
                    float *o = od + h * head_dim;
#pragma omp simd
                    for (int64_t i = 0; i < head_dim; i++) o[i] += p * v[i];
                }
            }
        }
    }
}

/* This OpenMP thread's share of a scratch buffer (all of it without OpenMP). */
static inline float *thread_scratch(float *base, int64_t stride) {
#ifdef _OPENMP
    return base + omp_get_thread_num() * stride;
#else
    (void)stride;
    return base;
#endif
}

/* Below this many multiply-adds (keys x query heads x head_dim, summed over
 * the decodes) attention runs on the calling thread alone: waking a second
 * thread costs more than it saves. */
#define PARALLEL_MIN_WORK (1 << 19)

/* Attention of one-token queries over their paged contexts, read in place.
 *
 * Decode d is query row q_rows[d] (heads of head_dim at q + row*q_stride)
 * and attends to the first seq_lens[d] tokens of the blocks listed at
 * block_tables + tables[d]*table_stride (int32 block ids); its output goes to
 * out + q_rows[d]*out_stride. The caches are [blocks, block_size, kv_heads,
 * head_dim]; each cached row (all KV heads of one token) is read once, for
 * every query head, walking the request's blocks. Large batches are shared
 * among up to `threads` OpenMP threads, a decode at a time; thread i uses
 * scratch + i*scratch_stride, which holds at least heads * max(seq_lens)
 * floats.
 */
API void paged_decode_attention(const float *q, int64_t q_stride, const int64_t *q_rows, int64_t num_decodes,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, const float *k_cache,
                            const float *v_cache, int64_t block_size, const int32_t *block_tables,
                            int64_t table_stride, const int64_t *tables, const int64_t *seq_lens, float scale,
                            float *out, int64_t out_stride, float *scratch, int64_t scratch_stride,
                            int64_t threads) {
    int64_t group = heads / kv_heads;
    int64_t keys = 0;
    for (int64_t d = 0; d < num_decodes; d++) keys += seq_lens[d];
    int parallel = threads > 1 && num_decodes > 1 && keys * heads * head_dim >= PARALLEL_MIN_WORK;
    (void)parallel;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t d = 0; d < num_decodes; d++) {
        float *scr = thread_scratch(scratch, scratch_stride);
        const float *qd = q + q_rows[d] * q_stride;
        float *od = out + q_rows[d] * out_stride;
        const int32_t *table = block_tables + tables[d] * table_stride;
#define DECODE(D) decode_one(qd, od, table, seq_lens[d], kv_heads, group, D, k_cache, v_cache, block_size, scale, scr)
        switch (head_dim) {
            case 8: DECODE(8); break;
            case 16: DECODE(16); break;
            case 32: DECODE(32); break;
            case 64: DECODE(64); break;
            case 128: DECODE(128); break;
            default: DECODE(head_dim);
        }
#undef DECODE
    }
}

/* Vector helpers for the prefill kernel: unaligned loads and stores, a
 * lane-wise select, and the lanes' max and sum. */
static inline vfloat vload(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

/* The prefill kernel's key count for a context of n keys: whole vectors, the
 * padding zeroed. Callers size its scratch with it (kernels/cpu/__init__.py). */
API int64_t padded_keys(int64_t n) { return (n + VLANES - 1) / VLANES * VLANES; }

static inline vfloat vblend(vint mask, vfloat a, vfloat b) {
    return (vfloat)(((vint)a & mask) | ((vint)b & ~mask));
}

static inline float vmax_lanes(vfloat v) {
    float m = v[0];
    for (int i = 1; i < VLANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float vsum_lanes(vfloat v) {
    float t = 0.0f;
    for (int i = 0; i < VLANES; i++) t += v[i];
    return t;
}

/* One query head of a prefill chunk over keys and values stored transposed
 * ([head_dim][stride], stride a multiple of VLANES, zeros past the last key);
 * always inlined with a constant head_dim (8 and 16, the sizes the dispatcher
 * sends here). Three passes over the keys, in vectors of VLANES keys: the
 * scores (each a register sum over head_dim) and their max; exp and its sum
 * (lanes past `len` are zeroed); then each output dimension, divided by the sum
 * at the end. s holds the scores of the vectors that cover `len`. */
static inline __attribute__((always_inline)) void prefill_query_head(
    const float *qh, const float *kt, const float *vt, int64_t len, int64_t stride, const int64_t head_dim,
    float scale, float *s, float *oh) {
    const vint lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const vfloat zero = {0};
    const int32_t end = (int32_t)len;
    vfloat vmax = zero - INFINITY;
    for (int64_t j = 0; j < len; j += VLANES) {
        vfloat acc = zero;
        for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * vload(kt + d * stride + j);
        acc = vblend(lane + (int32_t)j < end, acc * scale, zero - INFINITY);
        vstore(s + j, acc);
        vmax = vblend(acc > vmax, acc, vmax);
    }
    float m = vmax_lanes(vmax);
    vfloat vsum = zero;
    for (int64_t j = 0; j < len; j += VLANES) {
        vfloat x = clamp_v(vload(s + j) - m), e;
        EXP_BODY(vfloat, vint, x, e);
        e = vblend(lane + (int32_t)j < end, e, zero);
        vstore(s + j, e);
        vsum += e;
    }
    float inv = 1.0f / vsum_lanes(vsum);
    for (int64_t d = 0; d < head_dim; d++) {
        vfloat acc = zero;
        for (int64_t j = 0; j < len; j += VLANES) acc += vload(s + j) * vload(vt + d * stride + j);
        oh[d] = vsum_lanes(acc) * inv;
    }
}

/* Attention of one request's prefill chunk, read from the paged caches.
 *
 * Query i (row q + i*q_stride, heads of head_dim) sits at position
 * seq_len - n + i and attends to the request's cached tokens 0 .. its own
 * position; its output goes to out + i*out_stride. The request's first
 * seq_len keys and values are first copied transposed, per KV head
 * [head_dim][stride] with stride = padded_keys(seq_len) (zeros after
 * the last key), into kv_scratch (2 * kv_heads * head_dim * stride floats): all
 * n queries read them, and a query's scores and its output are then vector
 * operations along the keys instead of one short dot product per key (which
 * is what the decode kernel does, and what costs there for small head
 * dimensions). The queries are shared among up to `threads` OpenMP threads;
 * thread t keeps its scores at score_scratch + t*stride. Unlike the rest of
 * this file, multiply-adds may fuse here: attention agrees with torch's to
 * rounding either way, and fused it is faster.
 */
API __attribute__((optimize("fp-contract=fast"))) void paged_prefill_attention(
    const float *q, int64_t q_stride, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const float *k_cache, const float *v_cache, int64_t block_size, const int32_t *table, int64_t seq_len, float scale,
    float *out, int64_t out_stride, float *kv_scratch, float *score_scratch, int64_t threads) {
    int64_t group = heads / kv_heads;
    int64_t kv_row = kv_heads * head_dim;
    int64_t stride = padded_keys(seq_len);
    float *kt = kv_scratch;
    float *vt = kv_scratch + kv_row * stride;
    for (int64_t j0 = 0, b = 0; j0 < seq_len; j0 += block_size, b++) {
        int64_t m = seq_len - j0 < block_size ? seq_len - j0 : block_size;
        const float *kb = k_cache + (int64_t)table[b] * block_size * kv_row;
        const float *vb = v_cache + (int64_t)table[b] * block_size * kv_row;
        for (int64_t t = 0; t < m; t++)
            for (int64_t c = 0; c < kv_row; c++) {
                kt[c * stride + j0 + t] = kb[t * kv_row + c];
                vt[c * stride + j0 + t] = vb[t * kv_row + c];
            }
    }
    for (int64_t c = 0; c < kv_row; c++)
        for (int64_t j = seq_len; j < stride; j++) kt[c * stride + j] = vt[c * stride + j] = 0.0f;
    int64_t first = seq_len - n;
    int parallel = threads > 1 && n > 1 && n * (first + n / 2) * heads * head_dim >= PARALLEL_MIN_WORK;
    (void)parallel;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (parallel)
    for (int64_t i = 0; i < n; i++) {
        float *s = thread_scratch(score_scratch, stride);
        int64_t len = first + i + 1;
        const float *qi = q + i * q_stride;
        float *oi = out + i * out_stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *kh = kt + (h / group) * head_dim * stride;
            const float *vh = vt + (h / group) * head_dim * stride;
#define PREFILL(D) prefill_query_head(qi + h * head_dim, kh, vh, len, stride, D, scale, s, oi + h * head_dim)
            switch (head_dim) {
                case 8: PREFILL(8); break;
                case 16: PREFILL(16); break;
                default: PREFILL(head_dim);
            }
#undef PREFILL
        }
    }
}

/* The instruction-set extensions this build may use, bit k for ISA_FLAGS[k] in
 * kernels/cpu/__init__.py, which refuses a library that needs one the CPU lacks
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
#ifdef __AVXVNNI__
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
