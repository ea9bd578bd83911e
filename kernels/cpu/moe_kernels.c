/* The experts of a mixture-of-experts layer as one operation (core/models/moe.py).
 *
 * Given the router's logits, each token takes its top-k experts (softmax over every
 * expert, k largest, renormalized where the family does); the (token, expert) pairs are
 * grouped by expert, and each chosen expert runs its gated MLP once over all of its tokens,
 * so its weights are read once per step and experts nobody chose are not read at all. The
 * team's threads take whole experts from a shared cursor (a thread slowed by another process
 * leaves its next expert to the others), each with buffers of its own (with fewer chosen
 * experts than twice the threads, the team runs each expert together instead); then each token's
 * weighted expert outputs are summed in ascending expert order, so the bits do not depend
 * on which thread ran which expert, nor on how many threads there are. A shared expert
 * (Qwen2-MoE's) is one more expert that every token goes through, weighted by the sigmoid of
 * its own gate's product and added last.
 *
 * A layer's experts are described by int64 words (kernels/moe.py writes them): the header
 * below, then each expert's gate/up layer and each expert's down layer as quant_kernels.c's
 * layer descriptions (addresses). Tokens are taken in blocks of at most MOE_PAIR_BYTES of
 * expert outputs, so a long prefill chunk needs bounded scratch (each block reads its experts
 * again).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/* The header: expert count, experts per token, renormalize (0/1), activation (below), hidden
 * and intermediate sizes, tokens per block (0: as many as MOE_PAIR_BYTES of outputs hold), the
 * shared expert's intermediate size (0: none). After the header: the experts' gate/up layers,
 * their down layers, then the shared expert's gate/up, down and gate (one row) layers. */
enum {
    MOE_EXPERTS, MOE_TOP_K, MOE_NORMALIZE, MOE_ACTIVATION, MOE_HIDDEN, MOE_INTER, MOE_BLOCK, MOE_SHARED, MOE_HEADER
};
enum { MOE_SILU, MOE_GELU_TANH };

#define MOE_PAIR_BYTES (16 << 20)
#define MOE_ALIGN 64
#define TYPE_Q8_0 8 /* the activation formats' representatives (quant_kernels.c) */
#define TYPE_Q4_K 12

/* quant_kernels.c, cpu_kernels.c */
int64_t activation_row_bytes(int64_t type, int64_t k);
void quantize_share(int64_t type, const float *x, int64_t rows, int64_t k, void *out, int me, int threads);
int64_t layer_inputs(const int64_t *layer);
void layer_rows_share(const int64_t *layer, const float *x, uint8_t *const xq[2], int64_t n, float *out,
                      int64_t out_stride, int64_t quantize, float *row, int me, int threads, int64_t *cursors);
void silu_mul_share(const float *gate_up, int64_t rows, int64_t n, float *out, int me, int threads);
void gelu_tanh_mul_share(const float *gate_up, int64_t rows, int64_t n, float *out, int me, int threads);

static const int64_t FORMAT_TYPE[2] = {TYPE_Q8_0, TYPE_Q4_K};

static int64_t aligned(int64_t bytes) { return (bytes + MOE_ALIGN - 1) / MOE_ALIGN * MOE_ALIGN; }

/* Experts a token goes through: its top k, and the shared one where there is one. */
static int64_t per_token(const int64_t *desc) { return desc[MOE_TOP_K] + (desc[MOE_SHARED] > 0); }

/* Expert e's layers (e = MOE_EXPERTS: the shared expert) and intermediate size. */
static const int64_t *gate_up_of(const int64_t *desc, int64_t e) {
    int64_t experts = desc[MOE_EXPERTS];
    return (const int64_t *)(intptr_t)desc[MOE_HEADER + (e < experts ? e : 2 * experts)];
}

static const int64_t *down_of(const int64_t *desc, int64_t e) {
    int64_t experts = desc[MOE_EXPERTS];
    return (const int64_t *)(intptr_t)desc[MOE_HEADER + (e < experts ? experts + e : 2 * experts + 1)];
}

static const int64_t *shared_gate(const int64_t *desc) {
    return (const int64_t *)(intptr_t)desc[MOE_HEADER + 2 * desc[MOE_EXPERTS] + 2];
}

static int64_t inter_of(const int64_t *desc, int64_t e) {
    return e < desc[MOE_EXPERTS] ? desc[MOE_INTER] : desc[MOE_SHARED];
}

