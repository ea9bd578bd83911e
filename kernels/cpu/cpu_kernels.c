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
 * All tensors are float32 and all indices int64 unless noted; "stride" means
 * elements between consecutive rows. The KV caches are float32, float16 or q8_0
 * (``kv_format``, cpu_common.h): written rounded to half or quantized, read back as float32.
 *
 * Each kernel is written as a share (``*_share``: thread ``me`` of a team of
 * ``threads`` does its part; cpu_common.h): the step program
 * (step_program.c) runs a whole step's kernels in one team, and the API
 * functions below run one kernel, on a team of their own or on the caller.
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

#include "cpu_common.h"

/* exp over arrays, in 8-lane vectors (GCC vector extensions: libm's expf does
 * not vectorise without -ffast-math). x = n*ln2 + r with |r| <= ln2/2; e^r by
 * its Taylor series to r^7 (relative error below 2e-7 on that interval),
 * times 2^n built in the exponent bits; n is rounded with the 1.5*2^23 trick,
 * so the vector and scalar versions agree exactly. Inputs below -87 give
 * about 1e-38 (softmax and silu need no more), inputs above 88 saturate. */
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vint __attribute__((vector_size(32)));
#define VLANES 8

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
 * rows (row (a, b) at x + a*outer_stride + b*inner_stride); out is contiguous
 * and may be x itself when the rows are (in place: each row is read before it
 * is written). The groups are shared among the team. */
void rms_norm_share(const float *x, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                    const float *w, float *out, int64_t n, float eps, int me, int threads) {
    int64_t begin, end;
    team_share(outer, me, threads, &begin, &end);
    for (int64_t a = begin; a < end; a++)
        for (int64_t b = 0; b < inner; b++)
            rms_norm_row(x + a * outer_stride + b * inner_stride, w, out + (a * inner + b) * n, n, eps);
}

API void rms_norm(const float *x, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
              const float *w, float *out, int64_t n, float eps) {
    rms_norm_share(x, outer, outer_stride, inner, inner_stride, w, out, n, eps, 0, 1);
}

/* RMSNorm of heads ``heads`` of head_dim at each of ``rows`` rows of x (stride apart), in
 * place: Qwen3's per-head norms of q and of k, inside the fused qkv rows. */
void head_norm_share(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim, const float *w,
                     float eps, int me, int threads) {
    int64_t begin, end;
    team_share(rows, me, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *row = x + r * stride + h * head_dim;
            rms_norm_row(row, w, row, head_dim, eps);
        }
}

/* residual += x, then out = rms_norm(residual): the residual add fused with
 * the next layer norm (residual, x and out are contiguous [rows, n]). */
void add_rms_norm_share(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                        float eps, int me, int threads) {
    int64_t begin, end;
    team_share(rows, me, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) {
        const float *xr = x + r * n;
        float *h = residual + r * n;
        for (int64_t i = 0; i < n; i++) h[i] = h[i] + xr[i];
        rms_norm_row(h, w, out + r * n, n, eps);
    }
}

API void add_rms_norm(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                  float eps) {
    add_rms_norm_share(x, residual, w, out, rows, n, eps, 0, 1);
}

/* The largest head_dim the kernels take (rows being rotated or widened from half precision live
 * on the stack); kernels/cpu/__init__.py's MAX_HEAD_DIM keeps larger heads on torch's kernels. */
#define MAX_HEAD_DIM 1024

/* Rotate, in place, the first `heads` heads of each token's row of qkv by the
 * token's position: x*cos + roll(x, half)*sin_signed, where sin_signed has its
 * first half negated (that is x*cos + rotate_half(x)*sin, term by term). */
