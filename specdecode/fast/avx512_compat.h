/*
 * specdecode/fast/avx512_compat.h -- the AVX512 kernels on CPUs without (all of) AVX512.
 *
 * Included by kernels.c before any kernel. The kernels are written with AVX512F/BW/VL, BF16
 * and VNNI intrinsics. Where the compiler's -march=native lacks some of these (AVX2-only CPUs
 * such as AMD Zen 2/3 or Intel client parts; AVX512 parts without BF16 or VNNI), the missing
 * intrinsics map to SIMDe (SIMD Everywhere, MIT; Debian's libsimde-dev), which computes each
 * 512-bit operation with the same lane semantics from what the CPU has (two 256-bit halves on
 * AVX2), and the few SIMDe 0.7 lacks are defined here the same way. A CPU with all of them
 * includes nothing. The instruction sequence per output row does not depend on the row count on
 * any of these paths, so batch (row) invariance holds everywhere.
 */
#ifndef SD_AVX512_COMPAT_H
#define SD_AVX512_COMPAT_H
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512BF16__) || !defined(__AVX512VNNI__)
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "specdecode kernels need AVX2 + FMA + F16C at least"
#endif
#define SD_EMULATED 1          /* some intrinsics are emulated (sd_isa_level() reports it) */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

typedef union { simde__m512 v; __m256 h[2]; float f[16]; } sd_ps512;
typedef union { simde__m512i v; __m256i h[2]; int32_t i[16]; } sd_si512;

static inline simde__m512 sd_ps(__m256 lo, __m256 hi) { sd_ps512 r; r.h[0] = lo; r.h[1] = hi; return r.v; }
static inline simde__m512i sd_si(__m256i lo, __m256i hi) { sd_si512 r; r.h[0] = lo; r.h[1] = hi; return r.v; }
static inline __m256 sd_lo(simde__m512 v) { sd_ps512 r; r.v = v; return r.h[0]; }
static inline __m256 sd_hi(simde__m512 v) { sd_ps512 r; r.v = v; return r.h[1]; }
static inline __m256i sd_ilo(simde__m512i v) { sd_si512 r; r.v = v; return r.h[0]; }
static inline __m256i sd_ihi(simde__m512i v) { sd_si512 r; r.v = v; return r.h[1]; }

/* lanes i < 8 / i >= 8 of a 16-bit mask as AVX2 vector masks (all ones where the bit is set) */
static inline __m256i sd_mask_lo(uint16_t k) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(k & 0xff), bit), bit);
}
static inline __m256i sd_mask_hi(uint16_t k) { return sd_mask_lo((uint16_t)(k >> 8)); }

static inline simde__m512i sd_cvtepu16_epi32(__m256i v) {
    return sd_si(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)));
}
static inline simde__m512i sd_cvtepu8_epi32(__m128i v) {
    return sd_si(_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
}
static inline simde__m512i sd_cvtepi8_epi32(__m128i v) {
    return sd_si(_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
static inline simde__m512 sd_cvtepi32_ps(simde__m512i v) {
    return sd_ps(_mm256_cvtepi32_ps(sd_ilo(v)), _mm256_cvtepi32_ps(sd_ihi(v)));
}
static inline simde__m512i sd_cvtps_epi32(simde__m512 v) {      /* current rounding mode: nearest even */
    return sd_si(_mm256_cvtps_epi32(sd_lo(v)), _mm256_cvtps_epi32(sd_hi(v)));
}
static inline simde__m512 sd_cvtph_ps(__m256i v) {
    return sd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(v)), _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)));
}

/* fp32 -> bf16, round to nearest even (NaN stays NaN), 8 lanes as the low 16 bits of 32 */
static inline __m256i sd_bf16_round8(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}
static inline simde__m256bh sd_cvtneps_pbh(simde__m512 v) {
    __m256i packed = _mm256_packus_epi32(sd_bf16_round8(sd_lo(v)), sd_bf16_round8(sd_hi(v)));
    packed = _mm256_permute4x64_epi64(packed, 0xd8);               /* undo packus' lane interleave */
    simde__m256bh out;
    memcpy(&out, &packed, sizeof out);
    return out;
}

static inline simde__m512 sd_maskz_loadu_ps(uint16_t k, const void *p) {
    const float *f = (const float *)p;
    return sd_ps(_mm256_maskload_ps(f, sd_mask_lo(k)), _mm256_maskload_ps(f + 8, sd_mask_hi(k)));
}
static inline void sd_mask_storeu_ps(void *p, uint16_t k, simde__m512 v) {
    float *f = (float *)p;
    _mm256_maskstore_ps(f, sd_mask_lo(k), sd_lo(v));
    _mm256_maskstore_ps(f + 8, sd_mask_hi(k), sd_hi(v));
}
static inline __m256i sd_maskz_loadu_epi16(uint16_t k, const void *p) {
    uint16_t tmp[16] = {0};
    const uint16_t *s = (const uint16_t *)p;
    for (int i = 0; i < 16; i++) if (k >> i & 1) tmp[i] = s[i];
    return _mm256_loadu_si256((const __m256i *)tmp);
}
static inline void sd_mask_storeu_epi16(void *p, uint16_t k, __m256i v) {
    uint16_t tmp[16];
    uint16_t *d = (uint16_t *)p;
    _mm256_storeu_si256((__m256i *)tmp, v);
    for (int i = 0; i < 16; i++) if (k >> i & 1) d[i] = tmp[i];
}

