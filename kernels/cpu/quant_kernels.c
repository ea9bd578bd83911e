/* Products with weights kept in llama.cpp's block formats (GGUF): Q8_0, Q4_0, Q5_0,
 * Q4_1, Q5_1 and IQ4_NL (blocks of 32 values), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS
 * (super-blocks of 256).
 *
 * As llama.cpp computes them: each activation row is quantized per block to
 * int8 with one scale (per 32 values for the 32-value formats, per 256 with
 * sums of each 16 for the K formats), each block's dot product is taken in
 * integers, and the scaled block sums are accumulated in float32.
 *
 * Weights are repacked once, at load (``pack_matrix``), from GGUF's layout
 * (each row's blocks back to back) into tiles of 16 rows: for each block, the
 * 16 rows' values sit four at a time in the 32-bit lanes of one 64-byte
 * vector, so one integer multiply-add instruction (AVX-512 VNNI's vpdpbusd)
 * takes four values of 16 rows at once against one broadcast group of four
 * activations, with no horizontal sums; scales and minimums sit beside them
 * as 16-row vectors. The packed form is as large as the file's (Q4_K: 3 %
 * larger). Products run up to ``ROWS_AT_ONCE`` activation rows per pass over
 * a tile, so a decode batch or a prefill chunk reads each weight byte once
 * per pass and expands it once for all of them. Each kernel prefetches the
 * weights PF_DISTANCE bytes ahead of its arithmetic: without it a lone decode,
 * which reads every weight once, streams at a fraction of the memory's speed.
 *
 * On AVX2 without VNNI the products of two rows or more of Q2_K to Q6_K and of
 * the 32-value nibble formats take each tile as two halves of eight rows (one ymm
 * each), summing a sub-block's vpmaddubsw products in int16 lanes before one
 * vpmaddwd by its scale; the generic kernels widen every product to int32 (twice
 * the multiplies).
 *
 * The vector code is chosen when this file is compiled, for the CPU that
 * compiles it (``-march=native``; kernels/cpu/library.py): AVX-512 (with
 * VNNI, or its multiply-adds emulated with vpmaddubsw), AVX2 (with AVX-VNNI
 * or emulated), or portable C. Every path computes the same integers and the
 * same float32 operations in the same order per output, so all produce the
 * same bits (tests/unit/test_quant_kernels.py builds each and compares).
 *
 * ``quant_matmul_f32`` is the product with float32 activations and each
 * weight row expanded to float32 first: no activation rounding, for checking
 * against a float32 reference (kernels.settings.quantize_activations off).
 * Types are the GGML type ids (GGUF's): 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K,
 * 13 Q5_K, 14 Q6_K, 20 IQ4_NL, 23 IQ4_XS.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define INLINE static inline __attribute__((always_inline))
/* Bytes ahead of the product's position that its weights are prefetched: a core streams them
 * from memory at its full speed only with a few blocks requested ahead of the arithmetic. */
#ifndef PF_DISTANCE
#define PF_DISTANCE 8192
#endif

#define TYPE_F32 0
#define TYPE_F16 1
#define TYPE_Q4_0 2
#define TYPE_Q4_1 3
#define TYPE_Q5_0 6
#define TYPE_Q5_1 7
#define TYPE_Q8_0 8
#define TYPE_Q2_K 10
#define TYPE_Q3_K 11
#define TYPE_Q4_K 12
#define TYPE_Q5_K 13
#define TYPE_Q6_K 14
#define TYPE_IQ4_NL 20
#define TYPE_IQ4_XS 23

#define QK 32    /* values per block of the 32-value formats */
#define QK_K 256 /* values per super-block of the K formats */
#define TILE 16  /* weight rows per tile */

/* GGUF's blocks (the file's layout, read by pack_matrix). */
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;                  /* 18 bytes */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;   /* 22 bytes */
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;                       /* 34 bytes */
/* Q4_1 (d, m, qs: 20 bytes), Q5_1 (d, m, qh[4], qs: 24) and IQ4_NL (d, qs: 18, as Q4_0) are read by
 * offsets, as Q4_0 and Q5_0 are (pack_tile_block): d, then m, then the fifth bits, then 16 bytes of
 * nibbles. */
typedef struct { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d, dmin; } block_q2_k; /* 84 */
typedef struct { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; } block_q3_k; /* 110 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_k; /* 144 bytes */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_k; /* 176 */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_k; /* 210 */
typedef struct { uint16_t d, scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; } block_iq4_xs; /* 136 */

_Static_assert(sizeof(block_q4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(block_q5_0) == 22, "Q5_0 block");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(block_q2_k) == 84, "Q2_K block");
_Static_assert(sizeof(block_q3_k) == 110, "Q3_K block");
_Static_assert(sizeof(block_q4_k) == 144, "Q4_K block");
_Static_assert(sizeof(block_q5_k) == 176, "Q5_K block");
_Static_assert(sizeof(block_q6_k) == 210, "Q6_K block");
_Static_assert(sizeof(block_iq4_xs) == 136, "IQ4_XS block");

/* Quantized activations (our own layout): the scale, the block's sum (the 32-value
 * formats' offsets are subtracted through it) or the sums of each 16, and the values. */
typedef struct { float d; int32_t sum; int8_t qs[QK]; } act_q8_0;                    /* 40 bytes */
/* Q8_K: ``pairs[p]`` holds the sums of sub-blocks 2p and 2p + 1 of 32 as two int16, the operand
 * that multiplies Q4_K's and Q5_K's minimum pairs (made once here, not in every product). */
typedef struct { float d; int32_t pairs[4]; int16_t bsums[QK_K / 16]; int8_t qs[QK_K]; } act_q8_k; /* 308 bytes */

/* IQ4_XS's sixteen values (llama.cpp's non-linear grid for 4-bit indices), and the same plus 128 as
 * bytes: the unsigned operand the products look them up as (vi_dot_q8's, as Q8_0's tiles hold). */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const uint8_t IQ4_BYTES[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

/* A tile's block: 16 rows' values in 64-byte groups (row r's four values at bytes 4r..4r+3),
 * then the rows' scales. Offsets of each part within a tile block: */
#define Q8_0_TILE 544  /* 8 groups of values (w + 128 as bytes) | 16 half scales */
#define Q4_0_TILE 288  /* 4 groups of nibble pairs | 16 half scales */
#define Q5_0_TILE 352  /* 4 groups of nibble pairs | 8 masks of fifth bits (64 bits each) | 16 half scales */
/* Q4_1, Q5_1 and IQ4_NL: Q4_0's or Q5_0's tile, then 16 half minimums for the first two. */
/* Q3_K: value v = 64p + 4g + j (p < 4, g < 16, j < 4) has its low two bits at bits 2p, 2p+1 of
 * byte j of group g, its third bit at bit v / 32 of byte j of high-bit group g % 8. */
#define Q3_K_TILE 1824 /* 16 groups of bit pairs | 8 groups of third bits | scales [16][16] | 16 d */
/* Q2_K: Q3_K's bit pairs; each sub-block's scale (low nibble) and minimum (high) in one byte, as the file has them. */
#define Q2_K_TILE 1344 /* 16 groups of bit pairs | scales and minimums [16][16] | 16 d | 16 dmin */
#define Q4_K_TILE 2368 /* 32 groups of nibble pairs | scales [8][16] | minimum pairs [4][16][2] | 16 d | 16 dmin */
#define Q5_K_TILE 2880 /* Q4_K's tile | 8 groups of fifth bits (byte l of a row: bit 2c low, 2c+1 high nibble of chunk c) */
/* Q6_K: 16 groups (h, g) of three vectors A, B, C for the four parts p of values h*128 + 32p + 4g .. +3:
 * parts 0, 1, 2 are the low six bits of A, B, C; part 3's bits 0-1, 2-3, 4-5 are their top two. */
#define Q6_K_TILE 3360 /* 16 groups of 3 x 64 bytes | scales [16][16] | 16 d */
/* IQ4_XS: group 4s + c holds bytes 16s + 4c .. +3 of each row's nibbles (sub-block s of 32: values
 * 32s + 4c + j in the low nibbles, 32s + 16 + 4c + j in the high ones), indices into IQ4_VALUES. */
#define IQ4_XS_TILE 2208 /* 32 groups of nibble pairs | scales [8][16] | 16 d */
#define F32_TILE 64    /* one column: 16 floats */
#define F16_TILE 32    /* one column: 16 halves */

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ------------------------------------------------------------------ vectors of 16 lanes
 *
 * vi: 16 int32 lanes, one per row of a tile (a zmm, two ymm, or an array); vf: the same
 * as float32. vi_dot adds to each lane the dot product of its four unsigned bytes (at most
 * 63) with the four signed bytes at ``q``; vi_dot_q8 does it for Q8_0's bytes (w + 128), whose
 * sum comes out offset by Q8_OFFSET times the activations' sum. */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)
#define VEC_AVX512 1
typedef __m512i vi;
typedef __m512 vf;

INLINE vi vi_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
/* Keeps a sum in its register (see KEEP below). */
INLINE void vi_keep(vi *v) { __asm__("" : "+v"(*v)); }
INLINE vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vi vi_mul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
INLINE vi vi_lo4(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
INLINE vi vi_hi4(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
INLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
INLINE vi vi_sra(vi v, int n) { return _mm512_srai_epi32(v, n); }
/* Bits ``mask`` of each byte from bits ``shift`` lower of ``v``: (v << shift) & mask, for shifts
 * that move none of the bits kept across a byte's edge (the shift is 16-bit): Q5_K's fifth bit
 * (0x10), Q6_K's top bits (0x03, 0x0c, 0x30 from bits 6-7). */
INLINE vi vi_bits(vi v, int shift, int mask) {
    vi s = shift >= 0 ? _mm512_slli_epi16(v, shift) : _mm512_srli_epi16(v, -shift);
    return _mm512_and_si512(s, _mm512_set1_epi8((char)mask));
}
INLINE vi vi_low6(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x3f)); }
/* Q6_K's fourth part: the top two bits of each byte of a, b, c as bits 0-1, 2-3, 4-5. Each
 * ternary step keeps the bits of its first operand where the constant's are set, else the
 * second's (0xE4: c ? a : b), so three shifts, two selects and a mask. */
INLINE vi vi_top2s(vi a, vi b, vi c) {
    vi low = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 6), _mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x03), 0xE4);
    vi mid = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(c, 2), _mm512_set1_epi8(0x0f), 0xE4);
    return _mm512_and_si512(mid, _mm512_set1_epi8(0x3f));
}
/* Adds 16 to the bytes whose bit is set in ``mask`` (Q5_0's fifth bits). */
INLINE vi vi_add16_masked(vi v, uint64_t mask) { return _mm512_mask_add_epi8(v, mask, v, _mm512_set1_epi8(16)); }
INLINE vi vi_u8_to_i32(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE vi vi_s8_to_i32(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
/* Each byte (a 4-bit index) replaced by IQ4_BYTES' entry. */
INLINE vi vi_iq4(vi v) { return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_BYTES)), v); }
/* Each lane: u8 pair at p[2l], p[2l+1] times the int16 pair packed in ``pair``, summed. */
INLINE vi vi_madd_u8_pairs(vi acc, const uint8_t *p, int32_t pair) {
    vi wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(wide, _mm512_set1_epi32(pair)));
}
#ifdef __AVX512VNNI__
#define Q8_OFFSET 128
/* The four activation bytes broadcast by the instruction's own memory operand ({1to16}): GCC
 * loads them into a register with a separate broadcast, a second instruction per product. */
INLINE vi vi_dot(vi acc, vi w, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int8_t(*)[4])q));
    return acc;
}
INLINE vi vi_dot_q8(vi acc, vi w, const int8_t *q) { return vi_dot(acc, w, q); }
#else
#define Q8_OFFSET 0
INLINE vi vi_dot(vi acc, vi w, const int8_t *q) {
    vi pairs = _mm512_maddubs_epi16(w, _mm512_set1_epi32(load_i32(q)));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
INLINE vi vi_dot_q8(vi acc, vi w, const int8_t *q) { /* signed weights: |w| times a with w's sign */
    vi s = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    vi a = _mm512_set1_epi32(load_i32(q));
    a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(s), _mm512_setzero_si512(), a);
    vi pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(s), a);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#endif
INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
INLINE vf vf_from(vi v) { return _mm512_cvtepi32_ps(v); }
INLINE vf vf_halves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf vf_floats(const uint8_t *p) { return _mm512_loadu_ps((const float *)p); }
INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE void vf_store(float *out, vf v, const float *bias, int count) {
    __mmask16 m = (__mmask16)((1u << count) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias));
    _mm512_mask_storeu_ps(out, m, v);
}
#define ROWS_AT_ONCE 4

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VEC_AVX2 1
typedef struct { __m256i l, h; } vi;
typedef struct { __m256 l, h; } vf;