/* Tokens per block for a step of n tokens. */
static int64_t block_rows(const int64_t *desc, int64_t n) {
    int64_t most = desc[MOE_BLOCK] ? desc[MOE_BLOCK]
                                   : MOE_PAIR_BYTES / (per_token(desc) * desc[MOE_HIDDEN] * (int64_t)sizeof(float));
    if (most < 1) most = 1;
    return n < most ? n : most;
}

/* Bytes of both activation formats of a row of k values. */
static int64_t format_bytes(int64_t k) {
    return activation_row_bytes(TYPE_Q8_0, k) + activation_row_bytes(TYPE_Q4_K, k);
}

/* Where each buffer lies in the scratch, for blocks of ``rows`` tokens: first the team's, then
 * one region per thread (``thread_bytes`` each). */
typedef struct {
    int64_t xq, expert, weight, position, order, start, fill, active, cursor, outputs, threads_at, thread_bytes;
    int64_t gathered, gathered_q, gate_up, act, act_q, row, gate;
} moe_layout;

static moe_layout layout(const int64_t *desc, int64_t rows) {
    int64_t experts = desc[MOE_EXPERTS] + (desc[MOE_SHARED] > 0), pairs = rows * per_token(desc);
    int64_t hidden = desc[MOE_HIDDEN], at = 0;
    int64_t inter = desc[MOE_INTER] > desc[MOE_SHARED] ? desc[MOE_INTER] : desc[MOE_SHARED];
    moe_layout l;
#define PLACE(field, bytes) (l.field = at, at += aligned(bytes))
    PLACE(xq, rows * format_bytes(hidden));
    PLACE(expert, pairs * (int64_t)sizeof(int64_t));
    PLACE(weight, pairs * (int64_t)sizeof(float));
    PLACE(position, pairs * (int64_t)sizeof(int64_t));
    PLACE(order, pairs * (int64_t)sizeof(int64_t));
    PLACE(start, (experts + 1) * (int64_t)sizeof(int64_t));
    PLACE(fill, experts * (int64_t)sizeof(int64_t));
    PLACE(active, experts * (int64_t)sizeof(int64_t));
    PLACE(cursor, MOE_ALIGN);
    PLACE(outputs, pairs * hidden * (int64_t)sizeof(float));
    l.threads_at = at;
    at = 0; /* offsets within a thread's region */
    PLACE(gathered, rows * hidden * (int64_t)sizeof(float));
    PLACE(gathered_q, rows * format_bytes(hidden));
    PLACE(gate_up, rows * 2 * inter * (int64_t)sizeof(float));
    PLACE(act, rows * inter * (int64_t)sizeof(float));
    PLACE(act_q, rows * format_bytes(inter));
    PLACE(row, (hidden > inter ? hidden : inter) * (int64_t)sizeof(float));
    PLACE(gate, rows * (int64_t)sizeof(float));
#undef PLACE
    l.thread_bytes = at;
    return l;
}

/* Bytes of scratch moe_share needs for steps of up to ``rows`` tokens on ``threads`` threads. */
API int64_t moe_scratch_bytes(const int64_t *desc, int64_t rows, int64_t threads) {
    moe_layout l = layout(desc, block_rows(desc, rows > 0 ? rows : 1));
    return l.threads_at + threads * l.thread_bytes;
}

/* A token's top-k experts and their weights from its router logits: softmax over all experts
 * (its largest probabilities are those of its largest logits), renormalized over the k. */
static void route(const float *logits, int64_t experts, int64_t top_k, int normalize, int64_t *chosen,
                  float *weights) {
    float most = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < experts; e++) most = logits[e] > most ? logits[e] : most;
    for (int64_t e = 0; e < experts; e++) sum += expf(logits[e] - most);
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e; /* ties: the lower expert */
        }
        chosen[j] = best;
        weights[j] = expf(logits[best] - most) / sum;
    }
    if (normalize) {
        float total = 0.0f;
        for (int64_t j = 0; j < top_k; j++) total += weights[j];
        for (int64_t j = 0; j < top_k; j++) weights[j] /= total;
    }
}

/* Expert e's gated MLP over its ``count`` tokens (pairs order[0..count) of the block), each
 * token's output times its weight written to ``outputs`` (rows in pair order): run by one thread
 * (threads = 1), or by the whole team, each product's tiles and each step's rows shared among
 * them, in the buffers of ``team`` (thread 0's region; ``row`` is this thread's own). The
 * shared expert (e = MOE_EXPERTS) first writes its pairs' weights: the sigmoid of its gate. */