static inline float sd_hsum8(__m256 v) {          /* ((0+4)+(2+6)) + ((1+5)+(3+7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float sd_reduce_add_ps(simde__m512 v) { return sd_hsum8(_mm256_add_ps(sd_lo(v), sd_hi(v))); }
static inline float sd_reduce_max_ps(simde__m512 v) {
    __m256 m = _mm256_max_ps(sd_lo(v), sd_hi(v));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline int sd_reduce_add_epi32(simde__m512i v) {
    __m256i s8 = _mm256_add_epi32(sd_ilo(v), sd_ihi(v));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The two hot products, on 256-bit halves (SIMDe 0.7 computes them lane by lane in scalar code). */

/* VPDPBUSD: src + sum of the 4 products u8 * s8 in each 32-bit lane, exact. VPMADDUBSW saturates
 * a pair sum only if it exceeds 32767, impossible while every u8 < 128 (the 4/5/6-bit formats);
 * when some byte has its top bit set (8-bit formats) u is split as (u & 127) + 128 * (u >> 7). */
static inline __m256i sd_dpbusd8(__m256i src, __m256i u, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (!_mm256_movemask_epi8(u))
        return _mm256_add_epi32(src, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
    const __m256i low = _mm256_and_si256(u, _mm256_set1_epi8(0x7f));
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(u, 7), _mm256_set1_epi8(1));
    __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(low, x), ones);
    sum = _mm256_add_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(top, x), ones), 7));
    return _mm256_add_epi32(src, sum);
}
static inline simde__m512i sd_dpbusd_epi32(simde__m512i src, simde__m512i u, simde__m512i x) {
    return sd_si(sd_dpbusd8(sd_ilo(src), sd_ilo(u), sd_ilo(x)), sd_dpbusd8(sd_ihi(src), sd_ihi(u), sd_ihi(x)));
}

/* VDPBF16PS: src + a0 * b0 + a1 * b1 per 32-bit lane of bf16 pairs (exact products; two fused
 * adds in a fixed order: the same for every row). */
static inline __m256 sd_dpbf16_8(__m256 src, __m256i a, __m256i b) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), a1 = _mm256_castsi256_ps(_mm256_and_si256(a, high));
    const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), b1 = _mm256_castsi256_ps(_mm256_and_si256(b, high));
    return _mm256_fmadd_ps(a1, b1, _mm256_fmadd_ps(a0, b0, src));
}
static inline simde__m512 sd_dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
    sd_si512 av, bv;
    memcpy(&av, &a, sizeof av);
    memcpy(&bv, &b, sizeof bv);
    return sd_ps(sd_dpbf16_8(sd_lo(src), av.h[0], bv.h[0]), sd_dpbf16_8(sd_hi(src), av.h[1], bv.h[1]));
}

#if !defined(__AVX512VNNI__)
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 sd_dpbusd_epi32
#endif
#if !defined(__AVX512BF16__)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps sd_dpbf16_ps
#endif
#if !defined(__AVX512F__)
#define _mm512_cvtepu16_epi32 sd_cvtepu16_epi32
#define _mm512_cvtepu8_epi32 sd_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 sd_cvtepi8_epi32
#define _mm512_cvtepi32_ps sd_cvtepi32_ps
#define _mm512_cvtps_epi32 sd_cvtps_epi32
#define _mm512_cvtph_ps sd_cvtph_ps
#define _mm512_maskz_loadu_ps sd_maskz_loadu_ps
#define _mm512_maskz_load_ps sd_maskz_loadu_ps
#define _mm512_mask_storeu_ps sd_mask_storeu_ps
#define _mm512_reduce_add_ps sd_reduce_add_ps
#define _mm512_reduce_max_ps sd_reduce_max_ps
#define _mm512_reduce_add_epi32 sd_reduce_add_epi32
#define _mm512_shuffle_i64x2 simde_mm512_shuffle_i64x2
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4
#endif
#if !defined(__AVX512BW__) || !defined(__AVX512VL__)
#define _mm256_maskz_loadu_epi16 sd_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 sd_mask_storeu_epi16
#endif
#if !defined(__AVX512BW__)
#define _cvtu64_mask64(x) ((simde__mmask64)(x))
#endif
#if !defined(__AVX512BF16__)
#define _mm512_cvtneps_pbh sd_cvtneps_pbh
#endif
#endif  /* some AVX512 feature missing */

/* 2: every intrinsic native (AVX512F/BW/VL + BF16 + VNNI); 1: some emulated (see above). */
static inline int sd_isa_level(void) {
#ifdef SD_EMULATED
    return 1;
#else
    return 2;
#endif
}
#endif