INLINE vi vi_load(const uint8_t *p) {
    return (vi){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
}
INLINE void vi_keep(vi *v) { __asm__("" : "+x"(v->l), "+x"(v->h)); }
INLINE vi vi_set1(int32_t x) { return (vi){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
INLINE vi vi_add(vi a, vi b) { return (vi){_mm256_add_epi32(a.l, b.l), _mm256_add_epi32(a.h, b.h)}; }
INLINE vi vi_mul(vi a, vi b) { return (vi){_mm256_mullo_epi32(a.l, b.l), _mm256_mullo_epi32(a.h, b.h)}; }
INLINE vi vi_lo4(vi v) {
    __m256i m = _mm256_set1_epi8(0x0f);
    return (vi){_mm256_and_si256(v.l, m), _mm256_and_si256(v.h, m)};
}
INLINE vi vi_hi4(vi v) {
    __m256i m = _mm256_set1_epi8(0x0f);
    return (vi){_mm256_and_si256(_mm256_srli_epi16(v.l, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.h, 4), m)};
}
INLINE vi vi_or(vi a, vi b) { return (vi){_mm256_or_si256(a.l, b.l), _mm256_or_si256(a.h, b.h)}; }
INLINE vi vi_sra(vi v, int n) { return (vi){_mm256_srai_epi32(v.l, n), _mm256_srai_epi32(v.h, n)}; }
INLINE __m256i bits_half(__m256i v, int shift, int mask) {
    __m256i s = shift >= 0 ? _mm256_slli_epi16(v, shift) : _mm256_srli_epi16(v, -shift);
    return _mm256_and_si256(s, _mm256_set1_epi8((char)mask));
}
INLINE vi vi_bits(vi v, int shift, int mask) { return (vi){bits_half(v.l, shift, mask), bits_half(v.h, shift, mask)}; }
INLINE __m256i low6_half(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x3f)); }
/* Q6_K's fourth part (see the tile's layout): the top two bits of each byte of a, b, c as bits
 * 0-1, 2-3, 4-5. */
INLINE __m256i top2s_half(__m256i a, __m256i b, __m256i c) {
    return _mm256_or_si256(_mm256_or_si256(bits_half(a, -6, 0x03), bits_half(b, -4, 0x0c)), bits_half(c, -2, 0x30));
}
INLINE vi vi_low6(vi v) { return (vi){low6_half(v.l), low6_half(v.h)}; }
INLINE vi vi_top2s(vi a, vi b, vi c) { return (vi){top2s_half(a.l, b.l, c.l), top2s_half(a.h, b.h, c.h)}; }
/* 32 mask bits -> 32 bytes of 16 where set (byte i takes bit i). */
INLINE __m256i bits_to_16s(uint32_t bits) {
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                         _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll,
                                                            0x0303030303030303ll));
    __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