static void run_expert(const int64_t *desc, int64_t e, const int64_t *order, int64_t count, const float *x,
                       uint8_t *const xq[2], float *weight, float *outputs, int64_t quantize, uint8_t *team,
                       float *row, const moe_layout *l, team_barrier *barrier, int me, int threads) {
    int64_t hidden = desc[MOE_HIDDEN], inter = inter_of(desc, e), tokens = per_token(desc), first, last;
    const int64_t *gate_up = gate_up_of(desc, e), *down = down_of(desc, e);
    const int shared = e == desc[MOE_EXPERTS];
    int64_t inputs = quantize ? layer_inputs(gate_up) | (shared ? layer_inputs(shared_gate(desc)) : 0) : 4;
    float *gathered = (float *)(team + l->gathered), *gu = (float *)(team + l->gate_up);
    float *act = (float *)(team + l->act);
    uint8_t *gathered_q[2] = {team + l->gathered_q,
                              team + l->gathered_q + count * activation_row_bytes(TYPE_Q8_0, hidden)};
    uint8_t *act_q[2] = {team + l->act_q, team + l->act_q + count * activation_row_bytes(TYPE_Q8_0, inter)};
    team_share(count, me, threads, &first, &last);
    for (int64_t j = first; j < last; j++) { /* the expert's tokens' rows, in every form its products read */
        int64_t token = order[j] / tokens;
        if (inputs & 4) memcpy(gathered + j * hidden, x + token * hidden, (size_t)hidden * sizeof(float));
        for (int f = 0; f < 2; f++)
            if (inputs >> f & 1) {
                int64_t bytes = activation_row_bytes(FORMAT_TYPE[f], hidden);
                memcpy(gathered_q[f] + j * bytes, xq[f] + token * bytes, (size_t)bytes);
            }
    }
    team_sync(barrier, threads);
    if (shared) {
        float *gate = (float *)(team + l->gate);
        layer_rows_share(shared_gate(desc), gathered, gathered_q, count, gate, 1, quantize, row, me, threads, NULL);
        team_sync(barrier, threads);
        for (int64_t j = first; j < last; j++) weight[order[j]] = 1.0f / (1.0f + expf(-gate[j]));
    }
    layer_rows_share(gate_up, gathered, gathered_q, count, gu, 2 * inter, quantize, row, me, threads, NULL);
    team_sync(barrier, threads);
    if (desc[MOE_ACTIVATION] == MOE_GELU_TANH)
        gelu_tanh_mul_share(gu, count, inter, act, me, threads);
    else
        silu_mul_share(gu, count, inter, act, me, threads);
    int64_t down_inputs = quantize ? layer_inputs(down) : 0;
    for (int f = 0; f < 2; f++)
        if (down_inputs >> f & 1) quantize_share(FORMAT_TYPE[f], act, count, inter, act_q[f], me, threads);
    team_sync(barrier, threads);
    layer_rows_share(down, act, act_q, count, outputs, hidden, quantize, row, me, threads, NULL);
    team_sync(barrier, threads);
    for (int64_t j = first; j < last; j++) {
        float w = weight[order[j]], *o = outputs + j * hidden;
        for (int64_t c = 0; c < hidden; c++) o[c] *= w;
    }
    team_sync(barrier, threads); /* the next expert reuses the buffers */
}

/* Thread me of ``threads``' share of out[t] = the experts' mixture for token t < n: ``x`` the
 * tokens' normed rows [n, hidden], ``router`` their router logits [n, experts], all contiguous.
 * ``scratch``: moe_scratch_bytes of it for n rows and ``threads``, shared by the team. */
