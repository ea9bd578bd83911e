/* CPU kernels for the decode path: the per-layer work between the matrix
 * products, one call each instead of a handful of torch calls.
 *
 * Compiled on the machine that runs them (kernels/cpu/__init__.py), with
 * -ffp-contract=off so that a*b + c*d is two roundings, as in torch's own
 * element-wise kernels: the rotary embedding below is then bitwise the one
 * transformers computes. Sums (norms, dot products) are vectorised reductions
 * (`omp simd`, no OpenMP runtime): lane-wise partial sums like torch's own
 * reductions, though not in the same order, so they agree to rounding.
 *
 * All tensors are float32 (caches included) and all indices int64 unless
 * noted; "stride" means elements between consecutive rows.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void rms_norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* out = w * x / sqrt(mean(x^2) + eps) over rows of n: `outer` groups of `inner`
 * rows (row (a, b) at x + a*outer_stride + b*inner_stride); out is contiguous. */
void rms_norm(const float *x, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
              const float *w, float *out, int64_t n, float eps) {
    for (int64_t a = 0; a < outer; a++)
        for (int64_t b = 0; b < inner; b++)
            rms_norm_row(x + a * outer_stride + b * inner_stride, w, out + (a * inner + b) * n, n, eps);
}

/* residual += x, then out = rms_norm(residual): the residual add fused with
 * the next layer norm (residual, x and out are contiguous [rows, n]). */
void add_rms_norm(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
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
void rotary(float *qkv, int64_t tokens, int64_t tok_stride, int64_t heads, int64_t head_dim,
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
void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens, int64_t row,
              float *k_cache, float *v_cache, const int64_t *slots) {
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + slot * row, v + t * v_stride, row * sizeof(float));
    }
}

/* out[r, i] = silu(gate[r, i]) * up[r, i], gate_up = [gate | up] rows of 2*n. */
void silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n;
        const float *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Attention of one-token queries over their paged contexts, read in place.
 *
 * Decode d is query row q_rows[d] (heads of head_dim at q + row*q_stride)
 * and attends to the first seq_lens[d] tokens of the blocks listed at
 * block_tables + tables[d]*table_stride (int32 block ids); its output goes to
 * out + q_rows[d]*out_stride. The caches are [blocks, block_size, kv_heads,
 * head_dim]. The query heads that share a KV head are handled together, so
 * each key and value is read once per KV head. `scratch` holds at least
 * group * max(seq_lens) floats.
 */
void paged_decode_attention(const float *q, int64_t q_stride, const int64_t *q_rows, int64_t num_decodes,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, const float *k_cache,
                            const float *v_cache, int64_t block_size, const int32_t *block_tables,
                            int64_t table_stride, const int64_t *tables, const int64_t *seq_lens, float scale,
                            float *out, int64_t out_stride, float *scratch) {
    int64_t group = heads / kv_heads;
    int64_t kv_row = kv_heads * head_dim;
    for (int64_t d = 0; d < num_decodes; d++) {
        const float *qd = q + q_rows[d] * q_stride;
        float *od = out + q_rows[d] * out_stride;
        const int32_t *table = block_tables + tables[d] * table_stride;
        int64_t len = seq_lens[d];
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const float *qh = qd + kh * group * head_dim;
            float *oh = od + kh * group * head_dim;
            for (int64_t j = 0; j < len; j++) {  /* scores[g][j] = scale * q_g . k_j */
                const float *k = k_cache + ((int64_t)table[j / block_size] * block_size + j % block_size) * kv_row
                                 + kh * head_dim;
                for (int64_t g = 0; g < group; g++) scratch[g * len + j] = dot(qh + g * head_dim, k, head_dim) * scale;
            }
            for (int64_t g = 0; g < group; g++) {  /* softmax over j */
                float *sc = scratch + g * len;
                float m = sc[0];
                for (int64_t j = 1; j < len; j++) m = sc[j] > m ? sc[j] : m;
                float total = 0.0f;
                for (int64_t j = 0; j < len; j++) {
                    sc[j] = expf(sc[j] - m);
                    total += sc[j];
                }
                float inv = 1.0f / total;
                for (int64_t j = 0; j < len; j++) sc[j] *= inv;
            }
            memset(oh, 0, sizeof(float) * group * head_dim);
            for (int64_t j = 0; j < len; j++) {  /* out_g = sum_j p[g][j] * v_j */
                const float *v = v_cache + ((int64_t)table[j / block_size] * block_size + j % block_size) * kv_row
                                 + kh * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    float p = scratch[g * len + j];
                    float *o = oh + g * head_dim;
#pragma omp simd
                    for (int64_t i = 0; i < head_dim; i++) o[i] += p * v[i];
                }
            }
        }
    }
}