INLINE vi vi_add16_masked(vi v, uint64_t mask) {
    return (vi){_mm256_add_epi8(v.l, bits_to_16s((uint32_t)mask)), _mm256_add_epi8(v.h, bits_to_16s((uint32_t)(mask >> 32)))};
}
INLINE vi vi_u8_to_i32(const uint8_t *p) {
    return (vi){_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
INLINE vi vi_s8_to_i32(const int8_t *p) {
    return (vi){_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
INLINE vi vi_iq4(vi v) {
    __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_BYTES));
    return (vi){_mm256_shuffle_epi8(table, v.l), _mm256_shuffle_epi8(table, v.h)};
}
INLINE vi vi_madd_u8_pairs(vi acc, const uint8_t *p, int32_t pair) {
    __m256i b = _mm256_set1_epi32(pair);
    __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
    return (vi){_mm256_add_epi32(acc.l, _mm256_madd_epi16(lo, b)), _mm256_add_epi32(acc.h, _mm256_madd_epi16(hi, b))};
}
#ifdef __AVXVNNI__
#define Q8_OFFSET 128
INLINE vi vi_dot(vi acc, vi w, const int8_t *q) {
    __m256i a = _mm256_set1_epi32(load_i32(q));
    return (vi){_mm256_dpbusd_avx_epi32(acc.l, w.l, a), _mm256_dpbusd_avx_epi32(acc.h, w.h, a)};
}
INLINE vi vi_dot_q8(vi acc, vi w, const int8_t *q) { return vi_dot(acc, w, q); }
#else
#define Q8_OFFSET 0
INLINE __m256i dot_half(__m256i acc, __m256i w, __m256i a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}
INLINE vi vi_dot(vi acc, vi w, const int8_t *q) {
    __m256i a = _mm256_set1_epi32(load_i32(q));
    return (vi){dot_half(acc.l, w.l, a), dot_half(acc.h, w.h, a)};
}
INLINE __m256i dot_q8_half(__m256i acc, __m256i w, __m256i a) {
    __m256i s = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return dot_half(acc, _mm256_sign_epi8(s, s), _mm256_sign_epi8(a, s));
}
INLINE vi vi_dot_q8(vi acc, vi w, const int8_t *q) {
    __m256i a = _mm256_set1_epi32(load_i32(q));
    return (vi){dot_q8_half(acc.l, w.l, a), dot_q8_half(acc.h, w.h, a)};
}
#endif
INLINE vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INLINE vf vf_set1(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
INLINE vf vf_from(vi v) { return (vf){_mm256_cvtepi32_ps(v.l), _mm256_cvtepi32_ps(v.h)}; }
INLINE vf vf_halves(const uint8_t *p) {
    return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
INLINE vf vf_floats(const uint8_t *p) {
    return (vf){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)(p + 32))};
}
INLINE vf vf_add(vf a, vf b) { return (vf){_mm256_add_ps(a.l, b.l), _mm256_add_ps(a.h, b.h)}; }
INLINE vf vf_mul(vf a, vf b) { return (vf){_mm256_mul_ps(a.l, b.l), _mm256_mul_ps(a.h, b.h)}; }
INLINE vf vf_fma(vf a, vf b, vf c) { return (vf){_mm256_fmadd_ps(a.l, b.l, c.l), _mm256_fmadd_ps(a.h, b.h, c.h)}; }
INLINE void vf_store(float *out, vf v, const float *bias, int count) {
    float tmp[16];
    _mm256_storeu_ps(tmp, v.l);
    _mm256_storeu_ps(tmp + 8, v.h);
    for (int l = 0; l < count; l++) out[l] = bias ? tmp[l] + bias[l] : tmp[l];
}
#define ROWS_AT_ONCE 4 /* the K formats' half tiles (below); the other formats two at a time */
#define GENERIC_ROWS 2

#else
#define VEC_PORTABLE 1
typedef struct { int32_t v[TILE]; } vi;
typedef struct { float v[TILE]; } vf;

INLINE vi vi_load(const uint8_t *p) {
    vi r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
INLINE void vi_keep(vi *v) { (void)v; }
INLINE vi vi_set1(int32_t x) {
    vi r;
    for (int l = 0; l < TILE; l++) r.v[l] = x;
    return r;
}
#define LANEWISE(expr)                            \
    vi r;                                         \
    for (int l = 0; l < TILE; l++) r.v[l] = expr; \
    return r
INLINE vi vi_add(vi a, vi b) { LANEWISE(a.v[l] + b.v[l]); }
INLINE vi vi_mul(vi a, vi b) { LANEWISE((int32_t)((uint32_t)a.v[l] * (uint32_t)b.v[l])); }
INLINE vi vi_lo4(vi v) { LANEWISE((int32_t)((uint32_t)v.v[l] & 0x0f0f0f0fu)); }
INLINE vi vi_hi4(vi v) { LANEWISE((int32_t)(((uint32_t)v.v[l] >> 4) & 0x0f0f0f0fu)); }
INLINE vi vi_or(vi a, vi b) { LANEWISE(a.v[l] | b.v[l]); }
INLINE vi vi_sra(vi v, int n) { LANEWISE(v.v[l] / (1 << n)); } /* v a multiple of 2^n: exact */
INLINE vi vi_bits(vi v, int shift, int mask) {
    LANEWISE((int32_t)((shift >= 0 ? (uint32_t)v.v[l] << shift : (uint32_t)v.v[l] >> -shift) & (0x01010101u * (uint32_t)mask)));
}
INLINE vi vi_low6(vi v) { LANEWISE((int32_t)((uint32_t)v.v[l] & 0x3f3f3f3fu)); }
INLINE vi vi_top2s(vi a, vi b, vi c) {
    LANEWISE((int32_t)(((uint32_t)a.v[l] >> 6 & 0x03030303u) | ((uint32_t)b.v[l] >> 4 & 0x0c0c0c0cu) |
                       ((uint32_t)c.v[l] >> 2 & 0x30303030u)));
}
INLINE vi vi_add16_masked(vi v, uint64_t mask) {
    vi r;
    for (int l = 0; l < TILE; l++) {
        uint32_t x = (uint32_t)v.v[l];
        for (int j = 0; j < 4; j++)
            if (mask >> (4 * l + j) & 1) x += 16u << (8 * j); /* bytes at most 15: no carry */
        r.v[l] = (int32_t)x;
    }
    return r;
}
INLINE vi vi_u8_to_i32(const uint8_t *p) { LANEWISE(p[l]); }
INLINE vi vi_s8_to_i32(const int8_t *p) { LANEWISE(p[l]); }
INLINE vi vi_iq4(vi v) {
    LANEWISE((int32_t)((uint32_t)IQ4_BYTES[v.v[l] & 0x0f] | (uint32_t)IQ4_BYTES[v.v[l] >> 8 & 0x0f] << 8 |
                       (uint32_t)IQ4_BYTES[v.v[l] >> 16 & 0x0f] << 16 | (uint32_t)IQ4_BYTES[(uint32_t)v.v[l] >> 24 & 0x0f] << 24));
}
INLINE vi vi_madd_u8_pairs(vi acc, const uint8_t *p, int32_t pair) {
    int16_t b0 = (int16_t)(pair & 0xffff), b1 = (int16_t)((uint32_t)pair >> 16);
    LANEWISE(acc.v[l] + p[2 * l] * b0 + p[2 * l + 1] * b1);
}
#define Q8_OFFSET 128
INLINE vi vi_dot(vi acc, vi w, const int8_t *q) {
    vi r;
    int8_t a[4];
    memcpy(a, q, 4);
    for (int l = 0; l < TILE; l++) {
        uint32_t x = (uint32_t)w.v[l];
        r.v[l] = acc.v[l] + (int32_t)(x & 0xff) * a[0] + (int32_t)(x >> 8 & 0xff) * a[1] +
                 (int32_t)(x >> 16 & 0xff) * a[2] + (int32_t)(x >> 24) * a[3];
    }
    return r;
}
INLINE vi vi_dot_q8(vi acc, vi w, const int8_t *q) { return vi_dot(acc, w, q); }
INLINE vf vf_zero(void) {
    vf r = {{0}};
    return r;
}
#define LANEWISE_F(expr)                          \
    vf r;                                         \
    for (int l = 0; l < TILE; l++) r.v[l] = expr; \
    return r
INLINE vf vf_set1(float x) { LANEWISE_F(x); }
INLINE vf vf_from(vi v) { LANEWISE_F((float)v.v[l]); }
INLINE vf vf_halves(const uint8_t *p) { LANEWISE_F(half_to_float(load_u16(p + 2 * l))); }
INLINE vf vf_floats(const uint8_t *p) {
    vf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
INLINE vf vf_add(vf a, vf b) { LANEWISE_F(a.v[l] + b.v[l]); }
INLINE vf vf_mul(vf a, vf b) { LANEWISE_F(a.v[l] * b.v[l]); }
INLINE vf vf_fma(vf a, vf b, vf c) { LANEWISE_F(fmaf(a.v[l], b.v[l], c.v[l])); }
INLINE void vf_store(float *out, vf v, const float *bias, int count) {
    for (int l = 0; l < count; l++) out[l] = bias ? v.v[l] + bias[l] : v.v[l];
}
#define ROWS_AT_ONCE 2
#endif

#ifndef GENERIC_ROWS
#define GENERIC_ROWS ROWS_AT_ONCE /* rows the generic tile kernels take at once */
#endif

/* Which of the paths above this build runs: 0 portable, 1 AVX2, 2 AVX2 + AVX-VNNI,
 * 3 AVX-512, 4 AVX-512 VNNI. */
API int64_t quant_vector_path(void) {
#if defined(VEC_AVX512)
    return Q8_OFFSET ? 4 : 3;
#elif defined(VEC_AVX2)
    return Q8_OFFSET ? 2 : 1;
#else
    return 0;
#endif
}

/* The int8 multiply-add peak of this build's widest instruction for it (the ceiling a prefill's
 * products are held to): ``rounds`` rounds of PEAK_CHAINS independent multiply-adds on each of
 * ``threads`` threads, no memory touched. Returns the multiply-adds done; 0 for the portable
 * build, which has no such instruction. Each path names its vector, its instruction as one step
 * of a chain (``b`` an operand kept opaque to the compiler), and the multiply-adds of a step. */
#define PEAK_CHAINS 12
#if defined(VEC_AVX512) && defined(__AVX512VNNI__)
typedef __m512i peak_vec;
#define PEAK_STEP(acc, b) _mm512_dpbusd_epi32(acc, b, b)
#define PEAK_LANES 64
#define PEAK_SET1(x) _mm512_set1_epi8(x)
#define PEAK_LOW(v) _mm_cvtsi128_si32(_mm512_castsi512_si128(v))
#elif defined(VEC_AVX512)
typedef __m512i peak_vec;
#define PEAK_STEP(acc, b) _mm512_maddubs_epi16(acc, b)
#define PEAK_LANES 64
#define PEAK_SET1(x) _mm512_set1_epi8(x)
#define PEAK_LOW(v) _mm_cvtsi128_si32(_mm512_castsi512_si128(v))
#elif defined(VEC_AVX2) && defined(__AVXVNNI__)
typedef __m256i peak_vec;
#define PEAK_STEP(acc, b) _mm256_dpbusd_avx_epi32(acc, b, b)
#define PEAK_LANES 32
#define PEAK_SET1(x) _mm256_set1_epi8(x)
#define PEAK_LOW(v) _mm_cvtsi128_si32(_mm256_castsi256_si128(v))
#elif defined(VEC_AVX2) /* vpmaddubsw: 32 multiply-adds into 16 int16 pair sums */
typedef __m256i peak_vec;
#define PEAK_STEP(acc, b) _mm256_maddubs_epi16(acc, b)
#define PEAK_LANES 32
#define PEAK_SET1(x) _mm256_set1_epi8(x)
#define PEAK_LOW(v) _mm_cvtsi128_si32(_mm256_castsi256_si128(v))
#endif

/* One step of chain ``acc``, which then stays in its register, opaque to the compiler: no step
 * is folded, and none waits on a load or a store (chains kept in an array went to the stack, and
 * the probe measured the first-level cache instead of the multiply-adds). */
#define PEAK_KEEP_STEP(acc, b)                \
    do {                                      \
        acc = PEAK_STEP(acc, b);              \
        __asm__("" : "+v"(acc));              \
    } while (0)

API int64_t int8_peak_probe(int64_t rounds, int64_t threads) {
    int64_t done = 0;
    (void)threads;
    (void)rounds;
#ifdef PEAK_LANES
#pragma omp parallel num_threads(threads) reduction(+ : done)
    {
        peak_vec b = PEAK_SET1(2), c0 = PEAK_SET1(1), c1 = PEAK_SET1(3), c2 = PEAK_SET1(4), c3 = PEAK_SET1(5);
        peak_vec c4 = PEAK_SET1(6), c5 = PEAK_SET1(7), c6 = PEAK_SET1(8), c7 = PEAK_SET1(9);
        peak_vec c8 = PEAK_SET1(10), c9 = PEAK_SET1(11), c10 = PEAK_SET1(12), c11 = PEAK_SET1(13);
        __asm__("" : "+v"(b));
        for (int64_t r = 0; r < rounds; r++) {
            PEAK_KEEP_STEP(c0, b); PEAK_KEEP_STEP(c1, b); PEAK_KEEP_STEP(c2, b); PEAK_KEEP_STEP(c3, b);
            PEAK_KEEP_STEP(c4, b); PEAK_KEEP_STEP(c5, b); PEAK_KEEP_STEP(c6, b); PEAK_KEEP_STEP(c7, b);
            PEAK_KEEP_STEP(c8, b); PEAK_KEEP_STEP(c9, b); PEAK_KEEP_STEP(c10, b); PEAK_KEEP_STEP(c11, b);
        }
        int sink = PEAK_LOW(c0) + PEAK_LOW(c1) + PEAK_LOW(c2) + PEAK_LOW(c3) + PEAK_LOW(c4) + PEAK_LOW(c5) +
                   PEAK_LOW(c6) + PEAK_LOW(c7) + PEAK_LOW(c8) + PEAK_LOW(c9) + PEAK_LOW(c10) + PEAK_LOW(c11);
        __asm__ volatile("" : : "r"(sink));
        done += rounds * PEAK_CHAINS * PEAK_LANES;
    }
#endif
    return done;
}

/* ------------------------------------------------------------------ sizes */

static int float_format(int64_t type) { return type == TYPE_F32 || type == TYPE_F16; }

/* The formats of super-blocks of 256, whose products take Q8_K activations. */
static int k_format(int64_t type) {
    return type == TYPE_Q2_K || type == TYPE_Q3_K || type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K ||
           type == TYPE_IQ4_XS;
}

/* The formats of 32 values in nibbles: Q4_0, Q5_0 (with fifth bits), Q4_1, Q5_1 (with a minimum
 * each) and IQ4_NL (indices into IQ4_VALUES). */
INLINE int nibble_format(int64_t type) {
    return type == TYPE_Q4_0 || type == TYPE_Q5_0 || type == TYPE_Q4_1 || type == TYPE_Q5_1 || type == TYPE_IQ4_NL;
}
INLINE int nibble_five(int64_t type) { return type == TYPE_Q5_0 || type == TYPE_Q5_1; }
INLINE int nibble_min(int64_t type) { return type == TYPE_Q4_1 || type == TYPE_Q5_1; }
/* Where a nibble tile's scales lie (its minimums 32 bytes further). */
INLINE int64_t nibble_scales_at(int64_t type) { return nibble_five(type) ? 320 : 256; }
/* What Q4_0's and Q5_0's values are less than their nibbles (with the fifth bit); 0 for the others. */
INLINE int nibble_offset(int64_t type) { return type == TYPE_Q4_0 ? 8 : type == TYPE_Q5_0 ? 16 : 0; }

/* Values per block: 32, 256 for the K formats, 1 for F32 and F16 (a "block" is one value). */
API int64_t block_values(int64_t type) {
    return k_format(type) ? QK_K : float_format(type) ? 1 : QK;
}

/* Bytes of one GGUF block. */
API int64_t block_bytes(int64_t type) {
    switch (type) {
        case TYPE_F32: return 4;
        case TYPE_F16: return 2;
        case TYPE_Q4_0: return sizeof(block_q4_0);
        case TYPE_Q5_0: return sizeof(block_q5_0);
        case TYPE_Q4_1: return 20;
        case TYPE_Q5_1: return 24;
        case TYPE_IQ4_NL: return 18;
        case TYPE_Q8_0: return sizeof(block_q8_0);
        case TYPE_Q2_K: return sizeof(block_q2_k);
        case TYPE_Q3_K: return sizeof(block_q3_k);
        case TYPE_Q4_K: return sizeof(block_q4_k);
        case TYPE_Q5_K: return sizeof(block_q5_k);
        case TYPE_Q6_K: return sizeof(block_q6_k);
        case TYPE_IQ4_XS: return sizeof(block_iq4_xs);
        default: return 0;
    }
}

static int64_t tile_block_bytes(int64_t type) {
    switch (type) {
        case TYPE_F32: return F32_TILE;
        case TYPE_F16: return F16_TILE;
        case TYPE_Q4_0: return Q4_0_TILE;
        case TYPE_Q5_0: return Q5_0_TILE;
        case TYPE_IQ4_NL: return Q4_0_TILE;
        case TYPE_Q4_1: return Q4_0_TILE + 32;
        case TYPE_Q5_1: return Q5_0_TILE + 32;
        case TYPE_Q8_0: return Q8_0_TILE;
        case TYPE_Q2_K: return Q2_K_TILE;
        case TYPE_Q3_K: return Q3_K_TILE;
        case TYPE_Q4_K: return Q4_K_TILE;
        case TYPE_Q5_K: return Q5_K_TILE;
        case TYPE_Q6_K: return Q6_K_TILE;
        case TYPE_IQ4_XS: return IQ4_XS_TILE;
        default: return 0;
    }
}

/* Bytes of a packed ``rows`` x ``k`` matrix (rows rounded up to whole tiles). */
API int64_t packed_bytes(int64_t type, int64_t rows, int64_t k) {
    return (rows + TILE - 1) / TILE * (k / block_values(type)) * tile_block_bytes(type);
}

/* ------------------------------------------------------------------ packing */

static void q4_k_scale_min(const uint8_t *s, int j, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (uint8_t)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        *min = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Q2_K's and Q3_K's bit-pair plane (Q3_K_TILE): value v's pair, set in a zeroed tile block and read. */
static void put_pair(uint8_t *tile, int r, int v, int pair) {
    tile[v % 64 / 4 * 64 + r * 4 + v % 4] |= (uint8_t)(pair << (2 * (v / 64)));
}
static int pair_at(const uint8_t *tile, int r, int v) { return tile[v % 64 / 4 * 64 + r * 4 + v % 4] >> (2 * (v / 64)) & 3; }

/* A Q3_K block's 256 values as unsigned 3-bit numbers (the weight's is the value less 4) and its 16
 * scales (less 32: signed), unpacked from their twelve bytes: a scale's low four bits are a
 * nibble of bytes 0-7, its top two a pair of bytes 8-11. */
static void q3_k_values(const block_q3_k *b, uint8_t *q, int8_t *scales) {
    for (int j = 0; j < 16; j++) {
        int low = j < 8 ? b->scales[j] & 0x0f : b->scales[j - 8] >> 4, high = b->scales[8 + j % 4] >> (2 * (j / 4)) & 3;
        scales[j] = (int8_t)((low | high << 4) - 32);
    }
    for (int h = 0; h < 2; h++)
        for (int part = 0; part < 4; part++)
            for (int l = 0; l < 32; l++) {
                int low = b->qs[h * 32 + l] >> (2 * part) & 3, third = b->hmask[l] >> (4 * h + part) & 1;
                q[h * 128 + part * 32 + l] = (uint8_t)(low | third << 2);
            }
}

/* A Q6_K block's 256 values as unsigned 6-bit numbers (the stored value less 32 is the weight's). */
static void q6_k_values(const block_q6_k *b, uint8_t *q) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *ql = b->ql + h * 64;
            const uint8_t qh = b->qh[h * 32 + l];
            uint8_t *v = q + h * 128 + l;
            v[0] = (uint8_t)((ql[l] & 0x0f) | (qh & 3) << 4);
            v[32] = (uint8_t)((ql[l + 32] & 0x0f) | (qh >> 2 & 3) << 4);
            v[64] = (uint8_t)((ql[l] >> 4) | (qh >> 4 & 3) << 4);
            v[96] = (uint8_t)((ql[l + 32] >> 4) | (qh >> 6 & 3) << 4);
        }
}

/* One tile block from the rows' GGUF blocks (``src[r]`` NULL: a padding row of zeros). */
static void pack_tile_block(int64_t type, const uint8_t *const *src, uint8_t *dst) {
    int64_t size = tile_block_bytes(type);
    memset(dst, 0, (size_t)size);
    for (int r = 0; r < TILE; r++) {
        const uint8_t *s = src[r];
        if (float_format(type)) {
            if (s) memcpy(dst + r * block_bytes(type), s, (size_t)block_bytes(type));
        } else if (type == TYPE_Q8_0) {
            const block_q8_0 *b = (const block_q8_0 *)s;
            for (int g = 0; g < 8; g++)
                for (int j = 0; j < 4; j++) dst[g * 64 + r * 4 + j] = (uint8_t)((s ? b->qs[4 * g + j] : 0) ^ 0x80);
            if (s) memcpy(dst + 512 + 2 * r, &b->d, 2);
        } else if (!s) {
            continue;
        } else if (nibble_format(type)) { /* d, then m, then the fifth bits, then 16 bytes of nibbles */
            const uint8_t *qs = s + block_bytes(type) - QK / 2;
            int64_t scales = nibble_scales_at(type);
            for (int c = 0; c < 4; c++) memcpy(dst + c * 64 + r * 4, qs + 4 * c, 4);
            if (nibble_five(type)) {
                uint32_t qh;
                memcpy(&qh, qs - 4, 4);
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++) {
                        uint64_t lo = qh >> (4 * c + j) & 1, hi = qh >> (16 + 4 * c + j) & 1;
                        uint64_t masks[2];
                        memcpy(masks, dst + 256 + 16 * c, 16);
                        masks[0] |= lo << (4 * r + j);
                        masks[1] |= hi << (4 * r + j);
                        memcpy(dst + 256 + 16 * c, masks, 16);
                    }
            }
            memcpy(dst + scales + 2 * r, s, 2);
            if (nibble_min(type)) memcpy(dst + scales + 32 + 2 * r, s + 2, 2);
        } else if (type == TYPE_IQ4_XS) {
            const block_iq4_xs *b = (const block_iq4_xs *)s;
            for (int g = 0; g < 32; g++) memcpy(dst + g * 64 + r * 4, b->qs + 4 * g, 4);
            for (int j = 0; j < 8; j++) {
                int low = b->scales_l[j / 2] >> (4 * (j % 2)) & 0x0f, high = b->scales_h >> (2 * j) & 3;
                dst[2048 + j * 16 + r] = (uint8_t)(int8_t)((low | high << 4) - 32);
            }
            memcpy(dst + 2176 + 2 * r, &b->d, 2);
        } else if (type == TYPE_Q2_K) {
            const block_q2_k *b = (const block_q2_k *)s;
            for (int v = 0; v < QK_K; v++) /* value h*128 + 32p + l: bits 2p of byte 32h + l */
                put_pair(dst, r, v, b->qs[v / 128 * 32 + v % 32] >> (2 * (v % 128 / 32)) & 3);
            for (int j = 0; j < 16; j++) dst[1024 + j * 16 + r] = b->scales[j];
            memcpy(dst + 1280 + 2 * r, &b->d, 2);
            memcpy(dst + 1312 + 2 * r, &b->dmin, 2);
        } else if (type == TYPE_Q3_K) {
            const block_q3_k *b = (const block_q3_k *)s;
            uint8_t q[QK_K];
            int8_t scales[16];
            q3_k_values(b, q, scales);
            for (int v = 0; v < QK_K; v++) {
                put_pair(dst, r, v, q[v] & 3);
                dst[1024 + v % 32 / 4 * 64 + r * 4 + v % 4] |= (uint8_t)((q[v] >> 2) << (v / 32));
            }
            for (int j = 0; j < 16; j++) dst[1536 + j * 16 + r] = (uint8_t)scales[j];
            memcpy(dst + 1792 + 2 * r, &b->d, 2);
        } else if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
            const block_q4_k *b = (const block_q4_k *)s; /* Q5_K's d, dmin and scales lie where Q4_K's do */
            const uint8_t *qs = type == TYPE_Q4_K ? b->qs : ((const block_q5_k *)s)->qs;
            for (int c = 0; c < 4; c++)
                for (int l4 = 0; l4 < 8; l4++) memcpy(dst + (c * 8 + l4) * 64 + r * 4, qs + c * 32 + 4 * l4, 4);
            if (type == TYPE_Q5_K)
                for (int l4 = 0; l4 < 8; l4++) memcpy(dst + 2368 + l4 * 64 + r * 4, ((const block_q5_k *)s)->qh + 4 * l4, 4);
            for (int j = 0; j < 8; j++) {
                uint8_t scale, min;
                q4_k_scale_min(b->scales, j, &scale, &min);
                dst[2048 + j * 16 + r] = scale;
                dst[2176 + ((j / 2) * 16 + r) * 2 + j % 2] = min;
            }
            memcpy(dst + 2304 + 2 * r, &b->d, 2);
            memcpy(dst + 2336 + 2 * r, &b->dmin, 2);
        } else { /* Q6_K */
            const block_q6_k *b = (const block_q6_k *)s;
            uint8_t q[QK_K];
            q6_k_values(b, q);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 8; g++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *v = q + h * 128 + 4 * g + j; /* v[32p]: part p's value */
                        uint8_t *group = dst + (h * 8 + g) * 192 + r * 4 + j;
                        group[0] = (uint8_t)(v[0] | (v[96] & 3) << 6);
                        group[64] = (uint8_t)(v[32] | (v[96] >> 2 & 3) << 6);
                        group[128] = (uint8_t)(v[64] | (v[96] >> 4) << 6);
                    }
            for (int j = 0; j < 16; j++) dst[3072 + j * 16 + r] = (uint8_t)b->scales[j];
            memcpy(dst + 3328 + 2 * r, &b->d, 2);
        }
    }
}

