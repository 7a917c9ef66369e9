/*
 * specdecode/fast/kernels.c -- small-M GEMM ("GEMV with a few rows") for x86-64.
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),   M small (1..16 typical), fp32 accumulate.
 *
 * Weights are repacked once at load time into groups of 32 output columns, so each thread
 * streams its share of the weights exactly once per call, as ONE sequential run:
 *   bf16:  Wp[Np/32][Kp/32][2][16][32]  -- per (group, 32-k block): two 1 KB AMX B-tiles, each
 *          16 rows (k pairs) x 16 columns x 2 (VNNI pair)     (Np % 32 == 0, Kp % 32 == 0)
 *   fp32:  Wp[Np/32][K][32]
 *
 * bf16 kernels:  AMX (TDPBF16PS, 16x16x32 tiles) when available, else AVX512-BF16 (VDPBF16PS).
 * fp32 kernel:   AVX512F FMA.
 * Products bf16*bf16 are exact in fp32, so results equal an fp32-accumulated matmul up to the
 * order of the fp32 summation.  Output is written in fp32 or bf16 (round-to-nearest-even).
 * Threads: OpenMP, output column blocks split evenly between threads.
 * No torch headers: called through ctypes on raw pointers.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "avx512_compat.h"   /* no AVX512: the same kernels on AVX2 through SIMDe */
#include <unistd.h>
#include <sys/syscall.h>
#include <omp.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef uint16_t bf16;

/* 2: built with every AVX512 feature the kernels use; 1: some emulated (avx512_compat.h). */
int sd_isa(void) { return sd_isa_level(); }

/* Ask the Linux kernel for permission to use AMX tile data (process-wide). 0 on success. */
int sd_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

#ifndef SD_PREFETCH
#define SD_PREFETCH 16384  /* software prefetch distance in bytes (0 = off) */
#endif

/* Software prefetch of the weight stream, one instruction per 64-byte line in the AVX512 kernels.
 * With several rows the kernel spends more cycles per weight line, the hardware prefetcher alone
 * keeps too few lines in flight and DRAM bandwidth halves (measured on Zen: 8 rows at 12.7 GB/s
 * per core without, 30 GB/s with; 1 row: 37 GB/s either way).  Inline asm, because gcc 12 dropped
 * _mm_prefetch from these loops. */
static inline void prefetch(const void *p) {
#if SD_PREFETCH
    __asm__ volatile("prefetcht0 %0" : : "m"(*((const char *)p + SD_PREFETCH)));
#else
    (void)p;
#endif
}

/* ---------------------------------------------------------------- packing */

/* W[N, K] bf16 row-major -> Wp[Np/32][Kp/32][2][16][32], zero padded. */
void sd_pack_bf16(const bf16 *W, bf16 *Wp, int N, int K, int Np, int Kp) {
    size_t i = 0;
    for (int g = 0; g < Np / 32; g++)
        for (int kb = 0; kb < Kp / 32; kb++)
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < 16; p++)           /* k pair within the block */
                    for (int j = 0; j < 32; j++, i++) { /* column (j/2), pair member (j%2) */
                        int n = g * 32 + h * 16 + j / 2, k = kb * 32 + 2 * p + j % 2;
                        Wp[i] = (n < N && k < K) ? W[(size_t)n * K + k] : 0;
                    }
}

/* W[N, K] fp32 row-major -> Wp[Np/32][K][32], zero padded. */
void sd_pack_fp32(const float *W, float *Wp, int N, int K, int Np) {
    size_t i = 0;
    for (int g = 0; g < Np / 32; g++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < 32; j++, i++) {
                int n = g * 32 + j;
                Wp[i] = n < N ? W[(size_t)n * K + k] : 0.f;
            }
}

/* ---------------------------------------------------------------- shared helpers */