void rotary_share(float *qkv, int64_t tokens, int64_t tok_stride, int64_t heads, int64_t head_dim,
                  const float *cos_table, const float *sin_table, const int64_t *positions, int me, int threads) {
    int64_t half = head_dim / 2, begin, end;
    float tmp[MAX_HEAD_DIM];
    team_share(tokens, me, threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
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

API void rotary(float *qkv, int64_t tokens, int64_t tok_stride, int64_t heads, int64_t head_dim,
            const float *cos_table, const float *sin_table, const int64_t *positions) {
    rotary_share(qkv, tokens, tok_stride, heads, head_dim, cos_table, sin_table, positions, 0, 1);
}

/* Copy each token's key and value (contiguous rows of `row` floats, one per
 * token at the given strides) to its cache slot, in the cache's ``kv_format``
 * (rounded to half, or quantized to q8_0); a negative slot is padding. */
void write_kv_share(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens, int64_t row,
                    void *k_cache, void *v_cache, const int64_t *slots, int64_t kv_format, int me, int threads) {
    int64_t begin, end;
    team_share(tokens, me, threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        store_kv_values(k + t * k_stride, k_cache, kv_format, slot * row, row);
        store_kv_values(v + t * v_stride, v_cache, kv_format, slot * row, row);
    }
}

API void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens, int64_t row,
              void *k_cache, void *v_cache, const int64_t *slots, int64_t kv_format) {
    write_kv_share(k, k_stride, v, v_stride, tokens, row, k_cache, v_cache, slots, kv_format, 0, 1);
}

/* out[r, i] = silu(gate[r, i]) * up[r, i], gate_up = [gate | up] rows of 2*n. */
void silu_mul_share(const float *gate_up, int64_t rows, int64_t n, float *out, int me, int threads) {
    int64_t begin, end;
    team_share(rows, me, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) {
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

API void silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
    silu_mul_share(gate_up, rows, n, out, 0, 1);
}

/* out[r, i] = gelu(gate[r, i]) * up[r, i] with GELU's tanh approximation (GeGLU, as torch's
 * gelu(approximate="tanh") computes it, term by term), gate_up = [gate | up] rows of 2*n. */
void gelu_tanh_mul_share(const float *gate_up, int64_t rows, int64_t n, float *out, int me, int threads) {
    const float k = 0.7978845608028654f, c = 0.044715f; /* sqrt(2 / pi) */
    int64_t begin, end;
    team_share(rows, me, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) {
        const float *g = gate_up + r * 2 * n;
        const float *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            float x = g[i], inner = k * (x + c * (x * x * x));
            o[i] = (0.5f * x * (1.0f + tanhf(inner))) * u[i];
        }
    }
}

API void gelu_tanh_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
    gelu_tanh_mul_share(gate_up, rows, n, out, 0, 1);
}

/* x *= factor over rows of n (Gemma's embedding scale), in place. */
void scale_share(float *x, int64_t rows, int64_t n, float factor, int me, int threads) {
    int64_t begin, end;
    team_share(rows, me, threads, &begin, &end);
    for (int64_t i = begin * n; i < end * n; i++) x[i] *= factor;
}

API void scale_rows(float *x, int64_t rows, int64_t n, float factor) { scale_share(x, rows, n, factor, 0, 1); }

/* The largest rank of a fused product's adapter (its parts' ranks together) the LoRA kernel takes. */
#define LORA_MAX_RANK 4096

/* One product's LoRA deltas over a step's rows, grouped by adapter, as kernels/lora.py
 * describes them in ``desc``: the group count, then per group its first row, row count, row
 * list (0: the rows are first .. first + count - 1), shrink a_t ([k, rank] row-major), rank
 * and part count, then per part its first column, column count, first rank, rank count and
 * expand b ([part ranks, part columns] row-major). For each of a group's rows, s = x_r a_t,
 * then for each part y_r[columns] += s[ranks] b, each sum over k and over ranks in order:
 * a row's bits do not depend on the others. The rows are dealt round the team. */
void lora_add_share(const int64_t *desc, const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t k,
                    int me, int threads) {
    float s[LORA_MAX_RANK];
    const int64_t *g = desc + 1;
    int64_t item = 0;
    for (int64_t group = 0; group < desc[0]; group++) {
        const int64_t first = g[0], count = g[1], rank = g[4], parts = g[5];
        const int64_t *rows = (const int64_t *)(intptr_t)g[2];
        const float *a = (const float *)(intptr_t)g[3];
        const int64_t *part = g + 6;
        for (int64_t i = 0; i < count; i++, item++) {
            if (item % threads != me) continue;
            const int64_t r = rows ? rows[i] : first + i;
            const float *xr = x + r * x_stride;
            float *yr = y + r * y_stride;
            for (int64_t j = 0; j < rank; j++) s[j] = 0.0f;
            for (int64_t c = 0; c < k; c++) {
                const float xc = xr[c];
                const float *ac = a + c * rank;
                for (int64_t j = 0; j < rank; j++) s[j] += xc * ac[j];
            }
            for (int64_t p = 0; p < parts; p++) {
                const int64_t *pp = part + p * 5;
                const int64_t col0 = pp[0], cols = pp[1], rank0 = pp[2], ranks = pp[3];
                const float *b = (const float *)(intptr_t)pp[4];
                for (int64_t c = 0; c < cols; c++) {
                    float t = 0.0f;
                    for (int64_t j = 0; j < ranks; j++) t += s[rank0 + j] * b[j * cols + c];
                    yr[col0 + c] += t;
                }
            }
        }
        g += 6 + parts * 5;
    }
}

API int64_t lora_max_rank(void) { return LORA_MAX_RANK; }

API void lora_add(const int64_t *desc, const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t k) {
    lora_add_share(desc, x, x_stride, y, y_stride, k, 0, 1);
}