/* ``rows`` x ``k`` GGUF blocks at ``src`` into tiles at ``dst`` (packed_bytes of them);
 * packed row i is source row order[i] (order NULL: row i). */
API void pack_matrix(int64_t type, const void *src, int64_t rows, int64_t k, const int64_t *order, void *dst,
                     int64_t threads) {
    int64_t nb = k / block_values(type), bb = block_bytes(type), tb = tile_block_bytes(type);
    int64_t tiles = (rows + TILE - 1) / TILE, row_bytes = nb * bb;
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * k >= (1 << 20))
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *blocks[TILE];
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < TILE; r++) {
                int64_t row = t * TILE + r;
                blocks[r] = row < rows ? (const uint8_t *)src + (order ? order[row] : row) * row_bytes + b * bb : NULL;
            }
            pack_tile_block(type, blocks, (uint8_t *)dst + (t * nb + b) * tb);
        }
    }
}

/* ------------------------------------------------------------------ unpacking */

/* Row ``row`` of a packed matrix as float32 (the embedding lookup; the reference product). */
static void unpack_row(int64_t type, const uint8_t *w, int64_t k, int64_t row, float *y) {
    int64_t nb = k / block_values(type), tb = tile_block_bytes(type);
    int r = (int)(row % TILE);
    const uint8_t *tile = w + row / TILE * nb * tb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *t = tile + b * tb;
        if (type == TYPE_F32) {
            memcpy(y + b, t + 4 * r, 4);
        } else if (type == TYPE_F16) {
            y[b] = half_to_float(load_u16(t + 2 * r));
        } else if (type == TYPE_Q8_0) {
            float d = half_to_float(load_u16(t + 512 + 2 * r));
            for (int j = 0; j < QK; j++) y[b * QK + j] = d * (float)((int)t[(j / 4) * 64 + r * 4 + j % 4] - 128);
        } else if (nibble_format(type)) {
            int64_t scales = nibble_scales_at(type);
            float d = half_to_float(load_u16(t + scales + 2 * r));
            float m = nibble_min(type) ? half_to_float(load_u16(t + scales + 32 + 2 * r)) : 0.0f;
            int offset = nibble_offset(type);
            for (int c = 0; c < 4; c++)
                for (int j = 0; j < 4; j++) {
                    uint8_t q = t[c * 64 + r * 4 + j];
                    int nibbles[2] = {q & 0x0f, q >> 4};
                    if (nibble_five(type)) {
                        uint64_t masks[2];
                        memcpy(masks, t + 256 + 16 * c, 16);
                        for (int h = 0; h < 2; h++) nibbles[h] |= (int)(masks[h] >> (4 * r + j) & 1) << 4;
                    }
                    for (int h = 0; h < 2; h++) {
                        float *out = y + b * QK + 16 * h + 4 * c + j;
                        if (type == TYPE_IQ4_NL)
                            *out = d * (float)IQ4_VALUES[nibbles[h]];
                        else if (nibble_min(type))
                            *out = d * (float)nibbles[h] + m;
                        else
                            *out = d * (float)(nibbles[h] - offset);
                    }
                }
        } else if (type == TYPE_IQ4_XS) {
            float d = half_to_float(load_u16(t + 2176 + 2 * r));
            for (int v = 0; v < QK_K; v++) {
                int s = v / 32, high = v % 32 / 16, c = v % 16 / 4, j = v % 4;
                uint8_t q = t[(4 * s + c) * 64 + r * 4 + j];
                float dl = d * (float)(int8_t)t[2048 + s * 16 + r];
                y[b * QK_K + v] = dl * (float)IQ4_VALUES[high ? q >> 4 : q & 0x0f];
            }
        } else if (type == TYPE_Q2_K) {
            float d = half_to_float(load_u16(t + 1280 + 2 * r)), dmin = half_to_float(load_u16(t + 1312 + 2 * r));
            for (int v = 0; v < QK_K; v++) {
                int both = t[1024 + (v / 16) * 16 + r];
                y[b * QK_K + v] = d * (float)(both & 0x0f) * (float)pair_at(t, r, v) - dmin * (float)(both >> 4);
            }
        } else if (type == TYPE_Q3_K) {
            float d = half_to_float(load_u16(t + 1792 + 2 * r));
            for (int v = 0; v < QK_K; v++) {
                int third = t[1024 + v % 32 / 4 * 64 + r * 4 + v % 4] >> (v / 32) & 1;
                y[b * QK_K + v] = d * (float)(int8_t)t[1536 + (v / 16) * 16 + r] * (float)((pair_at(t, r, v) | third << 2) - 4);
            }
        } else if (type == TYPE_Q4_K || type == TYPE_Q5_K) {
            float d = half_to_float(load_u16(t + 2304 + 2 * r)), dmin = half_to_float(load_u16(t + 2336 + 2 * r));
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    uint8_t q = t[(c * 8 + l / 4) * 64 + r * 4 + l % 4];
                    uint8_t qh = type == TYPE_Q5_K ? t[2368 + (l / 4) * 64 + r * 4 + l % 4] : 0;
                    for (int half = 0; half < 2; half++) {
                        int s = 2 * c + half, fifth = (qh >> s & 1) << 4;
                        float scale = d * (float)t[2048 + s * 16 + r];
                        float min = dmin * (float)t[2176 + ((s / 2) * 16 + r) * 2 + s % 2];
                        y[b * QK_K + c * 64 + 32 * half + l] = scale * (float)((half ? q >> 4 : q & 0x0f) | fifth) - min;
                    }
                }
        } else { /* Q6_K */
            float d = half_to_float(load_u16(t + 3328 + 2 * r));
            for (int v = 0; v < QK_K; v++) {
                int h = v / 128, p = v % 128 / 32, g = v % 32 / 4, j = v % 4;
                const uint8_t *group = t + (h * 8 + g) * 192 + r * 4 + j;
                int q = p < 3 ? group[64 * p] & 0x3f : group[0] >> 6 | (group[64] >> 6) << 2 | (group[128] >> 6) << 4;
                y[b * QK_K + v] = d * (float)(int8_t)t[3072 + (v / 16) * 16 + r] * (float)(q - 32);
            }
        }
    }
}

/* Rows ``ids`` of a packed matrix of ``k`` columns, as float32 rows of ``out`` (an
 * embedding lookup), shared among the team by rows. */
void packed_rows_share(int64_t type, const void *w, int64_t k, const int64_t *ids, int64_t n, float *out, int me,
                       int threads) {
    int64_t begin, end;
    team_share(n, me, threads, &begin, &end);
    for (int64_t i = begin; i < end; i++) unpack_row(type, (const uint8_t *)w, k, ids[i], out + i * k);
}

API void dequantize_rows(int64_t type, const void *w, int64_t k, const int64_t *ids, int64_t n, float *out) {
    packed_rows_share(type, w, k, ids, n, out, 0, 1);
}

/* ------------------------------------------------------------------ activations */

/* Q8_0: per 32 values, d = max|x| / 127 (stored as float), q = round(x / d) (ties to even). */
static void quantize_row_q8_0(const float *x, act_q8_0 *y, int64_t k) {
    for (int64_t b = 0; b < k / QK; b++, x += QK) {
        float amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(x[j] * id);
            y[b].qs[j] = (int8_t)q;
            sum += q;
        }
        y[b].d = d;
        y[b].sum = sum;
    }
}

/* Q8_K: per 256 values, the scale makes the value of largest magnitude -127 or 127;
 * the sums of each 16 quantized values come with it. */
static void quantize_row_q8_k(const float *x, act_q8_k *y, int64_t k) {
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
#pragma omp simd
        for (int j = 0; j < QK_K; j++) {
            int v = (int)nearbyintf(iscale * x[j]);
            y[b].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += y[b].qs[g * 16 + j];
            y[b].bsums[g] = (int16_t)sum;
        }
        for (int p = 0; p < 4; p++) {
            const int16_t *bs = y[b].bsums + 4 * p;
            int32_t s0 = bs[0] + bs[1], s1 = bs[2] + bs[3]; /* at most 32 x 127 each: int16 */
            y[b].pairs[p] = (int32_t)((uint32_t)(uint16_t)s0 | (uint32_t)s1 << 16);
        }
        y[b].d = 1.0f / iscale;
    }
}


API int64_t activation_row_bytes(int64_t type, int64_t k) {
    return k_format(type) ? k / QK_K * (int64_t)sizeof(act_q8_k) : k / QK * (int64_t)sizeof(act_q8_0);
}

/* Thread me of ``threads``' share of quantizing ``rows`` activation rows of ``k`` values. */
void quantize_share(int64_t type, const float *x, int64_t rows, int64_t k, void *out, int me, int threads) {
    int64_t row_bytes = activation_row_bytes(type, k), begin, end;
    team_share(rows, me, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) {
        uint8_t *y = (uint8_t *)out + r * row_bytes;
        if (k_format(type))
            quantize_row_q8_k(x + r * k, (act_q8_k *)y, k);
        else
            quantize_row_q8_0(x + r * k, (act_q8_0 *)y, k);
    }
}

/* ``rows`` activation rows of ``k`` values, quantized as ``type``'s products want them. */
API void quantize_activations(int64_t type, const float *x, int64_t rows, int64_t k, void *out, int64_t threads) {
    int parallel = threads > 1 && rows * k >= (1 << 16);
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    quantize_share(type, x, rows, k, out, team_me(), team_size());
}

/* ------------------------------------------------------------------ tile products
 *
 * Each adds to acc[i] (16 rows of the tile) the products with activation rows a[i], i < R,
 * over the tile's nb blocks. R is a constant where they are inlined (tile_product). */

/* Prefetches the cache lines of [p, p + bytes) PF_DISTANCE ahead into the second-level cache. */
INLINE void prefetch_ahead_l2(const uint8_t *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + PF_DISTANCE + o, 0, 2);
}

/* The same for a product of R activation rows: into the first-level cache for one row; into the
 * second for several, whose arithmetic holds each line longer, so that lines in flight wait in
 * the second level's many miss buffers rather than the first's few (measured: bench/README.md). */
INLINE void prefetch_ahead(const uint8_t *p, int64_t bytes, int R) {
    if (R == 1)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + PF_DISTANCE + o, 0, 3);
    else
        prefetch_ahead_l2(p, bytes);
}

/* Whether a lone row's K-format tiles, which it reads front to back, are also prefetched by software.
 * Some cores' hardware prefetchers keep one row's stream at full speed on their own, and there the
 * prefetches only take load slots from the arithmetic; others reach the memory's speed only when
 * asked ahead (bench/README.md has both). Set per CPU by kernels/cpu (set_lone_row_prefetch). */
static int lone_row_prefetch;

API void set_lone_row_prefetch(int64_t on) { lone_row_prefetch = on != 0; }

/* A lone row's prefetch of one tile block (``bytes``), PF_DISTANCE ahead and spread over the
 * ``steps`` steps the kernel takes through the block: step ``step`` asks for its share of the
 * lines. All of a block's lines asked for at once, before its arithmetic, streamed slower (the
 * burst likely fills the core's few first-level miss buffers, the arithmetic waiting behind it;
 * bench/README.md). */
INLINE void prefetch_share(const uint8_t *p, int64_t bytes, int step, int steps) {
    const int lines = (int)((bytes + 63) / 64), per = (lines + steps - 1) / steps;
    for (int l = step * per; l < (step + 1) * per && l < lines; l++) __builtin_prefetch(p + PF_DISTANCE + 64 * l, 0, 3);
}

INLINE void tile_q8_0(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    for (int64_t b = 0; b < nb; b++, tile += Q8_0_TILE) {
        prefetch_ahead(tile, Q8_0_TILE, R);
        vf d = vf_halves(tile + 512);
        vi sum[ROWS_AT_ONCE], odd[ROWS_AT_ONCE]; /* two chains each: the sums' latency overlaps */
        for (int i = 0; i < R; i++) {
            sum[i] = vi_set1(-Q8_OFFSET * ((const act_q8_0 *)a[i])[b].sum);
            odd[i] = vi_set1(0);
        }
        for (int g = 0; g < 8; g += 2) {
            vi w = vi_load(tile + 64 * g), w2 = vi_load(tile + 64 * (g + 1));
            for (int i = 0; i < R; i++) {
                const int8_t *q = ((const act_q8_0 *)a[i])[b].qs + 4 * g;
                sum[i] = vi_dot_q8(sum[i], w, q);
                odd[i] = vi_dot_q8(odd[i], w2, q + 4);
                vi_keep(&sum[i]);
                vi_keep(&odd[i]);
            }
        }
        for (int i = 0; i < R; i++)
            acc[i] = vf_fma(vf_from(vi_add(sum[i], odd[i])), vf_mul(d, vf_set1(((const act_q8_0 *)a[i])[b].d)), acc[i]);
    }
}