/* Output modes of the store epilogue (the fused decoder uses 2..4). */
enum { OUT_F32 = 0,        /* y fp32 = acc + bias                                */
       OUT_BF16 = 1,       /* y bf16 = rne(acc + bias)                           */
       OUT_F32_VIA_BF16 = 2, /* y fp32 = (float) rne_bf16(acc + bias)            */
       OUT_BF16_ADD = 3,   /* y bf16 = rne(y + rne(acc + bias))   (residual add) */
       OUT_F32_ADD = 4 };  /* y fp32 = y + (acc + bias)           (residual add) */

static inline __m512 bf16x16_to_ps(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline __m512 round_bf16(__m512 v) { return bf16x16_to_ps((__m256i)_mm512_cvtneps_pbh(v)); }

/* Write acc[rows][16] (row stride 16 floats) + bias to y columns n0..n0+15 (clipped to N). */
static inline void store_block(const float *acc, int rows, int n0, int N, const float *bias,
                               void *y, int ldy, int mode) {
    if (n0 >= N) return;
    int cnt = N - n0 < 16 ? N - n0 : 16;
    __mmask16 mk = (__mmask16)((1u << cnt) - 1);
    __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + 16 * m), b);
        bf16 *yb = (bf16 *)y + (size_t)m * ldy + n0;
        float *yf = (float *)y + (size_t)m * ldy + n0;
        switch (mode) {
        case OUT_BF16:
            _mm256_mask_storeu_epi16(yb, mk, (__m256i)_mm512_cvtneps_pbh(v));
            break;
        case OUT_F32_VIA_BF16:
            _mm512_mask_storeu_ps(yf, mk, round_bf16(v));
            break;
        case OUT_BF16_ADD: {
            __m512 h = bf16x16_to_ps(_mm256_maskz_loadu_epi16(mk, yb));
            _mm256_mask_storeu_epi16(yb, mk, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(h, round_bf16(v))));
            break;
        }
        case OUT_F32_ADD:
            _mm512_mask_storeu_ps(yf, mk, _mm512_add_ps(_mm512_maskz_loadu_ps(mk, yf), v));
            break;
        default:
            _mm512_mask_storeu_ps(yf, mk, v);
        }
    }
}

static inline int out_esz(int mode) { return (mode == OUT_BF16 || mode == OUT_BF16_ADD) ? 2 : 4; }

/* Column groups [g0, g1) of G owned by thread t of nt. */
static inline void split(int G, int t, int nt, int *g0, int *g1) {
    *g0 = (int)((long)G * t / nt);
    *g1 = (int)((long)G * (t + 1) / nt);
}

/* ---------------------------------------------------------------- AMX bf16 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

/* tmm0,1: C (rows x 16 fp32)   tmm2: A (rows x 32 bf16)   tmm3..6: B (16 k-pairs x 16 cols) */
static void amx_config(int rows) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 3; i++) { c.rows[i] = (uint8_t)rows; c.colsb[i] = 64; }
    for (int i = 3; i < 7; i++) { c.rows[i] = 16; c.colsb[i] = 64; }
    __asm__ volatile("" : : "r"(&c) : "memory");   /* see qamx_config (quant16_amx.c) */
    _tile_loadconfig(&c);
}

/* One thread's share: column groups [g0, g1), all M rows (chunks of 16 rows inside each group,
 * so a prefill block re-reads a 32-column group from L1/L2, not from memory).  Every output row
 * is computed by the same tile sequence whatever M is: row results do not depend on M.
 * *cfg_rows caches the current tile configuration (-1 = none); call _tile_release() after. */