void moe_share(const int64_t *desc, const float *x, const float *router, int64_t n, float *out, int64_t quantize,
               uint8_t *scratch, team_barrier *barrier, int me, int threads) {
    int64_t experts = desc[MOE_EXPERTS], top_k = desc[MOE_TOP_K], hidden = desc[MOE_HIDDEN];
    int64_t tokens = per_token(desc), shared = desc[MOE_SHARED] > 0, groups = experts + shared;
    int64_t rows = block_rows(desc, n);
    moe_layout l = layout(desc, rows);
    int64_t *chosen = (int64_t *)(scratch + l.expert), *position = (int64_t *)(scratch + l.position);
    int64_t *order = (int64_t *)(scratch + l.order), *start = (int64_t *)(scratch + l.start);
    int64_t *fill = (int64_t *)(scratch + l.fill), *active = (int64_t *)(scratch + l.active);
    int64_t *cursor = (int64_t *)(scratch + l.cursor);
    float *weight = (float *)(scratch + l.weight), *outputs = (float *)(scratch + l.outputs);
    uint8_t *mine = scratch + l.threads_at + me * l.thread_bytes;
    int64_t inputs = 0; /* the formats the experts' first products read */
    for (int64_t e = 0; e < groups && quantize; e++) inputs |= layer_inputs(gate_up_of(desc, e));
    if (shared && quantize) inputs |= layer_inputs(shared_gate(desc));
    for (int64_t b0 = 0; b0 < n; b0 += rows) {
        int64_t nb = n - b0 < rows ? n - b0 : rows, first, last;
        const float *xb = x + b0 * hidden;
        uint8_t *xq[2] = {scratch + l.xq, scratch + l.xq + nb * activation_row_bytes(TYPE_Q8_0, hidden)};
        team_share(nb, me, threads, &first, &last);
        for (int64_t t = first; t < last; t++) {
            route(router + (b0 + t) * experts, experts, top_k, (int)desc[MOE_NORMALIZE], chosen + t * tokens,
                  weight + t * tokens);
            if (shared) chosen[t * tokens + top_k] = experts; /* its weight: its gate's, when it runs */
        }
        for (int f = 0; f < 2; f++)
            if (inputs >> f & 1) quantize_share(FORMAT_TYPE[f], xb, nb, hidden, xq[f], me, threads);
        team_sync(barrier, threads);
        if (me == 0) { /* the pairs grouped by expert, each group in token order; the shared one first */
            int64_t pairs = nb * tokens, count = 0;
            memset(start, 0, (size_t)(groups + 1) * sizeof(int64_t));
            for (int64_t p = 0; p < pairs; p++) start[chosen[p] + 1]++;
            if (shared) active[count++] = experts; /* the largest: claimed first */
            for (int64_t e = 0; e < groups; e++) {
                if (start[e + 1] && e < experts) active[count++] = e;
                start[e + 1] += start[e];
                fill[e] = start[e];
            }
            for (int64_t p = 0; p < pairs; p++) {
                position[p] = fill[chosen[p]]++;
                order[position[p]] = p;
            }
            cursor[0] = count; /* experts to run */
            cursor[1] = 0;     /* the next one to claim */
        }
        team_sync(barrier, threads);
        float *row = (float *)(mine + l.row);
        if (2 * cursor[0] <= threads) { /* fewer experts than the team can share: all of it on each */
            for (int64_t i = 0; i < cursor[0]; i++) {
                int64_t e = active[i];
                run_expert(desc, e, order + start[e], start[e + 1] - start[e], xb, xq, weight,
                           outputs + start[e] * hidden, quantize, scratch + l.threads_at, row, &l, barrier, me,
                           threads);
            }
        } else {
            for (;;) { /* whole experts claimed by one thread each */
                int64_t i = __atomic_fetch_add(&cursor[1], 1, __ATOMIC_RELAXED);
                if (i >= cursor[0]) break;
                int64_t e = active[i];
                run_expert(desc, e, order + start[e], start[e + 1] - start[e], xb, xq, weight,
                           outputs + start[e] * hidden, quantize, mine, row, &l, NULL, 0, 1);
            }
        }
        team_sync(barrier, threads);
        for (int64_t t = first; t < last; t++) { /* each token's outputs summed by ascending expert */
            float *o = out + (b0 + t) * hidden;
            const int64_t *mine_chosen = chosen + t * tokens;
            memset(o, 0, (size_t)hidden * sizeof(float));
            for (int64_t taken = 0, previous = -1; taken < tokens; taken++) {
                int64_t next = -1;
                for (int64_t j = 0; j < tokens; j++)
                    if (mine_chosen[j] > previous && (next < 0 || mine_chosen[j] < mine_chosen[next])) next = j;
                previous = mine_chosen[next];
                const float *y = outputs + position[t * tokens + next] * hidden;
                for (int64_t c = 0; c < hidden; c++) o[c] += y[c];
            }
        }
        if (b0 + rows < n) team_sync(barrier, threads); /* the next block reuses the buffers */
    }
}

/* The operation on its own (the forward pass): scratch from this thread's growing buffer,
 * and up to ``threads`` threads. */
API void moe_experts(const int64_t *desc, const float *x, const float *router, int64_t n, float *out,
                     int64_t quantize, int64_t threads) {
    static __thread uint8_t *scratch;
    static __thread size_t scratch_size;
    if (threads < 1) threads = 1;
    size_t need = (size_t)moe_scratch_bytes(desc, n, threads);
    if (need > scratch_size) {
        free(scratch);
        scratch = malloc(need);
        scratch_size = scratch ? need : 0;
        if (!scratch) return; /* out of memory: nothing to compute with */
    }
    team_barrier barrier = {0, 0};
    uint8_t *shared = scratch;
#pragma omp parallel num_threads(threads) if (threads > 1)
    moe_share(desc, x, router, n, out, quantize, shared, &barrier, team_me(), team_size());
}