/* The 32-value nibble formats: Q4_0 and Q5_0, nibbles (plus fifth bits for Q5_0) less 8 (16);
 * Q4_1 and Q5_1, d * q + m (the minimum times the activations' sum); IQ4_NL, d * IQ4_VALUES[q]
 * (looked up as IQ4_BYTES, whose offset of Q8_OFFSET per value the sum takes off). ``type`` is a
 * constant in each call. */
INLINE void tile_nibbles(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    const int five = nibble_five(type), min = nibble_min(type), grid = type == TYPE_IQ4_NL;
    const int64_t scales = nibble_scales_at(type), size = scales + (min ? 64 : 32);
    const int offset = grid ? Q8_OFFSET : nibble_offset(type);
    for (int64_t b = 0; b < nb; b++, tile += size) {
        prefetch_ahead(tile, size, R);
        vf d = vf_halves(tile + scales);
        vi sum[ROWS_AT_ONCE], high[ROWS_AT_ONCE]; /* low and high nibbles: two chains */
        for (int i = 0; i < R; i++) {
            sum[i] = vi_set1(-offset * ((const act_q8_0 *)a[i])[b].sum);
            high[i] = vi_set1(0);
        }
        for (int c = 0; c < 4; c++) {
            vi w = vi_load(tile + 64 * c), lo = vi_lo4(w), hi = vi_hi4(w);
            if (five) {
                uint64_t masks[2];
                memcpy(masks, tile + 256 + 16 * c, 16);
                lo = vi_add16_masked(lo, masks[0]);
                hi = vi_add16_masked(hi, masks[1]);
            }
            if (grid) {
                lo = vi_iq4(lo);
                hi = vi_iq4(hi);
            }
            for (int i = 0; i < R; i++) {
                const int8_t *q = ((const act_q8_0 *)a[i])[b].qs;
                sum[i] = grid ? vi_dot_q8(sum[i], lo, q + 4 * c) : vi_dot(sum[i], lo, q + 4 * c);
                high[i] = grid ? vi_dot_q8(high[i], hi, q + 16 + 4 * c) : vi_dot(high[i], hi, q + 16 + 4 * c);
                vi_keep(&sum[i]);
                vi_keep(&high[i]);
            }
        }
        vf m = min ? vf_halves(tile + scales + 32) : vf_zero();
        for (int i = 0; i < R; i++) {
            const act_q8_0 *x = &((const act_q8_0 *)a[i])[b];
            acc[i] = vf_fma(vf_from(vi_add(sum[i], high[i])), vf_mul(d, vf_set1(x->d)), acc[i]);
            if (min) acc[i] = vf_fma(m, vf_set1(x->d * (float)x->sum), acc[i]);
        }
    }
}

/* A K-format block's sums into the accumulators: d times the scaled sums less dmin times the
 * minimums' (the 16 rows' d and dmin as halves at ``d`` and ``dmin``), times the activations' scale. */
INLINE void add_block(vf *acc, const vi *total, const vi *mins, const uint8_t *d, const uint8_t *dmin,
                      const uint8_t *const *a, int64_t b, int R) {
    vf vd = vf_halves(d), vdmin = vf_halves(dmin);
    for (int i = 0; i < R; i++) {
        float ad = ((const act_q8_k *)a[i])[b].d;
        acc[i] = vf_fma(vf_from(total[i]), vf_mul(vd, vf_set1(ad)), acc[i]);
        acc[i] = vf_fma(vf_from(mins[i]), vf_mul(vdmin, vf_set1(-ad)), acc[i]);
    }
}

/* Q4_K and Q5_K: d * scale_s * q - dmin * min_s for the 8 sub-blocks s of 32 (Q5_K's q with its
 * fifth bit). */
INLINE void tile_q4_k(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc, int five, int spread) {
    const int64_t size = five ? Q5_K_TILE : Q4_K_TILE;
    for (int64_t b = 0; b < nb; b++, tile += size) {
        /* A lone row reads a Q4_K tile front to back, which some cores' hardware prefetchers follow
         * on their own: a prefetch per line only takes the load port from the arithmetic (on the
         * others, ``spread``: tile_row_prefetched's). Q5_K's tile is read in two streams (nibbles,
         * fifth bits): asked for ahead even for one row, a block at a time into L2 (a block into
         * L1 at once streamed a lone row well below two rows'), or spread (bench/README.md). */
        if (five && !spread)
            prefetch_ahead_l2(tile, size);
        else if (R > 1)
            prefetch_ahead(tile, size, R);
        vi total[ROWS_AT_ONCE], mins[ROWS_AT_ONCE];
        for (int i = 0; i < R; i++) total[i] = mins[i] = vi_set1(0);
        for (int c = 0; c < 4; c++) {
            vi lo[ROWS_AT_ONCE], hi[ROWS_AT_ONCE], lo2[ROWS_AT_ONCE], hi2[ROWS_AT_ONCE];
            for (int i = 0; i < R; i++) lo[i] = hi[i] = lo2[i] = hi2[i] = vi_set1(0);
            for (int l4 = 0; l4 < 8; l4 += 2) { /* two chains each: the sums' latency overlaps */
                if (spread) prefetch_share(tile, size, c * 4 + l4 / 2, 16);
                vi w = vi_load(tile + (c * 8 + l4) * 64), wl = vi_lo4(w), wh = vi_hi4(w);
                vi w2 = vi_load(tile + (c * 8 + l4 + 1) * 64), wl2 = vi_lo4(w2), wh2 = vi_hi4(w2);
                if (five) { /* bit 2c of a row's qh byte tops its low nibble, bit 2c + 1 its high one */
                    vi qh = vi_load(tile + 2368 + l4 * 64), qh2 = vi_load(tile + 2368 + (l4 + 1) * 64);
                    wl = vi_or(wl, vi_bits(qh, 4 - 2 * c, 0x10));
                    wh = vi_or(wh, vi_bits(qh, 3 - 2 * c, 0x10));
                    wl2 = vi_or(wl2, vi_bits(qh2, 4 - 2 * c, 0x10));
                    wh2 = vi_or(wh2, vi_bits(qh2, 3 - 2 * c, 0x10));
                }
                for (int i = 0; i < R; i++) {
                    const int8_t *q = ((const act_q8_k *)a[i])[b].qs + c * 64 + 4 * l4;
                    lo[i] = vi_dot(lo[i], wl, q);
                    hi[i] = vi_dot(hi[i], wh, q + 32);
                    lo2[i] = vi_dot(lo2[i], wl2, q + 4);
                    hi2[i] = vi_dot(hi2[i], wh2, q + 36);
                    vi_keep(&lo[i]);
                    vi_keep(&hi[i]);
                    vi_keep(&lo2[i]);
                    vi_keep(&hi2[i]);
                }
            }
            for (int i = 0; i < R; i++) {
                lo[i] = vi_add(lo[i], lo2[i]);
                hi[i] = vi_add(hi[i], hi2[i]);
            }
            vi s_lo = vi_u8_to_i32(tile + 2048 + (2 * c) * 16), s_hi = vi_u8_to_i32(tile + 2048 + (2 * c + 1) * 16);
            for (int i = 0; i < R; i++) total[i] = vi_add(total[i], vi_add(vi_mul(lo[i], s_lo), vi_mul(hi[i], s_hi)));
        }
        for (int p = 0; p < 4; p++)
            for (int i = 0; i < R; i++)
                mins[i] = vi_madd_u8_pairs(mins[i], tile + 2176 + p * 32, ((const act_q8_k *)a[i])[b].pairs[p]);
        add_block(acc, total, mins, tile + 2304, tile + 2336, a, b, R);
    }
}

/* Q3_K: d * scale_s * (q - 4) for the 16 sub-blocks s of 16, q a group's bit pair with its third bit.
 * Groups g = 4k .. 4k + 3 hold sub-blocks 4p + k (values 64p + 16k .. +16) in their four bit pairs p.
 * Pair p is multiplied where it lies, as 4^p q for p < 3 (16 q for p = 3, two bits lower): one AND,
 * not a shift and an AND, and its third bit then lies two bits above for every p after one shift of
 * the group's third bits. The sums come out 4^p (16) times too large, exactly: shifted back once
 * per sub-block. At most 16 x 7 x 127 x 16 per lane, and 2 x 112 x 127 in an AVX2 int16 pair. */
INLINE void tile_q3_k(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    static const int factor_bits[4] = {0, 2, 4, 4};
    for (int64_t b = 0; b < nb; b++, tile += Q3_K_TILE) {
        prefetch_ahead_l2(tile, Q3_K_TILE); /* read in two streams (pairs, third bits), as Q5_K's */
        vi total[ROWS_AT_ONCE];
        for (int i = 0; i < R; i++) total[i] = vi_set1(0);
        for (int k = 0; k < 4; k++) {
            vi part[4][ROWS_AT_ONCE];
            for (int p = 0; p < 4; p++)
                for (int i = 0; i < R; i++) part[p][i] = vi_set1(0);
            for (int g = 4 * k; g < 4 * k + 4; g++) {
                vi w = vi_load(tile + 64 * g), high = vi_load(tile + 1024 + 64 * (g % 8));
                /* value 64p + 4g's third bit is bit 2p + g / 8: to bit 2p + 2 (bit 6 for p = 3) */
                vi v[4] = {vi_or(vi_bits(w, 0, 0x03), vi_bits(high, 2 - g / 8, 0x04)),
                           vi_or(vi_bits(w, 0, 0x0c), vi_bits(high, 2 - g / 8, 0x10)),
                           vi_or(vi_bits(w, 0, 0x30), vi_bits(high, 2 - g / 8, 0x40)),
                           vi_or(vi_bits(w, -2, 0x30), vi_bits(high, -(g / 8), 0x40))};
                for (int i = 0; i < R; i++) {
                    const int8_t *q = ((const act_q8_k *)a[i])[b].qs + 4 * g;
                    for (int p = 0; p < 4; p++) part[p][i] = vi_dot(part[p][i], v[p], q + 64 * p);
                }
            }
            for (int p = 0; p < 4; p++) {
                int s = 4 * p + k;
                vi scale = vi_s8_to_i32((const int8_t *)tile + 1536 + s * 16);
                for (int i = 0; i < R; i++) {
                    vi sum = factor_bits[p] ? vi_sra(part[p][i], factor_bits[p]) : part[p][i];
                    vi centred = vi_add(sum, vi_set1(-4 * ((const act_q8_k *)a[i])[b].bsums[s]));
                    total[i] = vi_add(total[i], vi_mul(centred, scale));
                }
            }
        }
        vf d = vf_halves(tile + 1792);
        for (int i = 0; i < R; i++) acc[i] = vf_fma(vf_from(total[i]), vf_mul(d, vf_set1(((const act_q8_k *)a[i])[b].d)), acc[i]);
    }
}

/* Q2_K: d * scale_s * q - dmin * min_s for the 16 sub-blocks s of 16, q a group's bit pair, multiplied
 * where it lies as Q3_K's (pair 3 two bits lower: 64 times three would overflow AVX2's int16 pairs);
 * the minimums times the activations' sums of 16. */
INLINE void tile_q2_k(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc, int spread) {
    static const int factor_bits[4] = {0, 2, 4, 4};
    for (int64_t b = 0; b < nb; b++, tile += Q2_K_TILE) {
        if (R > 1) prefetch_ahead(tile, Q2_K_TILE, R); /* a lone row's tile is read front to back */
        vi total[ROWS_AT_ONCE], mins[ROWS_AT_ONCE];
        for (int i = 0; i < R; i++) total[i] = mins[i] = vi_set1(0);
        for (int k = 0; k < 4; k++) {
            vi part[4][ROWS_AT_ONCE];
            for (int p = 0; p < 4; p++)
                for (int i = 0; i < R; i++) part[p][i] = vi_set1(0);
            for (int g = 4 * k; g < 4 * k + 4; g++) {
                if (spread) prefetch_share(tile, Q2_K_TILE, g, 16);
                vi w = vi_load(tile + 64 * g);
                vi v[4] = {vi_bits(w, 0, 0x03), vi_bits(w, 0, 0x0c), vi_bits(w, 0, 0x30), vi_bits(w, -2, 0x30)};
                for (int i = 0; i < R; i++) {
                    const int8_t *q = ((const act_q8_k *)a[i])[b].qs + 4 * g;
                    for (int p = 0; p < 4; p++) part[p][i] = vi_dot(part[p][i], v[p], q + 64 * p);
                }
            }
            for (int p = 0; p < 4; p++) {
                int s = 4 * p + k;
                vi both = vi_u8_to_i32(tile + 1024 + s * 16), scale = vi_lo4(both), min = vi_hi4(both);
                for (int i = 0; i < R; i++) {
                    vi sum = factor_bits[p] ? vi_sra(part[p][i], factor_bits[p]) : part[p][i];
                    total[i] = vi_add(total[i], vi_mul(sum, scale));
                    mins[i] = vi_add(mins[i], vi_mul(min, vi_set1(((const act_q8_k *)a[i])[b].bsums[s])));
                }
            }
        }
        add_block(acc, total, mins, tile + 1280, tile + 1312, a, b, R);
    }
}

/* IQ4_XS: d * scale_s * IQ4_VALUES[q] for the 8 sub-blocks s of 32. The values are looked up as
 * IQ4_BYTES (vi_dot_q8's operand): a sub-block's sum comes out Q8_OFFSET times its activations' sum
 * too large, taken off where it starts. */