static void amx_part(const bf16 *x, int lda, const bf16 *Wp, const float *bias, void *y, int ldy,
                     int M, int N, int Kp, int mode, int g0, int g1, int *cfg_rows) {
    const int KB = Kp / 32;
    const size_t gstride = (size_t)Kp * 32;              /* elements per column group */
    const int esz = out_esz(mode);
    float acc[2][16 * 16] __attribute__((aligned(64)));
    for (int g = g0; g < g1; g++) {
        for (int m0 = 0; m0 < M; m0 += 16) {
            const int rows = M - m0 < 16 ? M - m0 : 16;
            const bf16 *xm = x + (size_t)m0 * lda;
            char *ym = (char *)y + (size_t)m0 * ldy * esz;
            if (*cfg_rows != rows) { amx_config(rows); *cfg_rows = rows; }
            const bf16 *w = Wp + g * gstride;
            _tile_zero(0);
            _tile_zero(1);
            int kb = 0;
            for (; kb + 2 <= KB; kb += 2, w += 2048) { /* 2 k-blocks = 4 KB of weights */
                prefetch(w); prefetch(w + 512); prefetch(w + 1024); prefetch(w + 1536);
                _tile_loadd(2, xm + kb * 32, lda * 2);
                _tile_loadd(3, w, 64);
                _tile_loadd(4, w + 512, 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
                _tile_loadd(2, xm + kb * 32 + 32, lda * 2);
                _tile_loadd(5, w + 1024, 64);
                _tile_loadd(6, w + 1536, 64);
                _tile_dpbf16ps(0, 2, 5);
                _tile_dpbf16ps(1, 2, 6);
            }
            if (kb < KB) {
                _tile_loadd(2, xm + kb * 32, lda * 2);
                _tile_loadd(3, w, 64);
                _tile_loadd(4, w + 512, 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
            store_block(acc[0], rows, g * 32, N, bias, ym, ldy, mode);
            store_block(acc[1], rows, g * 32 + 16, N, bias, ym, ldy, mode);
        }
    }
}

/* y[M, N] = x[M, Kp] @ W^T + bias.  x bf16 with row stride lda (elements), y fp32 or bf16
 * with row stride ldy.  Any M (processed in chunks of 16 rows). */
void sd_linear_bf16_amx(const bf16 *x, int lda, const bf16 *Wp, const float *bias, void *y,
                        int ldy, int M, int N, int Kp, int out_bf16, int nthreads) {
    const int G = (N + 31) / 32;
#pragma omp parallel num_threads(nthreads)
    {
        int g0, g1, cfg = -1;
        split(G, omp_get_thread_num(), omp_get_num_threads(), &g0, &g1);
        amx_part(x, lda, Wp, bias, y, ldy, M, N, Kp, out_bf16 ? OUT_BF16 : OUT_F32, g0, g1, &cfg);
        _tile_release();
    }
}

/* ---------------------------------------------------------------- AVX512-BF16 */

#if !defined(__AVX512F__)
/* AVX2: the same per-lane arithmetic on four 8-column vectors (lanes = columns, k pairs in the
 * same order, c = fma(w1, x1, fma(w0, x0, c)) per pair), two rows at a time (16 registers). */
static inline __attribute__((always_inline)) void
dpbf16_group(const bf16 *x, int lda, const bf16 *w0, int KB, int MR, float *acc /*[MR][32]*/) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int m0 = 0; m0 < MR; m0 += 2) {
        const int rows = MR - m0 < 2 ? MR - m0 : 2;
        __m256 c[2][4];
        for (int m = 0; m < 2; m++) for (int i = 0; i < 4; i++) c[m][i] = _mm256_setzero_ps();
        const bf16 *w = w0;
        for (int kb = 0; kb < KB; kb++, w += 1024) {
            for (int p = 0; p < 16; p++) {
                prefetch(w + 32 * p); prefetch(w + 512 + 32 * p);
                __m256i wv[4] = {_mm256_loadu_si256((const __m256i *)(w + 32 * p)),
                                 _mm256_loadu_si256((const __m256i *)(w + 32 * p + 16)),
                                 _mm256_loadu_si256((const __m256i *)(w + 512 + 32 * p)),
                                 _mm256_loadu_si256((const __m256i *)(w + 512 + 32 * p + 16))};
                __m256 wlo[4], whi[4];
                for (int i = 0; i < 4; i++) {
                    wlo[i] = _mm256_castsi256_ps(_mm256_slli_epi32(wv[i], 16));
                    whi[i] = _mm256_castsi256_ps(_mm256_and_si256(wv[i], high));
                }
                for (int m = 0; m < rows; m++) {
                    uint32_t pair;
                    memcpy(&pair, x + (size_t)(m0 + m) * lda + kb * 32 + 2 * p, 4);
                    const __m256 x0 = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair << 16)));
                    const __m256 x1 = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair & 0xffff0000u)));
                    for (int i = 0; i < 4; i++) c[m][i] = _mm256_fmadd_ps(whi[i], x1, _mm256_fmadd_ps(wlo[i], x0, c[m][i]));
                }
            }
        }
        for (int m = 0; m < rows; m++)
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + 32 * (m0 + m) + 8 * i, c[m][i]);
    }
}
#else
/* MR rows x 32 columns of one column group; MR is a compile-time constant after inlining.
 * Each row has its own accumulators and the same k order for any MR: batch invariant. */
