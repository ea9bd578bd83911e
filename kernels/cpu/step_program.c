/* A model step as one call: a list of kernel operations run by one team of threads.
 *
 * core/worker/cpu_program.py writes a decode step (or one request's prefill
 * chunk) as a program: the model's recipe (core/models/recipe.py) emitted
 * operation by operation, its products in kernels/quant.py's tiled formats,
 * or float32 for the few rows kernels/cpu's dense kernel takes. OP_WORDS
 * int64 per operation, the opcode first, then its arguments (addresses of
 * fixed buffers and weights, sizes; floats as
 * the bits of a double). ``run_program`` runs it once per step with the
 * step's row count (and, for a chunk, its request's context length): one
 * ctypes call, the GIL released throughout, and one OpenMP team whose
 * threads take their share of each operation and meet at a spinning barrier
 * between operations (cpu_common.h), so a step wakes its threads once. The
 * opcodes and layouts below are mirrored in cpu_program.py's ``Op``.
 */

#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#define OP_WORDS 24

enum {
    OP_EMBED_FLOAT = 1,  /* table, n, ids, out: rows of a float32 table */
    OP_EMBED_PACKED,     /* data, type, n, ids, out: rows of a packed matrix (quant_kernels.c) */
    OP_RMS_NORM,         /* x, w, out, n, eps */
    OP_ADD_RMS_NORM,     /* x, residual, w, out, n, eps */
    OP_HEAD_NORM,        /* x, stride, heads, head_dim, w, eps: in place */
    OP_LINEAR,           /* layer, x, out, out_stride, quantize, scratch, last_row_only */
    OP_ROTARY,           /* qkv, stride, heads, head_dim, cos, sin, positions */
    OP_WRITE_KV,         /* k, k_stride, v, v_stride, row, k_cache, v_cache, slots, kv_format */
    OP_DECODE_ATTENTION, /* q, q_stride, q_rows, heads, kv_heads, head_dim, k_cache, v_cache, kv_format,
                            block_size, block_tables, table_stride, tables, seq_lens, scale, out, out_stride,
                            scratch, scratch_stride, window */
    OP_PREFILL_ATTENTION, /* q, q_stride, heads, kv_heads, head_dim, k_cache, v_cache, kv_format, block_size,
                             table, scale, out, out_stride, kv_scratch, score_scratch, window */
    OP_SILU_MUL,          /* gate_up, n, out */
    OP_CHUNK_LENS,        /* lens: lens[i] = seq_len - rows + 1 + i, the context of each query of a chunk */
    OP_GELU_TANH_MUL,     /* gate_up, n, out */
    OP_SCALE,             /* x, n, factor: in place */
    OP_DENSE,             /* w, n, k, bias, x, out, out_stride, last_row_only: a float32 product of at most
                             DENSE_FEW_ROWS rows (cpu_kernels.c), x rows of k back to back */
    OP_LORA,              /* desc, x, k, out, out_stride: a product's LoRA deltas (kernels/lora.py's desc) */
    OP_MOE,               /* desc, x, router, out, quantize, scratch: a layer's experts (moe_kernels.c) */
};

/* The kernels' shares (cpu_kernels.c, quant_kernels.c). */
void rms_norm_share(const float *x, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                    const float *w, float *out, int64_t n, float eps, int me, int threads);
void head_norm_share(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim, const float *w,
                     float eps, int me, int threads);
void add_rms_norm_share(const float *x, float *residual, const float *w, float *out, int64_t rows, int64_t n,
                        float eps, int me, int threads);
void rotary_share(float *qkv, int64_t tokens, int64_t tok_stride, int64_t heads, int64_t head_dim,
                  const float *cos_table, const float *sin_table, const int64_t *positions, int me, int threads);
void write_kv_share(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens, int64_t row,
                    void *k_cache, void *v_cache, const int64_t *slots, int64_t kv_format, int me, int threads);
void silu_mul_share(const float *gate_up, int64_t rows, int64_t n, float *out, int me, int threads);
void embed_share(const float *table, int64_t n, const int64_t *ids, int64_t rows, float *out, int me, int threads);
void decode_attention_share(const float *q, int64_t q_stride, const int64_t *q_rows, int64_t num_decodes,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, const void *k_cache,
                            const void *v_cache, int64_t kv_format, int64_t block_size, const int32_t *block_tables,
                            int64_t table_stride, const int64_t *tables, const int64_t *seq_lens, int64_t window,
                            float scale, float *out, int64_t out_stride, float *scratch, int64_t scratch_stride,
                            int me, int threads);
void prefill_attention_share(const float *q, int64_t q_stride, int64_t n, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, const void *k_cache, const void *v_cache, int64_t kv_format,
                             int64_t block_size, const int32_t *table, int64_t seq_len, int64_t window,
                             float scale, float *out, int64_t out_stride, float *kv_scratch, float *score_scratch,
                             team_barrier *barrier, int me, int threads);
void dense_few_rows_share(const float *x, int64_t m, int64_t x_stride, const float *w, int64_t n, int64_t k,
                          const float *bias, float *out, int64_t out_stride, int me, int threads);
void lora_add_share(const int64_t *desc, const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t k,
                    int me, int threads);