INLINE void tile_iq4_xs(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc, int spread) {
    for (int64_t b = 0; b < nb; b++, tile += IQ4_XS_TILE) {
        if (R > 1) prefetch_ahead(tile, IQ4_XS_TILE, R); /* a lone row's tile is read front to back */
        vi total[ROWS_AT_ONCE];
        for (int i = 0; i < R; i++) total[i] = vi_set1(0);
        for (int s = 0; s < 8; s++) {
            vi lo[ROWS_AT_ONCE], hi[ROWS_AT_ONCE]; /* low and high nibbles: two chains */
            for (int i = 0; i < R; i++) {
                const int16_t *bsums = ((const act_q8_k *)a[i])[b].bsums + 2 * s;
                lo[i] = vi_set1(-Q8_OFFSET * (bsums[0] + bsums[1]));
                hi[i] = vi_set1(0);
            }
            for (int c = 0; c < 4; c++) {
                if (spread) prefetch_share(tile, IQ4_XS_TILE, 4 * s + c, 32);
                vi w = vi_load(tile + (4 * s + c) * 64), wl = vi_iq4(vi_lo4(w)), wh = vi_iq4(vi_hi4(w));
                for (int i = 0; i < R; i++) {
                    const int8_t *q = ((const act_q8_k *)a[i])[b].qs + 32 * s + 4 * c;
                    lo[i] = vi_dot_q8(lo[i], wl, q);
                    hi[i] = vi_dot_q8(hi[i], wh, q + 16);
                    vi_keep(&lo[i]);
                    vi_keep(&hi[i]);
                }
            }
            vi scale = vi_s8_to_i32((const int8_t *)tile + 2048 + s * 16);
            for (int i = 0; i < R; i++) total[i] = vi_add(total[i], vi_mul(vi_add(lo[i], hi[i]), scale));
        }
        vf d = vf_halves(tile + 2176);
        for (int i = 0; i < R; i++) acc[i] = vf_fma(vf_from(total[i]), vf_mul(d, vf_set1(((const act_q8_k *)a[i])[b].d)), acc[i]);
    }
}

/* Q6_K: d * scale_s * (q - 32) for the 16 sub-blocks s of 16. */
INLINE void tile_q6_k(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc, int spread) {
    for (int64_t b = 0; b < nb; b++, tile += Q6_K_TILE) {
        if (R > 1) prefetch_ahead(tile, Q6_K_TILE, R); /* a lone row's tile is read front to back, as Q4_K's */
        vi total[ROWS_AT_ONCE];
        for (int i = 0; i < R; i++) total[i] = vi_set1(0);
        for (int h = 0; h < 2; h++)
            for (int quad = 0; quad < 2; quad++) {
                vi part[4][ROWS_AT_ONCE];
                for (int p = 0; p < 4; p++)
                    for (int i = 0; i < R; i++) part[p][i] = vi_set1(0);
                for (int g = quad * 4; g < quad * 4 + 4; g++) {
                    if (spread) prefetch_share(tile, Q6_K_TILE, h * 8 + g, 16);
                    const uint8_t *group = tile + (h * 8 + g) * 192;
                    vi wa = vi_load(group), wb = vi_load(group + 64), wc = vi_load(group + 128);
                    vi v[4] = {vi_low6(wa), vi_low6(wb), vi_low6(wc), vi_top2s(wa, wb, wc)};
                    for (int i = 0; i < R; i++) {
                        const int8_t *q = ((const act_q8_k *)a[i])[b].qs + h * 128 + 4 * g;
                        for (int p = 0; p < 4; p++) part[p][i] = vi_dot(part[p][i], v[p], q + 32 * p);
                    }
                }
                for (int p = 0; p < 4; p++) {
                    int s = h * 8 + 2 * p + quad; /* values h*128 + 32p + 16quad .. +16 */
                    vi scale = vi_s8_to_i32((const int8_t *)tile + 3072 + s * 16);
                    for (int i = 0; i < R; i++) {
                        vi centred = vi_add(part[p][i], vi_set1(-32 * ((const act_q8_k *)a[i])[b].bsums[s]));
                        total[i] = vi_add(total[i], vi_mul(centred, scale));
                    }
                }
            }
        vf d = vf_halves(tile + 3328);
        for (int i = 0; i < R; i++) acc[i] = vf_fma(vf_from(total[i]), vf_mul(d, vf_set1(((const act_q8_k *)a[i])[b].d)), acc[i]);
    }
}

#if defined(VEC_AVX2) && Q8_OFFSET == 0
/* The K formats and the 32-value nibble formats on AVX2, half a tile at a time: rows 8s..8s+7 of a
 * tile (side s) are bytes 32s..32s+31 of each 64-byte group, one ymm. A Q4_K sub-block's eight
 * groups are summed in the int16 lanes of vpmaddubsw's output before one vpmaddwd by the
 * sub-block's scale (at most 8 x 2 x 15 x 127 = 30480: no saturation), where the generic kernel
 * widens every group; Q6_K's 6-bit values allow two groups (2 x 2 x 63 x 127 = 32004), Q3_K's
 * 3-bit and Q2_K's 2-bit ones a sub-block's four, the nibble formats a block's four. IQ4_XS,
 * IQ4_NL and Q8_0 (signed values of up to 127: one group fills an int16 lane) take the generic
 * kernels. The integers are the generic kernel's exactly, and the float operations per output
 * the same, so the bits are too. */

INLINE __m256i bcast4(const int8_t *p) { return _mm256_set1_epi32(load_i32(p)); }

/* Keeps an accumulator in its register: without it GCC regroups the integer sums of a
 * sub-block (they are associative) into trees whose partial sums spill to the stack. */
#define KEEP(v) __asm__("" : "+x"(v))

/* Eight unsigned bytes as int32 lanes holding the byte in both int16 halves: vpmaddwd's scale. */
INLINE __m256i scale_pairs(const uint8_t *p) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

INLINE void half_q4_k(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, int side, __m256 *acc,
                      int five) {
    const __m256i low = _mm256_set1_epi8(0x0f), fifth = _mm256_set1_epi8(0x10);
    const int o = 32 * side;
    const int64_t size = five ? Q5_K_TILE : Q4_K_TILE;
    /* int16 sums of at most 8 groups of 4-bit values (8 x 2 x 15 x 127 = 30480), 4 of 5-bit ones */
    const int flush = five ? 4 : 8;
    for (int64_t b = 0; b < nb; b++, tile += size) {
        if (!side) prefetch_ahead(tile, size, R);
        __m256i total[4], mins[4];
        for (int i = 0; i < R; i++) total[i] = mins[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i s_lo = scale_pairs(tile + 2048 + (2 * c) * 16 + 8 * side);
            __m256i s_hi = scale_pairs(tile + 2048 + (2 * c + 1) * 16 + 8 * side);
            for (int l0 = 0; l0 < 8; l0 += flush) {
                __m256i lo[4], hi[4];
                for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm256_setzero_si256();
                for (int l4 = l0; l4 < l0 + flush; l4++) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(tile + (c * 8 + l4) * 64 + o));
                    __m256i wl = _mm256_and_si256(w, low), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                    if (five) { /* bit 2c of a row's qh byte tops its low nibble, 2c + 1 its high one */
                        __m256i qh = _mm256_loadu_si256((const __m256i *)(tile + 2368 + l4 * 64 + o));
                        __m256i up = c < 2 ? _mm256_slli_epi16(qh, 4 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 4);
                        __m256i up2 = c < 2 ? _mm256_slli_epi16(qh, 3 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 3);
                        wl = _mm256_or_si256(wl, _mm256_and_si256(up, fifth));
                        wh = _mm256_or_si256(wh, _mm256_and_si256(up2, fifth));
                    }
                    for (int i = 0; i < R; i++) {
                        const int8_t *q = ((const act_q8_k *)a[i])[b].qs + c * 64 + 4 * l4;
                        lo[i] = _mm256_add_epi16(lo[i], _mm256_maddubs_epi16(wl, bcast4(q)));
                        hi[i] = _mm256_add_epi16(hi[i], _mm256_maddubs_epi16(wh, bcast4(q + 32)));
                        KEEP(lo[i]);
                        KEEP(hi[i]);
                    }
                }
                for (int i = 0; i < R; i++)
                    total[i] = _mm256_add_epi32(total[i], _mm256_add_epi32(_mm256_madd_epi16(lo[i], s_lo),
                                                                           _mm256_madd_epi16(hi[i], s_hi)));
            }
        }
        for (int p = 0; p < 4; p++) {
            __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(tile + 2176 + p * 32 + 16 * side)));
            for (int i = 0; i < R; i++)
                mins[i] = _mm256_add_epi32(mins[i], _mm256_madd_epi16(m, _mm256_set1_epi32(((const act_q8_k *)a[i])[b].pairs[p])));
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 2304 + 16 * side)));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 2336 + 16 * side)));
        for (int i = 0; i < R; i++) {
            float ad = ((const act_q8_k *)a[i])[b].d;
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[i]), _mm256_mul_ps(d, _mm256_set1_ps(ad)), acc[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[i]), _mm256_mul_ps(dmin, _mm256_set1_ps(-ad)), acc[i]);
        }
    }
}

/* One 6-bit group of Q6_K for the half tile: values h*128 + 32p + 4g .. +3 of eight rows. */
INLINE __m256i q6_group(const uint8_t *tile, int o, int h, int p, int g) {
    const uint8_t *group = tile + (h * 8 + g) * 192 + o;
    if (p < 3) return low6_half(_mm256_loadu_si256((const __m256i *)(group + 64 * p)));
    return top2s_half(_mm256_loadu_si256((const __m256i *)group), _mm256_loadu_si256((const __m256i *)(group + 64)),
                      _mm256_loadu_si256((const __m256i *)(group + 128)));
}

/* Eight int8 scales as int32 lanes holding the scale in both int16 halves (vpmaddwd's operand). */
INLINE __m256i scale_pairs_s8(const uint8_t *p) {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}

/* One sub-block of Q6_K (16 values, four groups) for R rows: scale_s times the sum of q * a, its
 * groups summed two at a time in int16 (2 x 2 x 63 x 127 = 32004) and scaled by vpmaddwd. The
 * values' offset of 32 is taken off once per super-block (q6_offsets). */
INLINE void q6_sub_block(const uint8_t *tile, int o, int64_t b, const uint8_t *const *a, int R, int h, int p,
                         int quad, __m256i *total) {
    int s = h * 8 + 2 * p + quad;
    __m256i scale = scale_pairs_s8(tile + 3072 + s * 16 + o / 4);
    for (int g = quad * 4; g < quad * 4 + 4; g += 2) {
        __m256i v0 = q6_group(tile, o, h, p, g), v1 = q6_group(tile, o, h, p, g + 1);
        for (int i = 0; i < R; i++) {
            const int8_t *q = ((const act_q8_k *)a[i])[b].qs + h * 128 + 32 * p + 4 * g;
            __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(v0, bcast4(q)), _mm256_maddubs_epi16(v1, bcast4(q + 4)));
            total[i] = _mm256_add_epi32(total[i], _mm256_madd_epi16(two, scale));
            KEEP(total[i]);
        }
    }
}

/* Eight rows' bytes of sub-block s at ``scales`` as int16: signed (Q3_K's and Q6_K's int8 scales), or
 * the high nibbles (Q2_K's minimums). */
INLINE __m128i sub_block_bytes(const uint8_t *scales, int s, int o, int high_nibbles) {
    __m128i v = _mm_loadl_epi64((const __m128i *)(scales + s * 16 + o / 4));
    return high_nibbles ? _mm_srli_epi16(_mm_cvtepu8_epi16(v), 4) : _mm_cvtepi8_epi16(v);
}

/* sums[i] = the sum over the 16 sub-blocks s of byte_s * (row i's activation sum over s), eight
 * vpmaddwd a row: the bytes (sub_block_bytes) of sub-blocks 2j and 2j + 1 as int16 pairs, against
 * the activations' sums of the same pair (two consecutive int16 of bsums). */
INLINE void sub_block_sums(const uint8_t *scales, int high_nibbles, int o, int64_t b, const uint8_t *const *a,
                           int R, __m256i *sums) {
    for (int i = 0; i < R; i++) sums[i] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m128i even = sub_block_bytes(scales, 2 * j, o, high_nibbles), odd = sub_block_bytes(scales, 2 * j + 1, o, high_nibbles);
        __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi16(even, odd), _mm_unpacklo_epi16(even, odd));
        for (int i = 0; i < R; i++) {
            int32_t both;
            memcpy(&both, ((const act_q8_k *)a[i])[b].bsums + 2 * j, 4);
            sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(pairs, _mm256_set1_epi32(both)));
        }
    }
}

/* total -= 2^shift * the sum over the sub-blocks of scale_s * (the activations' sum over s): the
 * values' offset (Q6_K's 32, shift 5; Q3_K's 4, shift 2). */
INLINE void k_offsets(const uint8_t *scales, int shift, int o, int64_t b, const uint8_t *const *a, int R,
                      __m256i *total) {
    __m256i corr[4];
    sub_block_sums(scales, 0, o, b, a, R, corr);
    for (int i = 0; i < R; i++) total[i] = _mm256_sub_epi32(total[i], _mm256_slli_epi32(corr[i], shift));
}

INLINE void half_q6_k(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, int side, __m256 *acc) {
    const int o = 32 * side;
    for (int64_t b = 0; b < nb; b++, tile += Q6_K_TILE) {
        if (!side) prefetch_ahead(tile, Q6_K_TILE, R);
        __m256i total[4];
        for (int i = 0; i < R; i++) total[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
            for (int quad = 0; quad < 2; quad++) {
                q6_sub_block(tile, o, b, a, R, h, 0, quad, total);
                q6_sub_block(tile, o, b, a, R, h, 1, quad, total);
                q6_sub_block(tile, o, b, a, R, h, 2, quad, total);
                q6_sub_block(tile, o, b, a, R, h, 3, quad, total);
            }
        k_offsets(tile + 3072, 5, o, b, a, R, total);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 3328 + 16 * side)));
        for (int i = 0; i < R; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[i]), _mm256_mul_ps(d, _mm256_set1_ps(((const act_q8_k *)a[i])[b].d)), acc[i]);
    }
}