static inline __attribute__((always_inline)) void
dpbf16_group(const bf16 *x, int lda, const bf16 *w, int KB, int MR, float *acc /*[MR][32]*/) {
    __m512 c0[8], c1[8];
    for (int m = 0; m < MR; m++) { c0[m] = _mm512_setzero_ps(); c1[m] = _mm512_setzero_ps(); }
    for (int kb = 0; kb < KB; kb++, w += 1024) {
        for (int p = 0; p < 16; p++) {
            prefetch(w + 32 * p); prefetch(w + 512 + 32 * p);     /* every line: see prefetch() */
            __m512bh a = (__m512bh)_mm512_loadu_si512(w + 32 * p);
            __m512bh b = (__m512bh)_mm512_loadu_si512(w + 512 + 32 * p);
            for (int m = 0; m < MR; m++) {
                uint32_t pair;
                memcpy(&pair, x + (size_t)m * lda + kb * 32 + 2 * p, 4);
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
                c0[m] = _mm512_dpbf16_ps(c0[m], a, xb);
                c1[m] = _mm512_dpbf16_ps(c1[m], b, xb);
            }
        }
    }
    for (int m = 0; m < MR; m++) {
        _mm512_storeu_ps(acc + 32 * m, c0[m]);
        _mm512_storeu_ps(acc + 32 * m + 16, c1[m]);
    }
}

#endif

static void avx512bf16_part(const bf16 *x, int lda, const bf16 *Wp, const float *bias, void *y,
                            int ldy, int M, int N, int Kp, int mode, int g0, int g1) {
    const int KB = Kp / 32;
    const size_t gstride = (size_t)Kp * 32;
    const int esz = out_esz(mode);
    float acc[8 * 32] __attribute__((aligned(64)));
    for (int g = g0; g < g1; g++) {
        const bf16 *w = Wp + g * gstride;
        for (int m0 = 0; m0 < M; m0 += 8) {           /* >8 rows: re-read group from L2 */
            int mr = M - m0 < 8 ? M - m0 : 8;
            const bf16 *xm = x + (size_t)m0 * lda;
            switch (mr) {
            case 1: dpbf16_group(xm, lda, w, KB, 1, acc); break;
            case 2: dpbf16_group(xm, lda, w, KB, 2, acc); break;
            case 3: dpbf16_group(xm, lda, w, KB, 3, acc); break;
            case 4: dpbf16_group(xm, lda, w, KB, 4, acc); break;
            case 5: dpbf16_group(xm, lda, w, KB, 5, acc); break;
            case 6: dpbf16_group(xm, lda, w, KB, 6, acc); break;
            case 7: dpbf16_group(xm, lda, w, KB, 7, acc); break;
            default: dpbf16_group(xm, lda, w, KB, 8, acc); break;
            }
            char *ym = (char *)y + (size_t)m0 * ldy * esz;
            for (int h = 0; h < 2; h++) {
                float tmp[8 * 16] __attribute__((aligned(64)));
                for (int m = 0; m < mr; m++) memcpy(tmp + 16 * m, acc + 32 * m + 16 * h, 64);
                store_block(tmp, mr, g * 32 + 16 * h, N, bias, ym, ldy, mode);
            }
        }
    }
}