void gelu_tanh_mul_share(const float *gate_up, int64_t rows, int64_t n, float *out, int me, int threads);
void scale_share(float *x, int64_t rows, int64_t n, float factor, int me, int threads);
void packed_rows_share(int64_t type, const void *w, int64_t k, const int64_t *ids, int64_t n, float *out, int me,
                       int threads);
void moe_share(const int64_t *desc, const float *x, const float *router, int64_t n, float *out, int64_t quantize,
               uint8_t *scratch, team_barrier *barrier, int me, int threads);
void linear_share(const int64_t *layer, const float *x, int64_t n, float *out, int64_t out_stride, int64_t quantize,
                  uint8_t *scratch, team_barrier *barrier, int me, int threads);

#define P(i) ((void *)(intptr_t)op[i])
#define F(i) ((float *)(intptr_t)op[i])
#define I(i) ((int64_t *)(intptr_t)op[i])

static float as_float(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return (float)d;
}

/* Thread me's share of one operation over ``rows`` rows (a chunk's request at ``seq_len``). */
static void run_op(const int64_t *op, int64_t rows, int64_t seq_len, team_barrier *barrier, int me, int threads) {
    switch (op[0]) {
        case OP_EMBED_FLOAT:
            embed_share(F(1), op[2], I(3), rows, F(4), me, threads);
            break;
        case OP_EMBED_PACKED:
            packed_rows_share(op[2], P(1), op[3], I(4), rows, F(5), me, threads);
            break;
        case OP_RMS_NORM:
            rms_norm_share(F(1), rows, op[4], 1, 0, F(2), F(3), op[4], as_float(op[5]), me, threads);
            break;
        case OP_ADD_RMS_NORM:
            add_rms_norm_share(F(1), F(2), F(3), F(4), rows, op[5], as_float(op[6]), me, threads);
            break;
        case OP_HEAD_NORM:
            head_norm_share(F(1), rows, op[2], op[3], op[4], F(5), as_float(op[6]), me, threads);
            break;
        case OP_LINEAR: {
            const int64_t *layer = I(1);
            const float *x = F(2);
            int64_t n = rows;
            if (op[7]) { /* the last row only: a chunk samples from its last token */
                x += (rows - 1) * layer[1];
                n = 1;
            }
            linear_share(layer, x, n, F(3), op[4], op[5], (uint8_t *)P(6), barrier, me, threads);
            break;
        }
        case OP_ROTARY:
            rotary_share(F(1), rows, op[2], op[3], op[4], F(5), F(6), I(7), me, threads);
            break;
        case OP_WRITE_KV:
            write_kv_share(F(1), op[2], F(3), op[4], rows, op[5], P(6), P(7), I(8), op[9], me, threads);
            break;
        case OP_DECODE_ATTENTION:
            decode_attention_share(F(1), op[2], I(3), rows, op[4], op[5], op[6], P(7), P(8), op[9], op[10],
                                   (const int32_t *)P(11), op[12], I(13), I(14), op[20], as_float(op[15]), F(16),
                                   op[17], F(18), op[19], me, threads);
            break;
        case OP_PREFILL_ATTENTION:
            prefill_attention_share(F(1), op[2], rows, op[3], op[4], op[5], P(6), P(7), op[8], op[9],
                                    (const int32_t *)P(10), seq_len, op[16], as_float(op[11]), F(12), op[13], F(14),
                                    F(15), barrier, me, threads);
            break;
        case OP_SILU_MUL:
            silu_mul_share(F(1), rows, op[2], F(3), me, threads);
            break;
        case OP_DENSE: {
            const float *x = F(5);
            int64_t n = rows;
            if (op[8]) { /* the last row only */
                x += (rows - 1) * op[3];
                n = 1;
            }
            dense_few_rows_share(x, n, op[3], F(1), op[2], op[3], F(4), F(6), op[7], me, threads);
            break;
        }
        case OP_LORA:
            lora_add_share(I(1), F(2), op[3], F(4), op[5], op[3], me, threads);
            break;
        case OP_GELU_TANH_MUL:
            gelu_tanh_mul_share(F(1), rows, op[2], F(3), me, threads);
            break;
        case OP_SCALE:
            scale_share(F(1), rows, op[2], as_float(op[3]), me, threads);
            break;
        case OP_MOE:
            moe_share(I(1), F(2), F(3), rows, F(4), op[5], (uint8_t *)P(6), barrier, me, threads);
            break;
        case OP_CHUNK_LENS:
            if (me == 0)
                for (int64_t i = 0; i < rows; i++) I(1)[i] = seq_len - rows + 1 + i;
            break;
    }
}

/* Words per operation (cpu_program.py checks its own against it). */
API int64_t program_op_words(void) { return OP_WORDS; }

/* Runs ``count`` operations of ``program`` over ``rows`` rows on up to ``threads`` threads: one parallel
 * region per step, a team barrier between operations. */
API void run_program(const int64_t *program, int64_t count, int64_t rows, int64_t seq_len, int64_t threads) {
    team_barrier barrier = {0, 0};
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int me = team_me(), size = team_size();
        for (int64_t i = 0; i < count; i++) {
            run_op(program + i * OP_WORDS, rows, seq_len, &barrier, me, size);
            team_sync(&barrier, size);
        }
    }
}