/* Q3_K (``three``) and Q2_K for the half tile: a sub-block's four groups of bit pairs (Q3_K's with their
 * third bits), unscaled, summed in int16 (at most 4 x 2 x 7 x 127 = 7112) and scaled by one vpmaddwd.
 * Q3_K's scales are int8 and its values' offset of 4 is taken off once per super-block; Q2_K's scales
 * are the low nibbles of its scale bytes, and its minimums (the high nibbles) multiply the
 * activations' sums of 16. */
INLINE void half_pairs(const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, int side, __m256 *acc,
                       int three) {
    const int o = 32 * side;
    const int64_t size = three ? Q3_K_TILE : Q2_K_TILE, scales = three ? 1536 : 1024;
    const __m256i low = _mm256_set1_epi32(0x000f000f);
    for (int64_t b = 0; b < nb; b++, tile += size) {
        if (!side) prefetch_ahead(tile, size, R);
        __m256i total[4], mins[4];
        for (int i = 0; i < R; i++) total[i] = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            __m256i sum[4][4]; /* [p][row] */
            for (int p = 0; p < 4; p++)
                for (int i = 0; i < R; i++) sum[p][i] = _mm256_setzero_si256();
            for (int g = 4 * k; g < 4 * k + 4; g++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(tile + 64 * g + o));
                __m256i high = three ? _mm256_loadu_si256((const __m256i *)(tile + 1024 + 64 * (g % 8) + o)) : w;
                for (int p = 0; p < 4; p++) {
                    __m256i v = bits_half(w, -2 * p, 0x03);
                    if (three) v = _mm256_or_si256(v, bits_half(high, 2 - (2 * p + g / 8), 0x04));
                    for (int i = 0; i < R; i++) {
                        const int8_t *q = ((const act_q8_k *)a[i])[b].qs + 64 * p + 4 * g;
                        sum[p][i] = _mm256_add_epi16(sum[p][i], _mm256_maddubs_epi16(v, bcast4(q)));
                        KEEP(sum[p][i]);
                    }
                }
            }
            for (int p = 0; p < 4; p++) {
                const uint8_t *at = tile + scales + (4 * p + k) * 16 + o / 4;
                __m256i scale = three ? scale_pairs_s8(at) : _mm256_and_si256(scale_pairs(at), low);
                for (int i = 0; i < R; i++) total[i] = _mm256_add_epi32(total[i], _mm256_madd_epi16(sum[p][i], scale));
            }
        }
        if (three)
            k_offsets(tile + scales, 2, o, b, a, R, total);
        else
            sub_block_sums(tile + scales, 1, o, b, a, R, mins);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + (three ? 1792 : 1280) + 16 * side)));
        __m256 dmin = three ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + 1312 + 16 * side)));
        for (int i = 0; i < R; i++) {
            float ad = ((const act_q8_k *)a[i])[b].d;
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[i]), _mm256_mul_ps(d, _mm256_set1_ps(ad)), acc[i]);
            if (!three)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[i]), _mm256_mul_ps(dmin, _mm256_set1_ps(-ad)), acc[i]);
        }
    }
}

/* The 32-value nibble formats (Q4_0, Q5_0, Q4_1, Q5_1) for the half tile: a block's four groups of low
 * nibbles, and of high ones, each with its fifth bits, summed in int16 apart (4 x 2 x 31 x 127 = 31496)
 * and widened once a block; the offset through the activations' block sum, as the generic kernel. */
INLINE void half_nibbles(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, int side,
                         __m256 *acc) {
    const int five = nibble_five(type), min = nibble_min(type), o = 32 * side;
    const int64_t scales = nibble_scales_at(type), size = scales + (min ? 64 : 32);
    const int offset = nibble_offset(type);
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, tile += size) {
        if (!side) prefetch_ahead(tile, size, R);
        __m256i lo[4], hi[4];
        for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(tile + 64 * c + o));
            __m256i wl = _mm256_and_si256(w, low), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
            if (five) { /* bit 4r + j of each mask: row r's value j of the group */
                uint64_t masks[2];
                memcpy(masks, tile + 256 + 16 * c, 16);
                wl = _mm256_or_si256(wl, bits_to_16s((uint32_t)(masks[0] >> o)));
                wh = _mm256_or_si256(wh, bits_to_16s((uint32_t)(masks[1] >> o)));
            }
            for (int i = 0; i < R; i++) {
                const int8_t *q = ((const act_q8_0 *)a[i])[b].qs + 4 * c;
                lo[i] = _mm256_add_epi16(lo[i], _mm256_maddubs_epi16(wl, bcast4(q)));
                hi[i] = _mm256_add_epi16(hi[i], _mm256_maddubs_epi16(wh, bcast4(q + 16)));
                KEEP(lo[i]);
                KEEP(hi[i]);
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + scales + 16 * side)));
        __m256 m = min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + scales + 32 + 16 * side)))
                       : _mm256_setzero_ps();
        for (int i = 0; i < R; i++) {
            const act_q8_0 *x = &((const act_q8_0 *)a[i])[b];
            __m256i total = _mm256_add_epi32(_mm256_set1_epi32(-offset * x->sum), _mm256_madd_epi16(lo[i], ones));
            total = _mm256_add_epi32(total, _mm256_madd_epi16(hi[i], ones));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x->d)), acc[i]);
            if (min) acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->d * (float)x->sum), acc[i]);
        }
    }
}

/* The formats with half-tile kernels, for two rows and more. */
INLINE int has_half_tiles(int64_t type) {
    return (k_format(type) && type != TYPE_IQ4_XS) || (nibble_format(type) && type != TYPE_IQ4_NL);
}

/* A side of a 32-value format's tile (Q4_0, Q5_0, Q4_1, Q5_1). */
INLINE void half_nibble_tile(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, int side,
                             __m256 *acc) {
    if (type == TYPE_Q4_0) /* the type a constant in each call, as ``five`` below */
        half_nibbles(TYPE_Q4_0, tile, nb, a, R, side, acc);
    else if (type == TYPE_Q5_0)
        half_nibbles(TYPE_Q5_0, tile, nb, a, R, side, acc);
    else if (type == TYPE_Q4_1)
        half_nibbles(TYPE_Q4_1, tile, nb, a, R, side, acc);
    else
        half_nibbles(TYPE_Q5_1, tile, nb, a, R, side, acc);
}

/* A side of a K format's tile (Q2_K to Q6_K). */
INLINE void half_k_tile(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, int side, __m256 *acc) {
    if (type == TYPE_Q4_K) /* ``five`` a constant in each call: its branches leave the inner loop */
        half_q4_k(tile, nb, a, R, side, acc, 0);
    else if (type == TYPE_Q5_K)
        half_q4_k(tile, nb, a, R, side, acc, 1);
    else if (type == TYPE_Q3_K)
        half_pairs(tile, nb, a, R, side, acc, 1);
    else if (type == TYPE_Q2_K)
        half_pairs(tile, nb, a, R, side, acc, 0);
    else
        half_q6_k(tile, nb, a, R, side, acc);
}

INLINE void half_tile(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, int side, __m256 *acc) {
    if (nibble_format(type))
        half_nibble_tile(type, tile, nb, a, R, side, acc);
    else
        half_k_tile(type, tile, nb, a, R, side, acc);
}

/* Both sides of a tile for R rows, a block at a time: side 0 of a block (which asks for
 * the blocks ahead), then side 1 from L1, so a tile read from memory streams once. Each side sums
 * its blocks in order, as a pass over a whole side does: the same bits. */
INLINE void half_tile_blocks(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    const int64_t size = tile_block_bytes(type), act = k_format(type) ? sizeof(act_q8_k) : sizeof(act_q8_0);
    __m256 part[2][4];
    for (int i = 0; i < R; i++) part[0][i] = part[1][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, tile += size) {
        const uint8_t *block_a[4]; /* block b of each row's activations */
        for (int i = 0; i < R; i++) block_a[i] = a[i] + b * act;
#pragma GCC unroll 1 /* one copy of a side's long unrolled block: two copies ran Q6_K slower */
        for (int side = 0; side < 2; side++) half_k_tile(type, tile, 1, block_a, R, side, part[side]);
    }
    for (int i = 0; i < R; i++) {
        acc[i].l = part[0][i];
        acc[i].h = part[1][i];
    }
}

/* Two or three rows (a few decodes) of a K-format tile, block by block: faster than a side at a
 * time, which reads the tile twice (bench/README.md). Four rows, a pass over a prompt's (the tile
 * then in the caches for the next four), stay a side at a time: calls per block slowed them, as
 * they slow the 32-value formats' small blocks at any count. */
static void half_tile_few_rows(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    if (R == 2)
        half_tile_blocks(type, tile, nb, a, 2, acc);
    else
        half_tile_blocks(type, tile, nb, a, 3, acc);
}

/* Both sides of a tile, a side at a time (the first side's pass prefetches ahead): four rows of any
 * format with half tiles, or two or three of a 32-value format (tile_rows sends a K format's two or
 * three rows to half_tile_few_rows, and no lone row here). Only those counts are expanded: the
 * others never ran, and compiling them took most of this file's build time. */
static void half_tile_rows(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    for (int side = 0; side < 2; side++) {
        __m256 part[4];
        for (int i = 0; i < R; i++) part[i] = _mm256_setzero_ps();
        if (R == 4)
            half_tile(type, tile, nb, a, 4, side, part);
        else if (R == 3)
            half_nibble_tile(type, tile, nb, a, 3, side, part);
        else
            half_nibble_tile(type, tile, nb, a, 2, side, part);
        for (int i = 0; i < R; i++) {
            if (side)
                acc[i].h = part[i];
            else
                acc[i].l = part[i];
        }
    }
}
#endif

/* F32 and F16: float32 activations, two chains of multiply-adds (even and odd columns). */
INLINE void tile_float(const uint8_t *tile, int64_t k, const uint8_t *const *a, int R, vf *acc, int half) {
    const int64_t size = half ? F16_TILE : F32_TILE;
    vf odd[ROWS_AT_ONCE];
    for (int i = 0; i < R; i++) odd[i] = vf_zero();
    int64_t j = 0;
    for (; j + 2 <= k; j += 2, tile += 2 * size) {
        prefetch_ahead(tile, 2 * size, R);
        vf w = half ? vf_halves(tile) : vf_floats(tile), w2 = half ? vf_halves(tile + size) : vf_floats(tile + size);
        for (int i = 0; i < R; i++) {
            const float *x = (const float *)a[i] + j;
            acc[i] = vf_fma(w, vf_set1(x[0]), acc[i]);
            odd[i] = vf_fma(w2, vf_set1(x[1]), odd[i]);
        }
    }
    if (j < k) {
        vf w = half ? vf_halves(tile) : vf_floats(tile);
        for (int i = 0; i < R; i++) acc[i] = vf_fma(w, vf_set1(((const float *)a[i])[j]), acc[i]);
    }
    for (int i = 0; i < R; i++) acc[i] = vf_add(acc[i], odd[i]);
}

INLINE void tile_product(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    switch (type) {
        case TYPE_F32: tile_float(tile, nb, a, R, acc, 0); break;
        case TYPE_F16: tile_float(tile, nb, a, R, acc, 1); break;
        case TYPE_Q8_0: tile_q8_0(tile, nb, a, R, acc); break;
        case TYPE_Q4_0: tile_nibbles(TYPE_Q4_0, tile, nb, a, R, acc); break;
        case TYPE_Q5_0: tile_nibbles(TYPE_Q5_0, tile, nb, a, R, acc); break;
        case TYPE_Q4_1: tile_nibbles(TYPE_Q4_1, tile, nb, a, R, acc); break;
        case TYPE_Q5_1: tile_nibbles(TYPE_Q5_1, tile, nb, a, R, acc); break;
        case TYPE_IQ4_NL: tile_nibbles(TYPE_IQ4_NL, tile, nb, a, R, acc); break;
        case TYPE_Q2_K: tile_q2_k(tile, nb, a, R, acc, 0); break;
        case TYPE_Q3_K: tile_q3_k(tile, nb, a, R, acc); break;
        case TYPE_Q4_K: tile_q4_k(tile, nb, a, R, acc, 0, 0); break;
        case TYPE_Q5_K: tile_q4_k(tile, nb, a, R, acc, 1, 0); break;
        case TYPE_Q6_K: tile_q6_k(tile, nb, a, R, acc, 0); break;
        case TYPE_IQ4_XS: tile_iq4_xs(tile, nb, a, R, acc, 0); break;
    }
}

/* The tile product for R activation rows, R a constant in each case (registers, unrolling). */
static void tile_rows_generic(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    switch (R) {
        case 1: tile_product(type, tile, nb, a, 1, acc); break;
        case 2: tile_product(type, tile, nb, a, 2, acc); break;
#if GENERIC_ROWS >= 4
        case 3: tile_product(type, tile, nb, a, 3, acc); break;
        case 4: tile_product(type, tile, nb, a, 4, acc); break;
#endif
    }
}

/* A lone row's tile of a K format whose kernel reads the tile front to back (Q2_K, Q4_K to Q6_K,
 * IQ4_XS), each block's lines asked for PF_DISTANCE ahead a few at a time as the kernel steps
 * through the block (``spread``, prefetch_share): the same products added in the same order as
 * tile_product's, so the same bits. 0, and nothing computed, for the other formats. A function
 * of its own, the prefetching kernels instantiated only here: inlined beside the products of
 * many rows, a lone row's prefetch changed how the compiler laid those out, and a prefill then
 * ran slower (bench/README.md). */