void sd_linear_bf16_avx512(const bf16 *x, int lda, const bf16 *Wp, const float *bias, void *y,
                           int ldy, int M, int N, int Kp, int out_bf16, int nthreads) {
    const int G = (N + 31) / 32;
#pragma omp parallel num_threads(nthreads)
    {
        int g0, g1;
        split(G, omp_get_thread_num(), omp_get_num_threads(), &g0, &g1);
        avx512bf16_part(x, lda, Wp, bias, y, ldy, M, N, Kp, out_bf16 ? OUT_BF16 : OUT_F32, g0, g1);
    }
}

/* ---------------------------------------------------------------- AVX512F fp32 */

#if !defined(__AVX512F__)
/* AVX2: four 8-column vectors per row (the AVX512 lanes, same k order), two rows at a time. */
static inline __attribute__((always_inline)) void
fma_group(const float *x, int lda, const float *w0, int K, int MR, float *acc /*[MR][32]*/) {
    for (int m0 = 0; m0 < MR; m0 += 2) {
        const int rows = MR - m0 < 2 ? MR - m0 : 2;
        __m256 c[2][4];
        for (int m = 0; m < 2; m++) for (int i = 0; i < 4; i++) c[m][i] = _mm256_setzero_ps();
        const float *w = w0;
        for (int k = 0; k < K; k++, w += 32) {
            prefetch(w); prefetch(w + 16);
            const __m256 a0 = _mm256_loadu_ps(w), a1 = _mm256_loadu_ps(w + 8);
            const __m256 a2 = _mm256_loadu_ps(w + 16), a3 = _mm256_loadu_ps(w + 24);
            for (int m = 0; m < rows; m++) {
                const __m256 xb = _mm256_set1_ps(x[(size_t)(m0 + m) * lda + k]);
                c[m][0] = _mm256_fmadd_ps(a0, xb, c[m][0]);
                c[m][1] = _mm256_fmadd_ps(a1, xb, c[m][1]);
                c[m][2] = _mm256_fmadd_ps(a2, xb, c[m][2]);
                c[m][3] = _mm256_fmadd_ps(a3, xb, c[m][3]);
            }
        }
        for (int m = 0; m < rows; m++)
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(acc + 32 * (m0 + m) + 8 * i, c[m][i]);
    }
}
#else
static inline __attribute__((always_inline)) void
fma_group(const float *x, int lda, const float *w, int K, int MR, float *acc /*[MR][32]*/) {
    __m512 c0[8], c1[8];
    for (int m = 0; m < MR; m++) { c0[m] = _mm512_setzero_ps(); c1[m] = _mm512_setzero_ps(); }
    for (int k = 0; k < K; k++, w += 32) {
        prefetch(w); prefetch(w + 16);
        __m512 a = _mm512_loadu_ps(w), b = _mm512_loadu_ps(w + 16);
        for (int m = 0; m < MR; m++) {
            __m512 xb = _mm512_set1_ps(x[(size_t)m * lda + k]);
            c0[m] = _mm512_fmadd_ps(a, xb, c0[m]);
            c1[m] = _mm512_fmadd_ps(b, xb, c1[m]);
        }
    }
    for (int m = 0; m < MR; m++) {
        _mm512_storeu_ps(acc + 32 * m, c0[m]);
        _mm512_storeu_ps(acc + 32 * m + 16, c1[m]);
    }
}

#endif

static void fp32_part(const float *x, int lda, const float *Wp, const float *bias, float *y,
                      int ldy, int M, int N, int K, int mode, int g0, int g1) {
    const size_t gstride = (size_t)K * 32;
    float acc[8 * 32] __attribute__((aligned(64)));
    for (int g = g0; g < g1; g++) {
        const float *w = Wp + g * gstride;
        for (int m0 = 0; m0 < M; m0 += 8) {
            int mr = M - m0 < 8 ? M - m0 : 8;
            const float *xm = x + (size_t)m0 * lda;
            switch (mr) {
            case 1: fma_group(xm, lda, w, K, 1, acc); break;
            case 2: fma_group(xm, lda, w, K, 2, acc); break;
            case 3: fma_group(xm, lda, w, K, 3, acc); break;
            case 4: fma_group(xm, lda, w, K, 4, acc); break;
            case 5: fma_group(xm, lda, w, K, 5, acc); break;
            case 6: fma_group(xm, lda, w, K, 6, acc); break;
            case 7: fma_group(xm, lda, w, K, 7, acc); break;
            default: fma_group(xm, lda, w, K, 8, acc); break;
            }
            for (int h = 0; h < 2; h++) {
                float tmp[8 * 16] __attribute__((aligned(64)));
                for (int m = 0; m < mr; m++) memcpy(tmp + 16 * m, acc + 32 * m + 16 * h, 64);
                store_block(tmp, mr, g * 32 + 16 * h, N, bias, y + (size_t)m0 * ldy, ldy, mode);
            }
        }
    }
}