/* Rows ``ids`` of a float32 table of rows of n, copied to out: an embedding lookup. */
void embed_share(const float *table, int64_t n, const int64_t *ids, int64_t rows, float *out, int me, int threads) {
    int64_t begin, end;
    team_share(rows, me, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) memcpy(out + r * n, table + ids[r] * n, n * sizeof(float));
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

/* Vector helpers for the attention kernels: unaligned loads and stores, a
 * lane-wise select, and the lanes' max and sum. */
static inline vfloat vload(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

static inline vfloat vblend(vint mask, vfloat a, vfloat b) {
    return (vfloat)(((vint)a & mask) | ((vint)b & ~mask));
}

static inline float vmax_lanes(vfloat v) {
    float m = v[0];
    for (int i = 1; i < VLANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* a * b + c rounded once, on every build: left to contraction, the compiler fuses some inlined
 * copies of a loop and not others, and then a product's bits depend on which copy ran it. */
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(__FMA__) && defined(__AVX__)
    return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    vfloat r;
    for (int i = 0; i < VLANES; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

static inline float vsum_lanes(vfloat v) {
    float t = 0.0f;
    for (int i = 0; i < VLANES; i++) t += v[i];
    return t;
}

/* Key or value ``t`` of block ``block`` for KV head ``kh``, as float32: in place, or
 * widened from half or q8_0 into ``buf``. */
static inline const float *cache_row(const void *cache, int64_t kv_format, int64_t block, int64_t block_size,
                                     int64_t t, int64_t kv_row, int64_t offset, int64_t head_dim, float *buf) {
    return kv_values(cache, kv_format, (block * block_size + t) * kv_row + offset, head_dim, buf);
}

/* The decode kernel reads keys and values a tile at a time: up to this many floats of one KV
 * head's consecutive tokens in a block, widened once into a buffer on the stack that every query
 * head of the group then reads (a float32 cache is read in place). */
#define DECODE_TILE_FLOATS 2048
#define DECODE_TILE_TOKENS 16

/* Tokens t .. t + m - 1 of block ``block``, KV head at ``offset``, as float32 rows: returns the
 * first row and sets *row_stride (floats from one row to the next). */
static inline const float *cache_tile(const void *cache, int64_t kv_format, int64_t block, int64_t block_size,
                                      int64_t t, int64_t m, int64_t kv_row, int64_t offset, int64_t head_dim,
                                      float *buf, int64_t *row_stride) {
    if (kv_format == KV_F32) {
        *row_stride = kv_row;
        return (const float *)cache + (block * block_size + t) * kv_row + offset;
    }
    for (int64_t x = 0; x < m; x++)
        kv_values(cache, kv_format, (block * block_size + t + x) * kv_row + offset, head_dim, buf + x * head_dim);
    *row_stride = head_dim;
    return buf;
}

/* Asks for the rows of tokens t .. t + m - 1 of block ``block`` at ``offset`` (one head), into L2,
 * a tile ahead of their use: the caches' blocks lie anywhere, and a head's rows a whole token row
 * apart in them, which the hardware's prefetchers do not follow (into L1 it was slower). */
static inline void prefetch_tile(const void *cache, int64_t kv_format, int64_t block, int64_t block_size, int64_t t,
                                 int64_t m, int64_t kv_row, int64_t offset, int64_t head_dim) {
    for (int64_t x = 0; x < m; x++) {
        int64_t at = (block * block_size + t + x) * kv_row + offset, bytes;
        const char *p;
        if (kv_format == KV_Q8_0) {
            p = (const char *)cache + at / Q8_0_VALUES * Q8_0_BYTES;
            bytes = head_dim / Q8_0_VALUES * Q8_0_BYTES;
        } else {
            int64_t size = kv_format == KV_F32 ? 4 : 2;
            p = (const char *)cache + at * size;
            bytes = head_dim * size;
        }
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
    }
}

/* A walk over the tiles of a context's tokens [first, len): runs of at most per_tile tokens that
 * stay inside one block; b is the block's index in the table, j0 its first token, t the tile's
 * first token in it and m its length. */
typedef struct {
    int64_t b, j0, t, m;
} tile_walk;

static inline tile_walk tile_walk_from(int64_t first, int64_t block_size) {
    tile_walk w = {first / block_size, first / block_size * block_size, first % block_size, 0};
    return w;
}

/* Moves to the next tile (the first call: to the first); 0 past the last. */
static inline int next_tile(tile_walk *w, int64_t len, int64_t block_size, int64_t per_tile) {
    w->t += w->m;
    if (w->t == block_size) w->b++, w->j0 += block_size, w->t = 0;
    if (w->j0 + w->t >= len) return 0;
    const int64_t n = len - w->j0 < block_size ? len - w->j0 : block_size;
    w->m = n - w->t < per_tile ? n - w->t : per_tile;
    return 1;
}

/* KV head kh's rows of tile w as float32 (cache_tile), the same head's rows of the next tile (of
 * a walk to ``len`` by ``per_tile``) asked for. */
static inline __attribute__((always_inline)) const float *head_tile(
    const void *cache, int64_t kv_format, const int32_t *table, tile_walk w, int64_t len, int64_t per_tile,
    int64_t block_size, int64_t kv_row, int64_t kh, int64_t head_dim, float *buf, int64_t *row_stride) {
    tile_walk ahead = w;
    if (next_tile(&ahead, len, block_size, per_tile))
        prefetch_tile(cache, kv_format, table[ahead.b], block_size, ahead.t, ahead.m, kv_row, kh * head_dim, head_dim);
    return cache_tile(cache, kv_format, table[w.b], block_size, w.t, w.m, kv_row, kh * head_dim, head_dim, buf,
                      row_stride);
}

/* decode_group for a head_dim that is not whole vectors: a dot product per key, and the values
 * summed into the output in memory. */
static void decode_group_any(const float *q, float *o, const int32_t *table, int64_t len, int64_t first,
                             int64_t kv_row, int64_t offset, int64_t group, int64_t head_dim, const void *k_cache,
                             const void *v_cache, int64_t kv_format, int64_t block_size, float scale,
                             float *scratch) {
    const int64_t keys = len - first;
    float buf[MAX_HEAD_DIM];
    for (tile_walk w = tile_walk_from(first, block_size); next_tile(&w, len, block_size, 1);) {
        const float *k = cache_row(k_cache, kv_format, table[w.b], block_size, w.t, kv_row, offset, head_dim, buf);
        for (int64_t g = 0; g < group; g++)
            scratch[g * keys + w.j0 + w.t - first] = dot(q + g * head_dim, k, head_dim) * scale;
    }
    for (int64_t g = 0; g < group; g++) softmax(scratch + g * keys, keys);
    memset(o, 0, sizeof(float) * group * head_dim);
    for (tile_walk w = tile_walk_from(first, block_size); next_tile(&w, len, block_size, 1);) {
        const float *v = cache_row(v_cache, kv_format, table[w.b], block_size, w.t, kv_row, offset, head_dim, buf);
        for (int64_t g = 0; g < group; g++) {
            float p = scratch[g * keys + w.j0 + w.t - first];
            float *og = o + g * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) og[i] += p * v[i];
        }
    }
}

/* The sums of a[0]'s, ..., a[7]'s lanes, in that order: a transposing tree of shuffles and
 * adds, where separate horizontal sums would each walk the lanes one by one; every lane's sum is
 * ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
static inline vfloat vsum8(const vfloat a[8]) {
    const vint even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const vint low = {0, 1, 8, 9, 4, 5, 12, 13}, high = {2, 3, 10, 11, 6, 7, 14, 15};
    const vint first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    vfloat t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], low) + __builtin_shuffle(t[2 * i], t[2 * i + 1], high);
    return __builtin_shuffle(u[0], u[1], first) + __builtin_shuffle(u[0], u[1], second);
}

/* One decode's attention for the query heads of KV heads kh0 .. kh1 - 1, ``group`` each (see
 * paged_decode_attention). Always inlined with a constant head_dim for the
 * common sizes, so that the dot products and the value accumulation compile
 * to fixed-length vector code. Keys and values go by tiles (cache_tile), and
 * within a tile by KV head: a head's rows are strips of the tokens' rows in
 * the cache, the range's strips lie side by side, and the next tile's are
 * asked for while this one is computed (prefetch_tile); a whole pass over
 * the context per head waited on memory at every row. Each head's tile is
 * widened once for its group, eight keys' dot products run side by side and
 * are summed across lanes together (vsum8), and each query head's output is
 * accumulated in registers over a tile's values, 64 dimensions at a time.
 * Per query head the arithmetic and its order do not depend on the range,
 * so neither do the outputs' bits. scratch holds (kh1 - kh0) * group * len
 * scores. Multiply-adds may fuse (as in the prefill kernel). */
static inline __attribute__((always_inline)) void decode_group(
    const float *qd, float *od, const int32_t *table, int64_t len, int64_t window, int64_t kh0, int64_t kh1,
    int64_t kv_heads, int64_t group, const int64_t head_dim, const void *k_cache, const void *v_cache,
    int64_t kv_format, int64_t block_size, float scale, float *scratch) {
    int64_t kv_row = kv_heads * head_dim;
    /* A sliding window keeps the last ``window`` keys: scores are indexed from the first of them. */
    const int64_t first = window > 0 && len > window ? len - window : 0, keys = len - first;
    const float *q = qd + kh0 * group * head_dim;
    float *o = od + kh0 * group * head_dim;
    const int64_t rows = (kh1 - kh0) * group; /* query heads of the range */
    if (head_dim % VLANES != 0 || head_dim > MAX_HEAD_DIM) {
        for (int64_t kh = kh0; kh < kh1; kh++)
            decode_group_any(qd + kh * group * head_dim, od + kh * group * head_dim, table, len, first, kv_row,
                             kh * head_dim, group, head_dim, k_cache, v_cache, kv_format, block_size, scale, scratch);
        return;
    }
    float buf[DECODE_TILE_FLOATS];
    const int64_t per_tile = DECODE_TILE_FLOATS / head_dim < DECODE_TILE_TOKENS ? DECODE_TILE_FLOATS / head_dim
                                                                                 : DECODE_TILE_TOKENS;
    const int64_t vectors = head_dim / VLANES;
    /* scores[h][j] = scale * q_h . k_j */
    for (tile_walk w = tile_walk_from(first, block_size); next_tile(&w, len, block_size, per_tile);) {
        for (int64_t kh = kh0; kh < kh1; kh++) {
            int64_t rs;
            const float *k = head_tile(k_cache, kv_format, table, w, len, per_tile, block_size, kv_row, kh, head_dim,
                                        buf, &rs);
            for (int64_t h = (kh - kh0) * group; h < (kh - kh0 + 1) * group; h++) {
                const float *qh = q + h * head_dim;
                float *sh = scratch + h * keys + w.j0 + w.t - first;
                int64_t x = 0;
                for (; x + 8 <= w.m; x += 8) { /* eight chains of multiply-adds: the FMA units' latency covered */
                    const float *k0 = k + x * rs;
                    vfloat a[8] = {{0}};
                    for (int64_t c = 0; c < head_dim; c += VLANES) {
                        vfloat qv = vload(qh + c);
                        for (int i = 0; i < 8; i++) a[i] += qv * vload(k0 + i * rs + c);
                    }
                    vstore(sh + x, vsum8(a) * scale);
                }
                /* the same tree of sums, so that a score's bits do not depend on where its tile ends */
                for (; x < w.m; x++) {
                    vfloat a[8] = {{0}};
                    for (int64_t c = 0; c < head_dim; c += VLANES) a[0] += vload(qh + c) * vload(k + x * rs + c);
                    sh[x] = vsum8(a)[0] * scale;
                }
            }
        }
    }
    for (int64_t h = 0; h < rows; h++) softmax(scratch + h * keys, keys);
    /* out_h = sum_j p[h][j] * v_j, summed in registers over each tile */
    memset(o, 0, sizeof(float) * rows * head_dim);
    for (tile_walk w = tile_walk_from(first, block_size); next_tile(&w, len, block_size, per_tile);) {
        for (int64_t kh = kh0; kh < kh1; kh++) {
            int64_t rs;
            const float *v = head_tile(v_cache, kv_format, table, w, len, per_tile, block_size, kv_row, kh, head_dim,
                                        buf, &rs);
            for (int64_t h = (kh - kh0) * group; h < (kh - kh0 + 1) * group; h++) {
                const float *p = scratch + h * keys + w.j0 + w.t - first;
                float *oh = o + h * head_dim;
                for (int64_t c0 = 0; c0 < vectors; c0 += 8) {
                    const int64_t cn = vectors - c0 < 8 ? vectors - c0 : 8;
                    vfloat acc[8];
                    for (int64_t c = 0; c < cn; c++) acc[c] = vload(oh + (c0 + c) * VLANES);
                    for (int64_t x = 0; x < w.m; x++) {
                        const float wx = p[x], *vx = v + x * rs + c0 * VLANES;
                        for (int64_t c = 0; c < cn; c++) acc[c] += wx * vload(vx + c * VLANES);
                    }
                    for (int64_t c = 0; c < cn; c++) vstore(oh + (c0 + c) * VLANES, acc[c]);
                }
            }
        }
    }
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
 * out + q_rows[d]*out_stride; with a sliding ``window`` > 0 only the last ``window`` of those tokens.
 * The caches are [blocks, block_size, kv_heads,
 * head_dim]; each cached row (one KV head of one token) is read once for the
 * query heads that share it. The work items, a decode's range of neighbouring
 * KV heads each, are dealt round the team; thread i uses scratch + i*scratch_stride,
 * which holds at least heads * max(seq_lens) floats.
 */
__attribute__((optimize("fp-contract=fast"))) void decode_attention_share(
                            const float *q, int64_t q_stride, const int64_t *q_rows, int64_t num_decodes,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, const void *k_cache,
                            const void *v_cache, int64_t kv_format, int64_t block_size, const int32_t *block_tables,
                            int64_t table_stride, const int64_t *tables, const int64_t *seq_lens, int64_t window,
                            float scale, float *out, int64_t out_stride, float *scratch, int64_t scratch_stride,
                            int me, int threads) {
    /* Each decode's KV heads in ``parts`` ranges of neighbours: one a thread for a lone decode, two
     * items a thread while decodes are few, whole decodes once they are many. */
    int64_t parts = num_decodes == 1                ? threads
                    : num_decodes >= 2 * threads ? 1
                                                 : (2 * threads + num_decodes - 1) / num_decodes;
    parts = parts < kv_heads ? parts : kv_heads;
    int64_t group = heads / kv_heads, items = num_decodes * parts;
    float *scr = scratch + me * scratch_stride;
    for (int64_t item = me; item < items; item += threads) {
        int64_t d = item / parts, part = item % parts;
        int64_t kh0 = part * kv_heads / parts, kh1 = (part + 1) * kv_heads / parts;
        const float *qd = q + q_rows[d] * q_stride;
        float *od = out + q_rows[d] * out_stride;
        const int32_t *table = block_tables + tables[d] * table_stride;
#define DECODE(D) \
    decode_group(qd, od, table, seq_lens[d], window, kh0, kh1, kv_heads, group, D, k_cache, v_cache, kv_format, \
                 block_size, scale, scr)
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

API void paged_decode_attention(const float *q, int64_t q_stride, const int64_t *q_rows, int64_t num_decodes,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, const void *k_cache,
                            const void *v_cache, int64_t kv_format, int64_t block_size, const int32_t *block_tables,
                            int64_t table_stride, const int64_t *tables, const int64_t *seq_lens, int64_t window,
                            float scale, float *out, int64_t out_stride, float *scratch, int64_t scratch_stride,
                            int64_t threads) {
    int64_t keys = 0;
    for (int64_t d = 0; d < num_decodes; d++) keys += seq_lens[d];
    int parallel = threads > 1 && num_decodes * kv_heads > 1 && keys * heads * head_dim >= PARALLEL_MIN_WORK;
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    decode_attention_share(q, q_stride, q_rows, num_decodes, heads, kv_heads, head_dim, k_cache, v_cache, kv_format,
                           block_size, block_tables, table_stride, tables, seq_lens, window, scale, out, out_stride,
                           scratch, scratch_stride, team_me(), team_size());
}

/* The prefill kernel's key count for a context of n keys: whole vectors, the
 * padding zeroed. Callers size its scratch with it (kernels/cpu/__init__.py). */
API int64_t padded_keys(int64_t n) { return (n + VLANES - 1) / VLANES * VLANES; }

/* One query head of a prefill chunk over keys and values stored transposed
 * ([head_dim][stride], stride a multiple of VLANES, zeros past the last key);
 * always inlined with a constant head_dim (8 and 16, the sizes the dispatcher
 * sends here). Three passes over the keys, in vectors of VLANES keys: the
 * scores (each a register sum over head_dim) and their max; exp and its sum
 * (lanes past `len` are zeroed); then each output dimension, divided by the sum
 * at the end. s holds the scores of the vectors that cover `len`. */
static inline __attribute__((always_inline)) void prefill_query_head(
    const float *qh, const float *kt, const float *vt, int64_t lo, int64_t len, int64_t stride,
    const int64_t head_dim, float scale, float *s, float *oh) {
    const vint lane = {0, 1, 2, 3, 4, 5, 6, 7};
    const vfloat zero = {0};
    const int32_t begin = (int32_t)lo, end = (int32_t)len;
    const int64_t j0 = lo / VLANES * VLANES;
    vfloat vmax = zero - INFINITY;
    for (int64_t j = j0; j < len; j += VLANES) {
        vfloat acc = zero;
        for (int64_t d = 0; d < head_dim; d++) acc += qh[d] * vload(kt + d * stride + j);
        vint at = lane + (int32_t)j;
        acc = vblend((at < end) & (at >= begin), acc * scale, zero - INFINITY);
        vstore(s + j, acc);
        vmax = vblend(acc > vmax, acc, vmax);
    }
    float m = vmax_lanes(vmax);
    vfloat vsum = zero;
    for (int64_t j = j0; j < len; j += VLANES) {
        vfloat x = clamp_v(vload(s + j) - m), e;
        EXP_BODY(vfloat, vint, x, e);
        vint at = lane + (int32_t)j;
        e = vblend((at < end) & (at >= begin), e, zero);
        vstore(s + j, e);
        vsum += e;
    }
    float inv = 1.0f / vsum_lanes(vsum);
    for (int64_t d = 0; d < head_dim; d++) {
        vfloat acc = zero;
        for (int64_t j = j0; j < len; j += VLANES) acc += vload(s + j) * vload(vt + d * stride + j);
        oh[d] = vsum_lanes(acc) * inv;
    }
}

/* Attention of one request's prefill chunk, read from the paged caches.
 *
 * Query i (row q + i*q_stride, heads of head_dim) sits at position
 * seq_len - n + i and attends to the request's cached tokens 0 .. its own
 * position (with a sliding ``window`` > 0, to the last ``window`` of them); its output goes to
 * out + i*out_stride. The request's first
 * seq_len keys and values are first copied transposed (as float32), per KV
 * head [head_dim][stride] with stride = padded_keys(seq_len) (zeros after the
 * last key), into kv_scratch (2 * kv_heads * head_dim * stride floats): all n
 * queries read them, and a query's scores and its output are then vector
 * operations along the keys instead of one short dot product per key (which
 * is what the decode kernel does, and what costs there for small head
 * dimensions). The team shares the copy (by channel), meets at ``barrier``,
 * then deals the queries round; thread t keeps its scores at
 * score_scratch + t*stride. Unlike the rest of this file, multiply-adds may
 * fuse here: attention agrees with torch's to rounding either way, and fused
 * it is faster.
 */
__attribute__((optimize("fp-contract=fast"))) void prefill_attention_share(
    const float *q, int64_t q_stride, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
    const void *k_cache, const void *v_cache, int64_t kv_format, int64_t block_size, const int32_t *table,
    int64_t seq_len, int64_t window, float scale, float *out, int64_t out_stride, float *kv_scratch,
    float *score_scratch, team_barrier *barrier, int me, int threads) {
    int64_t group = heads / kv_heads;
    int64_t kv_row = kv_heads * head_dim;
    int64_t stride = padded_keys(seq_len);
    float *kt = kv_scratch;
    float *vt = kv_scratch + kv_row * stride;
    int64_t c0, c1;
    team_share(kv_row, me, threads, &c0, &c1);
    for (int64_t j0 = 0, b = 0; j0 < seq_len; j0 += block_size, b++) {
        int64_t m = seq_len - j0 < block_size ? seq_len - j0 : block_size;
        for (int64_t t = 0; t < m; t++) {
            int64_t at = ((int64_t)table[b] * block_size + t) * kv_row;
            for (int64_t c = c0; c < c1; c++) {
                kt[c * stride + j0 + t] = kv_value(k_cache, kv_format, at + c);
                vt[c * stride + j0 + t] = kv_value(v_cache, kv_format, at + c);
            }
        }
    }
    for (int64_t c = c0; c < c1; c++)
        for (int64_t j = seq_len; j < stride; j++) kt[c * stride + j] = vt[c * stride + j] = 0.0f;
    team_sync(barrier, threads);
    int64_t first = seq_len - n;
    float *s = score_scratch + me * stride;
    for (int64_t i = me; i < n; i += threads) {
        int64_t len = first + i + 1, lo = window > 0 && len > window ? len - window : 0;
        const float *qi = q + i * q_stride;
        float *oi = out + i * out_stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *kh = kt + (h / group) * head_dim * stride;
            const float *vh = vt + (h / group) * head_dim * stride;
#define PREFILL(D) prefill_query_head(qi + h * head_dim, kh, vh, lo, len, stride, D, scale, s, oi + h * head_dim)
            switch (head_dim) {
                case 8: PREFILL(8); break;
                case 16: PREFILL(16); break;
                default: PREFILL(head_dim);
            }
#undef PREFILL
        }
    }
}

API void paged_prefill_attention(const float *q, int64_t q_stride, int64_t n, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, const void *k_cache, const void *v_cache, int64_t kv_format,
                                 int64_t block_size, const int32_t *table, int64_t seq_len, int64_t window,
                                 float scale, float *out, int64_t out_stride, float *kv_scratch, float *score_scratch,
                                 int64_t threads) {
    team_barrier barrier = {0, 0};
    int parallel = threads > 1 && n > 1 && n * (seq_len - n / 2) * heads * head_dim >= PARALLEL_MIN_WORK;
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    prefill_attention_share(q, q_stride, n, heads, kv_heads, head_dim, k_cache, v_cache, kv_format, block_size, table,
                            seq_len, window, scale, out, out_stride, kv_scratch, score_scratch, &barrier, team_me(),
                            team_size());
}

/* Reads ``bytes`` (a multiple of 4096) at ``p`` once on ``threads`` threads, each a contiguous
 * share, as a product streams its weights: the memory's read bandwidth that bench membw
 * reports and the quantized products are measured against. Returns the xor of the 64-bit
 * words, so that no load can be left out. */
API uint64_t stream_read(const void *p, int64_t bytes, int64_t threads) {
    uint64_t total = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) reduction(^ : total)
    {
        int64_t begin, end;
        team_share(bytes / 4096, team_me(), team_size(), &begin, &end);
        const uint8_t *w = (const uint8_t *)p + begin * 4096, *stop = (const uint8_t *)p + end * 4096;
        vint acc[8] = {{0}};
        for (; w < stop; w += 8 * sizeof(vint)) /* eight independent chains of loads */
            for (int j = 0; j < 8; j++) {
                vint v;
                memcpy(&v, w + j * sizeof(vint), sizeof v);
                acc[j] ^= v;
            }
        for (int j = 1; j < 8; j++) acc[0] ^= acc[j];
        for (int l = 0; l < VLANES; l++) total ^= (uint64_t)(uint32_t)acc[0][l] << (l % 2 * 32);
    }
    return total;
}

/* A few rows times a float32 weight [n][k]: out[r][o] = sum_i x[r][i] * w[o][i] (+ bias[o]),
 * for up to DENSE_FEW_ROWS rows (a speculative verification's: a request's last token and its
 * drafts). BLAS's gemm repacks the whole weight on every call, which for so few rows costs
 * several times the product itself; here each weight row is read once for all the rows, as a
 * matrix-vector product reads it for one, so the product runs at the speed the weight streams
 * from memory. Always inlined with a constant row count, so the sums stay in registers. */
#define DENSE_FEW_ROWS 8
#define DENSE_BLOCK_MAX 4
#define DENSE_PREFETCH 2048 /* floats ahead (8 KiB): weights arrive while the rows before them are multiplied */

/* Weight rows first .. first + count - 1 times the m rows of x: each x vector is loaded once for
 * all of them, and count streams of weights are in flight, with m * count sums in registers. */
static inline __attribute__((always_inline)) void dense_block(
    const float *x, const int64_t m, int64_t x_stride, const float *w, int64_t k, const float *bias, float *out,
    int64_t out_stride, int64_t first, const int64_t count) {
    const vfloat zero = {0};
    const int64_t kv = k / VLANES * VLANES;
    const float *wr = w + first * k;
    vfloat acc[DENSE_BLOCK_MAX][DENSE_FEW_ROWS];
    for (int64_t j = 0; j < count; j++)
        for (int64_t r = 0; r < m; r++) acc[j][r] = zero;
    for (int64_t i = 0; i < kv; i += VLANES) {
        vfloat wv[DENSE_BLOCK_MAX];
        for (int64_t j = 0; j < count; j++) {
            __builtin_prefetch(wr + j * k + i + DENSE_PREFETCH);
            wv[j] = vload(wr + j * k + i);
        }
        for (int64_t r = 0; r < m; r++) {
            vfloat xv = vload(x + r * x_stride + i);
            for (int64_t j = 0; j < count; j++) acc[j][r] = vfma(xv, wv[j], acc[j][r]);
        }
    }
    for (int64_t j = 0; j < count; j++) {
        for (int64_t r = 0; r < m; r++) {
            float sum = vsum_lanes(acc[j][r]);
            /* fmaf, as vfma above: a row's bits must not depend on the row count. */
            for (int64_t i = kv; i < k; i++) sum = fmaf(x[r * x_stride + i], wr[j * k + i], sum);
            out[r * out_stride + first + j] = bias ? sum + bias[first + j] : sum;
        }
    }
}

static inline __attribute__((always_inline)) void dense_rows_range(
    const float *x, const int64_t m, int64_t x_stride, const float *w, int64_t k, const float *bias, float *out,
    int64_t out_stride, int64_t begin, int64_t end, const int64_t block) {
    int64_t o = begin;
    for (; o + block <= end; o += block) dense_block(x, m, x_stride, w, k, bias, out, out_stride, o, block);
    for (; o < end; o++) dense_block(x, m, x_stride, w, k, bias, out, out_stride, o, 1);
}

/* Fused multiply-adds are explicit (vfma, fmaf): the file is built without contraction, for the
 * element-wise kernels' sake. */
void dense_few_rows_share(const float *x, int64_t m, int64_t x_stride, const float *w, int64_t n, int64_t k,
                          const float *bias, float *out, int64_t out_stride, int me, int threads) {
    /* Output rows in whole cache lines per thread, so that no two threads write one line. */
    int64_t per = (n + threads - 1) / threads;
    per = (per + 15) / 16 * 16;
    int64_t begin = me * per, end = begin + per < n ? begin + per : n;
    if (begin >= end) return;
    /* Weight rows per block: four for one or two rows, two up to five (their sums fill at most
     * 10 of AVX2's 16 vector registers), one beyond. */
    switch (m) {
#define ROWS(M, B) \
    case M: dense_rows_range(x, M, x_stride, w, k, bias, out, out_stride, begin, end, B); break;
        ROWS(1, 4) ROWS(2, 4) ROWS(3, 2) ROWS(4, 2) ROWS(5, 2) ROWS(6, 1) ROWS(7, 1) ROWS(8, 1)
#undef ROWS
    }
}

API int64_t dense_few_rows_max(void) { return DENSE_FEW_ROWS; }

API void dense_few_rows(const float *x, int64_t m, int64_t x_stride, const float *w, int64_t n, int64_t k,
                        const float *bias, float *out, int64_t out_stride, int64_t threads) {
    int parallel = threads > 1 && n * k >= PARALLEL_MIN_WORK;
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    dense_few_rows_share(x, m, x_stride, w, n, k, bias, out, out_stride, team_me(), team_size());
}