__attribute__((noinline)) static int tile_row_prefetched(int64_t type, const uint8_t *tile, int64_t nb,
                                                         const uint8_t *const *a, vf *acc) {
    switch (type) {
        case TYPE_Q2_K: tile_q2_k(tile, nb, a, 1, acc, 1); return 1;
        case TYPE_Q4_K: tile_q4_k(tile, nb, a, 1, acc, 0, 1); return 1;
        case TYPE_Q5_K: tile_q4_k(tile, nb, a, 1, acc, 1, 1); return 1;
        case TYPE_Q6_K: tile_q6_k(tile, nb, a, 1, acc, 1); return 1;
        case TYPE_IQ4_XS: tile_iq4_xs(tile, nb, a, 1, acc, 1); return 1;
        default: return 0;
    }
}

static void tile_rows(int64_t type, const uint8_t *tile, int64_t nb, const uint8_t *const *a, int R, vf *acc) {
    if (R == 1 && lone_row_prefetch && tile_row_prefetched(type, tile, nb, a, acc)) return;
#if defined(VEC_AVX2) && Q8_OFFSET == 0 /* AVX-VNNI's vpdpbusd serves the generic kernels better */
    /* One row (a lone decode) streams the whole tile once through the generic kernel (Q6_K's too:
     * since its layout 2, faster than a one-row kernel of half-tile arithmetic, bench/README.md);
     * the half tiles pay off from two rows on, where the arithmetic rather than memory bounds the speed. */
    if (has_half_tiles(type) && R >= 2) {
        if (R <= 3 && k_format(type))
            half_tile_few_rows(type, tile, nb, a, R, acc);
        else
            half_tile_rows(type, tile, nb, a, R, acc);
        return;
    }
#endif
    for (int i = 0; i < R; i += GENERIC_ROWS)
        tile_rows_generic(type, tile, nb, a + i, R - i < GENERIC_ROWS ? R - i : GENERIC_ROWS, acc + i);
}

/* Activation rows per pass over the weights: enough to keep each pass's activations in
 * this core's caches while the weights stream through. */
#define ROWS_PER_PASS 64

/* The activation row bytes a product of ``type`` reads: quantized, or float32. */
static int64_t input_row_bytes(int64_t type, int64_t k) {
    return float_format(type) ? k * (int64_t)sizeof(float) : activation_row_bytes(type, k);
}

/* Thread me of ``threads``' share (a contiguous run of tiles) of
 * out[i * out_stride + r] = (row r of W) . (activation row i) (+ bias[r]), r < m, i < n:
 * ``w`` packed (pack_matrix); ``x`` the activations as ``type`` takes them (quantized by
 * quantize_activations, or float32 rows for F32 and F16). */
static void matmul_tiles(int64_t type, const void *w, int64_t m, int64_t k, const void *x, int64_t i_pass, int64_t n,
                         int64_t first, int64_t last, float *out, int64_t out_stride, const float *bias) {
    int64_t nb = k / block_values(type), tb = tile_block_bytes(type), x_bytes = input_row_bytes(type, k);
    int64_t pass_end = i_pass + ROWS_PER_PASS < n ? i_pass + ROWS_PER_PASS : n;
    for (int64_t t = first; t < last; t++) {
        const uint8_t *tile = (const uint8_t *)w + t * nb * tb;
        int rows = m - t * TILE < TILE ? (int)(m - t * TILE) : TILE;
        for (int64_t i0 = i_pass; i0 < pass_end; i0 += ROWS_AT_ONCE) {
            int R = pass_end - i0 < ROWS_AT_ONCE ? (int)(pass_end - i0) : ROWS_AT_ONCE;
            const uint8_t *a[ROWS_AT_ONCE];
            vf acc[ROWS_AT_ONCE];
            for (int i = 0; i < R; i++) {
                a[i] = (const uint8_t *)x + (i0 + i) * x_bytes;
                acc[i] = vf_zero();
            }
            tile_rows(type, tile, nb, a, R, acc);
            for (int i = 0; i < R; i++)
                vf_store(out + (i0 + i) * out_stride + t * TILE, acc[i], bias ? bias + t * TILE : NULL, rows);
        }
    }
}

/* Bytes of weights a thread claims at a time once it helps another thread's share. */
#define CHUNK_BYTES 65536
/* Cursors of the dynamic shares: one per thread, each on its own cache line. */
#define CURSOR_STRIDE 8
#define MAX_TEAM 256

/* Thread me of ``threads``' share of out[i * out_stride + r] = (row r of W) . (activation row i)
 * (+ bias[r]), r < m, i < n: ``w`` packed (pack_matrix); ``x`` the activations as ``type`` takes
 * them (quantized by quantize_activations, or float32 rows for F32 and F16).
 *
 * Each thread starts on its contiguous share of the tiles (a sequential stream of weights), in
 * chunks of about CHUNK_BYTES claimed from its share's cursor; a thread done with its share
 * claims the rest of the others' chunks, so a thread slowed by another process (two cores, and
 * the frontend on one of them) holds the team back by one chunk, not by its lag. ``cursors``
 * (threads * CURSOR_STRIDE int64, zero, shared by the team) NULL: the contiguous shares alone.
 * Every output is computed whole by one thread: the bits never depend on who took it. */
static void matmul_share(int64_t type, const void *w, int64_t m, int64_t k, const void *x, int64_t n, float *out,
                         int64_t out_stride, const float *bias, int me, int threads, int64_t *cursors) {
    int64_t tiles = (m + TILE - 1) / TILE, strip = k / block_values(type) * tile_block_bytes(type);
    int64_t passes = (n + ROWS_PER_PASS - 1) / ROWS_PER_PASS, first, last;
    if (cursors == NULL || threads == 1) {
        team_share(tiles, me, threads, &first, &last);
        for (int64_t pass = 0; pass < passes; pass++)
            matmul_tiles(type, w, m, k, x, pass * ROWS_PER_PASS, n, first, last, out, out_stride, bias);
        return;
    }
    int64_t per_chunk = CHUNK_BYTES / strip > 1 ? CHUNK_BYTES / strip : 1;
    for (int v = 0; v < threads; v++) {
        int owner = (me + v) % threads; /* its own share first, then the others' */
        team_share(tiles, owner, threads, &first, &last);
        int64_t chunks = (last - first + per_chunk - 1) / per_chunk;
        for (;;) {
            int64_t c = __atomic_fetch_add(&cursors[owner * CURSOR_STRIDE], 1, __ATOMIC_RELAXED);
            if (c >= chunks * passes) break;
            int64_t t0 = first + c % chunks * per_chunk, t1 = t0 + per_chunk < last ? t0 + per_chunk : last;
            matmul_tiles(type, w, m, k, x, c / chunks * ROWS_PER_PASS, n, t0, t1, out, out_stride, bias);
        }
    }
}

/* Whether a product is worth a second thread (waking one costs microseconds). */
static int worth_threads(int64_t m, int64_t n, int64_t k, int64_t threads) {
    return threads > 1 && m > TILE && m * n * k >= (1 << 17);
}

/* The product above on up to ``threads`` threads. */
API void quant_matmul(int64_t type, const void *w, int64_t m, int64_t k, const void *x, int64_t n, float *out,
                      int64_t out_stride, const float *bias, int64_t threads) {
    int parallel = worth_threads(m, n, k, threads);
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    matmul_share(type, w, m, k, x, n, out, out_stride, bias, team_me(), team_size(), NULL);
}

/* Thread me's share (rows of W) of the product with float32 activations, each weight row
 * expanded to float32 first (``row`` holds k floats of this thread's). */
static void matmul_f32_share(int64_t type, const void *w, int64_t m, int64_t k, const float *x, int64_t n,
                             float *out, int64_t out_stride, const float *bias, float *row, int me, int threads) {
    int64_t begin, end;
    team_share(m, me, threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) {
        unpack_row(type, (const uint8_t *)w, k, r, row);
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * k;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < k; j++) sum += row[j] * xi[j];
            out[i * out_stride + r] = sum + (bias ? bias[r] : 0.0f);
        }
    }
}

/* ------------------------------------------------------------------ dense layers */

/* A dense layer: ``layer[0]`` parts stacked by rows (a fused q/k/v whose parts are in
 * different formats), of layer[1] columns each; part p is four int64 at layer + 2 + 4p:
 * its type, its packed data, its rows and its bias (0: none). */
typedef struct {
    int64_t type, data, rows, bias;
} layer_part;

/* The dynamic shares' cursors of a layer's parts, at the start of its scratch. */
static int64_t cursor_bytes(const int64_t *layer) {
    return layer[0] * MAX_TEAM * CURSOR_STRIDE * (int64_t)sizeof(int64_t);
}

/* Bytes of scratch linear_share needs for n rows: the cursors, each activation format's copy of
 * the rows, a row of floats. */
API int64_t linear_scratch_bytes(const int64_t *layer, int64_t n) {
    int64_t k = layer[1];
    return cursor_bytes(layer) + n * (activation_row_bytes(TYPE_Q8_0, k) + activation_row_bytes(TYPE_Q4_K, k)) +
           k * (int64_t)sizeof(float);
}

/* What rows the parts of ``layer`` read: bit 0 the 32-value activation format, bit 1 the K
 * format (quantize_share of TYPE_Q8_0, TYPE_Q4_K), bit 2 float32. */
int64_t layer_inputs(const int64_t *layer) {
    const layer_part *parts = (const layer_part *)(layer + 2);
    int64_t inputs = 0;
    for (int64_t p = 0; p < layer[0]; p++)
        inputs |= float_format(parts[p].type) ? 4 : (int64_t)1 << k_format(parts[p].type);
    return inputs;
}

/* Thread me of ``threads``' share (tiles of each part) of out[i * out_stride + column] =
 * layer(row i), i < n: ``x`` the rows as float32, ``xq`` as each activation format layer_inputs
 * names (already quantized). ``quantize`` 0: each weight row expanded to float32 instead
 * (``row``: k floats of this thread's). ``cursors``: the parts' dynamic shares (matmul_share),
 * threads * CURSOR_STRIDE each, zero; NULL: contiguous shares. */
void layer_rows_share(const int64_t *layer, const float *x, uint8_t *const xq[2], int64_t n, float *out,
                      int64_t out_stride, int64_t quantize, float *row, int me, int threads, int64_t *cursors) {
    const layer_part *parts = (const layer_part *)(layer + 2);
    int64_t k = layer[1], column = 0;
    for (int64_t p = 0; p < layer[0]; p++) {
        const layer_part *part = &parts[p];
        const void *w = (const void *)(intptr_t)part->data;
        const float *bias = part->bias ? (const float *)(intptr_t)part->bias : NULL;
        int64_t *part_cursors = cursors ? cursors + p * threads * CURSOR_STRIDE : NULL;
        if (float_format(part->type))
            matmul_share(part->type, w, part->rows, k, x, n, out + column, out_stride, bias, me, threads, part_cursors);
        else if (quantize)
            matmul_share(part->type, w, part->rows, k, xq[k_format(part->type)], n, out + column, out_stride, bias,
                         me, threads, part_cursors);
        else
            matmul_f32_share(part->type, w, part->rows, k, x, n, out + column, out_stride, bias, row, me, threads);
        column += part->rows;
    }
}

/* Thread me of ``threads``' share of out[i * out_stride + column] = layer(x row i), i < n
 * (x float32, C-contiguous): each activation format the parts need quantized once into
 * ``scratch`` (linear_scratch_bytes of it, shared by the team; then a barrier), the
 * parts' tiles shared among the threads. ``quantize`` 0: activations left in float32,
 * each weight row expanded instead (the test-only reference product; the team's threads
 * then need a row of k floats each, past the shared scratch: use one thread). */
void linear_share(const int64_t *layer, const float *x, int64_t n, float *out, int64_t out_stride,
                  int64_t quantize, uint8_t *scratch, team_barrier *barrier, int me, int threads) {
    int64_t k = layer[1], inputs = quantize ? layer_inputs(layer) : 0;
    int64_t *cursors = threads > 1 && threads <= MAX_TEAM ? (int64_t *)scratch : NULL;
    uint8_t *rows = scratch + cursor_bytes(layer);
    uint8_t *xq[2] = {rows, rows + n * activation_row_bytes(TYPE_Q8_0, k)}; /* 32-value, K formats */
    if (cursors != NULL && me == 0) /* the previous operation is over (a barrier): nobody reads them now */
        memset(cursors, 0, (size_t)(layer[0] * threads * CURSOR_STRIDE) * sizeof(int64_t));
    for (int f = 0; f < 2; f++)
        if (inputs >> f & 1) quantize_share(f ? TYPE_Q4_K : TYPE_Q8_0, x, n, k, xq[f], me, threads);
    team_sync(barrier, threads); /* the rows quantized, the cursors zeroed */
    layer_rows_share(layer, x, xq, n, out, out_stride, quantize,
                     (float *)(scratch + linear_scratch_bytes(layer, n) - k * (int64_t)sizeof(float)), me, threads,
                     cursors);
}

/* The dense layer above, on its own: scratch from this thread's growing buffer, and up to
 * ``threads`` threads where the product is large enough. */
API void quant_linear(const int64_t *layer, const float *x, int64_t n, float *out, int64_t out_stride,
                      int64_t quantize, int64_t threads) {
    static __thread uint8_t *scratch;
    static __thread size_t scratch_size;
    size_t need = (size_t)linear_scratch_bytes(layer, n);
    if (need > scratch_size) {
        free(scratch);
        scratch = malloc(need);
        scratch_size = scratch ? need : 0;
        if (!scratch) return; /* out of memory: nothing to compute with */
    }
    int64_t rows = 0;
    for (int64_t p = 0; p < layer[0]; p++) rows += layer[2 + 4 * p + 2];
    team_barrier barrier = {0, 0};
    uint8_t *shared = scratch; /* the team's view of this thread's buffer (each thread has its own ``scratch``) */
    int parallel = quantize && worth_threads(rows, n, layer[1], threads);
    (void)parallel;
#pragma omp parallel num_threads(threads) if (parallel)
    linear_share(layer, x, n, out, out_stride, quantize, shared, &barrier, team_me(), team_size());
}