/* y[M, N] = x[M, K] @ W^T + bias, all fp32. */
void sd_linear_fp32(const float *x, int lda, const float *Wp, const float *bias, float *y,
                    int ldy, int M, int N, int K, int nthreads) {
    const int G = (N + 31) / 32;
#pragma omp parallel num_threads(nthreads)
    {
        int g0, g1;
        split(G, omp_get_thread_num(), omp_get_num_threads(), &g0, &g1);
        fp32_part(x, lda, Wp, bias, y, ldy, M, N, K, OUT_F32, g0, g1);
    }
}

/* ---------------------------------------------------------------- bandwidth probe */

/* Stream-read n floats with nthreads threads (benchmark roofline; returns a checksum). */
float sd_read_bw(const float *p, size_t n, int nthreads) {
    float total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        size_t a = n * t / T / 64 * 64, b = n * (t + 1) / T / 64 * 64;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (size_t i = a; i < b; i += 64) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    }
    return total;
}

/* ---------------------------------------------------------------- top-k of logits */

/* Indices of the k largest values of each of `rows` rows of n floats, best first (a tie keeps the
 * lower index first; NaN is never chosen; -1 where a row has fewer than k values above -inf).
 * A drafter that learns from the target's top-k (token recycling) reads it every step: torch.topk
 * over a 49k vocabulary costs ~50-90 us, this scan ~5 (16 lanes compared with the current k-th
 * best, the rare lane above it inserted). k <= 64. */
void sd_topk_f32(const float *x, int rows, int n, int k, int64_t *out) {
    float val[64];
    int64_t idx[64];
    for (int r = 0; r < rows; r++) {
        const float *row = x + (size_t)r * n;
        for (int j = 0; j < k; j++) { val[j] = -INFINITY; idx[j] = -1; }
        float thr = -INFINITY;
        int i = 0;
        for (; i + 16 <= n; i += 16) {
            __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), _mm512_set1_ps(thr), _CMP_GT_OQ);
            while (m) {
                int l = __builtin_ctz(m);
                m &= m - 1;
                float v = row[i + l];
                if (!(v > thr)) continue;
                int j = k - 1;
                while (j > 0 && v > val[j - 1]) { val[j] = val[j - 1]; idx[j] = idx[j - 1]; j--; }
                val[j] = v; idx[j] = i + l;
                thr = val[k - 1];
            }
        }
        for (; i < n; i++) {
            float v = row[i];
            if (!(v > thr)) continue;
            int j = k - 1;
            while (j > 0 && v > val[j - 1]) { val[j] = val[j - 1]; idx[j] = idx[j - 1]; j--; }
            val[j] = v; idx[j] = i;
            thr = val[k - 1];
        }
        memcpy(out + (size_t)r * k, idx, (size_t)k * sizeof(int64_t));
    }
}

/* ---------------------------------------------------------------- GGUF-quantized weights */
#include "quant.c"

/* ---------------------------------------------------------------- fused decoder */
#include "decoder.c"

/* ---------------------------------------------------------------- Gated DeltaNet token mixing */
#include "deltanet.c"

/* ---------------------------------------------------------------- row ops around native projections */
#include "rowops.c"

/* ---------------------------------------------------------------- Qwen3.5 stack in one call */
#include "hybrid.c"
