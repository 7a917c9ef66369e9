/*
 * specdecode/fast/quant.c -- matmuls on GGUF-quantized weights as stored (included by kernels.c).
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T (+ bias),  x bf16, W in a GGUF block format.
 *
 * The weight bytes are the file's own blocks (no repacking, no expansion in memory): a weight
 * row is K / block_size blocks.  Every format is read the same way, 256 weights (a "chunk": one
 * K-quant super-block, or 8 blocks of 32) at a time, as
 *
 *   w[i] = s(i) * u[i] + o(i)        u[i] in 0..255, s and o per 16 weights
 *
 * and the activations are quantized per row and 32 k to int8 (xq = round(x / d), d = max|x| / 127,
 * as llama.cpp's Q8_0), so one VPDPBUSD gives 64 exact integer products summed in 4-product lanes;
 * the lane sums are scaled by s * d in fp32, and the offset enters as o * d * sum(xq over 16 weights).
 *
 *   type   block  bytes  u                        s                     o
 *   Q4_0     32     18   nibble                   d                     -8 d
 *   Q4_1     32     20   nibble                   d                     m
 *   Q5_0     32     22   5 bits                   d                     -16 d
 *   Q5_1     32     24   5 bits                   d                     m
 *   Q8_0     32     34   int8 + 128               d                     -128 d
 *   Q4_K    256    144   nibble                   d * sc(6 bit)         -dmin * m(6 bit)
 *   Q5_K    256    176   5 bits                   d * sc(6 bit)         -dmin * m(6 bit)
 *   Q6_K    256    210   6 bits                   d * sc(int8) per 16   -32 s
 *   MXFP4    32     17   e2m1 code -> 2 x value   2^(e - 128) (E8M0 e)  -12 s   (gpt-oss's experts:
 *                         + 12 (0..24, a table)                                 read in place, never
 *                                                                               repacked)
 *   I8     (row)  4 + K  int8 + 128               fp32 scale per row    -128 s  (int8 per channel)
 *
 * Batch invariance: every (row, column) dot product is computed by the same instruction sequence
 * (fixed chunk order, two accumulators, fixed final reduction) whatever M is and whichever thread
 * computes it; a row's activation quantization depends on that row only.  Rows are grouped only
 * to share the decoded weights.
 */

enum { GQ_Q4_0 = 2, GQ_Q4_1 = 3, GQ_Q5_0 = 6, GQ_Q5_1 = 7, GQ_Q8_0 = 8, GQ_Q4_K = 12, GQ_Q5_K = 13,
       GQ_Q6_K = 14, GQ_MXFP4 = 39, GQ_I8 = 1000,
       GQ_Q4_K16 = 1012, GQ_Q6_K16 = 1014,     /* Q4_K / Q6_K repacked 16 columns at a time (below) */
       GQ_Q4_016 = 1002, GQ_Q4_116 = 1003, GQ_Q5_016 = 1006, GQ_Q5_116 = 1007, GQ_Q8_016 = 1008 };

#define SD_QSEG 4          /* segments (differently quantized row ranges) per matrix: q|k|v */
#define SD_QROWS 8         /* activation rows sharing one decode of a weight block */
/* Activation rows are quantized to int8 with one scale per 32 k (llama.cpp's Q8_0 / Q8_1 blocks; its
 * K formats use one per 256, Q8_K).  Per 32 k an activation outlier spoils 31 values instead of 255:
 * against the same weights in fp32 (scripts/measure/native_quality.py, 16 Spec-Bench prompts), SmolLM2-135M
 * Q4_1's mean KL divergence fell from 0.024 to 0.0054 and Qwen2.5-Coder-1.5B Q4_K_M's (whose
 * activations have large outliers) from 0.064 to 0.0031.
 * The side data q_quantize_rows keeps per activation row (row stride QS_STRIDE(K) floats): the sums
 * of its int8 values over each 16 k (float) at 0; over each 32 k as int32, those sums times the sign
 * offsets -8, -16, -128 of Q4_0, Q5_0, Q8_0 at QS_C32(K, 0..2) (exact integers); the 32-k sums times
 * their block's scale (float) at QS_SX, and the 16-k ones at QS_SX16. */
#define QS_STRIDE(K) (8 * ((K) / 32))
#define QS_C32(K, slot) ((K) / 16 + (K) / 32 * (slot))
#define QS_SX(K) (5 * ((K) / 32))
#define QS_SX16(K) (6 * ((K) / 32))
#define Q_BLOCK 32          /* k per activation scale */
typedef int32_t sd_i32a __attribute__((may_alias));
#ifndef QAMX_MIN_ROWS
#define QAMX_MIN_ROWS 12   /* rows from which a block of the interleaved layouts runs on AMX tiles: with a
                              scale per 32 (Q6_K: 16) k every tile product is stored and scaled at once, which
                              costs as much as VNNI below ~8-12 rows (Sapphire Rapids, 2 threads) */
#endif

typedef struct {
    int N, K, nseg;
    int type[SD_QSEG];
    int n_end[SD_QSEG];              /* exclusive end column of each segment */
    const uint8_t *data[SD_QSEG];    /* segment's rows: [n_rows][row_bytes], file layout */
    long row_bytes[SD_QSEG];
} sd_qmat;

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* An MXFP4 block's scale byte as the float ggml multiplies its doubled e2m1 values by: 2^(e - 128)
 * (ggml_e8m0_to_fp32_half; e < 2 are subnormal) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* 6-bit scale and min j of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) { *sc = q[j] & 63; *mn = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static inline __m512i pair(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Decode chunk c (blocks 8c .. 8c+nb-1, nb even) of a weight row: u8 values of block pair p ->
 * w[p], per-16 scales -> s16[0 .. 2nb), per-16 offsets -> o16[0 .. 2nb). */
static inline __attribute__((always_inline)) void
qdecode_chunk(int type, const uint8_t *row, int c, int nb, __m512i *w, float *s16, float *o16) {
    const int b0 = 8 * c;
    switch (type) {
    case GQ_Q4_0: case GQ_Q4_1: case GQ_Q5_0: case GQ_Q5_1: case GQ_Q8_0: {
        const int bs = type == GQ_Q4_0 ? 18 : type == GQ_Q4_1 ? 20 : type == GQ_Q5_0 ? 22 : type == GQ_Q5_1 ? 24 : 34;
        const int has_m = type == GQ_Q4_1 || type == GQ_Q5_1, five = type == GQ_Q5_0 || type == GQ_Q5_1;
        const float center = type == GQ_Q4_0 ? 8.f : type == GQ_Q5_0 ? 16.f : type == GQ_Q8_0 ? 128.f : 0.f;
        float dv[8] __attribute__((aligned(32))) = {0}, mv[8] __attribute__((aligned(32))) = {0};
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (int p = 0; p < nb / 2; p++) {
            const uint8_t *a = row + (size_t)(b0 + 2 * p) * bs, *bb = a + bs;
            dv[2 * p] = h2f(a);
            dv[2 * p + 1] = h2f(bb);
            if (has_m) { mv[2 * p] = h2f(a + 2); mv[2 * p + 1] = h2f(bb + 2); }
            if (type == GQ_Q8_0) {            /* int8 + 128 as unsigned */
                w[p] = _mm512_xor_si512(pair(_mm256_loadu_si256((const __m256i *)(a + 2)),
                                             _mm256_loadu_si256((const __m256i *)(bb + 2))), _mm512_set1_epi8((char)0x80));
                continue;
            }
            const int qo = 2 + 2 * has_m + 4 * five;
            const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + qo))),
                                                      _mm_loadu_si128((const __m128i *)(bb + qo)), 1);
            const __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            /* 128-bit lanes (A lo, B lo, A hi, B hi) -> (A lo, A hi, B lo, B hi): natural order */
            __m512i q = _mm512_shuffle_i64x2(pair(lo, hi), pair(lo, hi), 0xD8);
            if (five) {
                uint32_t ha, hb;
                memcpy(&ha, a + 2 + 2 * has_m, 4);
                memcpy(&hb, bb + 2 + 2 * has_m, 4);
                q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(_cvtu64_mask64(ha | ((uint64_t)hb << 32)), _mm512_set1_epi8(16)));
            }
            w[p] = q;
        }
        const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512 s = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_load_ps(dv)));
        _mm512_storeu_ps(s16, s);
        _mm512_storeu_ps(o16, has_m ? _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_load_ps(mv)))
                                    : _mm512_mul_ps(s, _mm512_set1_ps(-center)));
        break;
    }
    case GQ_MXFP4: {         /* a block: E8M0 scale byte, then 16 bytes of codes (element j low, j + 16 high) */
        float dv[8] __attribute__((aligned(32))) = {0};
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                                                   12, 11, 10, 9, 8, 6, 4, 0));  /* 2 x e2m1 + 12 */
        for (int p = 0; p < nb / 2; p++) {
            const uint8_t *a = row + (size_t)(b0 + 2 * p) * 17, *bb = a + 17;
            dv[2 * p] = e8m0_half(a[0]);
            dv[2 * p + 1] = e8m0_half(bb[0]);
            const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 1))),
                                                      _mm_loadu_si128((const __m128i *)(bb + 1)), 1);
            const __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            w[p] = _mm512_shuffle_epi8(table, _mm512_shuffle_i64x2(pair(lo, hi), pair(lo, hi), 0xD8));
        }
        const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512 s = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_load_ps(dv)));
        _mm512_storeu_ps(s16, s);
        _mm512_storeu_ps(o16, _mm512_mul_ps(s, _mm512_set1_ps(-12.f)));
        break;
    }
    case GQ_I8: {
        float d;
        memcpy(&d, row, 4);
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int i = 0; i < 2 * nb; i++) { s16[i] = d; o16[i] = -128.f * d; }
        for (int p = 0; p < nb / 2; p++)
            w[p] = _mm512_xor_si512(_mm512_loadu_si512(row + 4 + (size_t)(b0 + 2 * p) * 32), flip);
        break;
    }
    case GQ_Q4_K: case GQ_Q5_K: {
        const int five = type == GQ_Q5_K;
        const uint8_t *blk = row + (size_t)c * (five ? 176 : 144);
        const float d = h2f(blk), dmin = h2f(blk + 2);
        /* 6-bit scales and mins (ggml's kmask shuffle): bytes 0-7 scales, 8-15 mins */
        uint32_t u[4];
        memcpy(u, blk + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = mins_lo;
        u[0] &= 0x3f3f3f3f;
        const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)));
        const __m512 dd = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d), _mm512_set1_ps(-dmin));
        const __m512 v = _mm512_mul_ps(sm, dd);              /* lanes 0-7 scales, 8-15 -mins */
        const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
        _mm512_storeu_ps(s16, _mm512_permutexvar_ps(dup_lo, v));
        _mm512_storeu_ps(o16, _mm512_permutexvar_ps(dup_hi, v));
        /* 64 bytes of nibbles hold blocks 4q .. 4q+3: low nibbles = (4q, 4q+2), high = (4q+1, 4q+3) */
        const __m512i m4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16);
        const uint8_t *qs = blk + (five ? 48 : 16);
        const __m512i qh = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)))
                                : _mm512_setzero_si512();
        for (int q = 0; q < 2; q++) {
            const __m512i x = _mm512_loadu_si512(qs + 64 * q);
            const __m512i lo = _mm512_and_si512(x, m4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
            __m512i p0 = _mm512_shuffle_i64x2(lo, hi, 0x44), p1 = _mm512_shuffle_i64x2(lo, hi, 0xEE);
            if (five) {   /* high bit of block j is bit j of qh[l] */
                const int j = 4 * q;
                const __m512i t0 = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << j)), _mm256_set1_epi8((char)(1 << (j + 1))), 1);
                const __m512i t1 = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (j + 2))), _mm256_set1_epi8((char)(1 << (j + 3))), 1);
                p0 = _mm512_mask_or_epi32(p0, 0xffff, p0, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, t0), b16));
                p1 = _mm512_mask_or_epi32(p1, 0xffff, p1, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, t1), b16));
            }
            w[2 * q] = p0;
            w[2 * q + 1] = p1;
        }
        break;
    }
    case GQ_Q6_K: {
        const uint8_t *blk = row + (size_t)c * 210;
        const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))),
                                       _mm512_set1_ps(h2f(blk + 208)));
        _mm512_storeu_ps(s16, s);
        _mm512_storeu_ps(o16, _mm512_mul_ps(s, _mm512_set1_ps(-32.f)));
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
        for (int n = 0; n < 2; n++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            __m256i q0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m2));
            __m256i q1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m2));
            __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m2));
            __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi16(h, 2), m2));
            w[2 * n] = pair(q0, q1);
            w[2 * n + 1] = pair(q2, q3);
        }
        break;
    }
    default:
        for (int p = 0; p < nb / 2; p++) w[p] = _mm512_setzero_si512();
        for (int i = 0; i < 2 * nb; i++) s16[i] = o16[i] = 0.f;
    }
}

static int q_block_ok(int type) {
    switch (type) {
    case GQ_Q4_0: case GQ_Q4_1: case GQ_Q5_0: case GQ_Q5_1: case GQ_Q8_0: case GQ_Q4_K: case GQ_Q5_K:
    case GQ_Q6_K: case GQ_MXFP4: case GQ_I8: case GQ_Q4_K16: case GQ_Q6_K16:
    case GQ_Q4_016: case GQ_Q4_116: case GQ_Q5_016: case GQ_Q5_116: case GQ_Q8_016: return 1;
    default: return 0;
    }
}

/* Thread-local scratch, grown on demand (OpenMP threads persist between calls). */
static __thread char *q_scratch;
static __thread size_t q_scratch_cap;

/* Quantize activation rows per block of Q_BLOCK k: xq[r][k] int8, dq[r][b] = max|x| / 127 over block
 * b, and the sums of QS_STRIDE's layout.  A row's result depends on that row only. */
static void q_quantize_rows(const bf16 *x, int lda, int M, int K, int8_t *xq, float *dq, float *sums) {
    const int NC = K / Q_BLOCK, n16 = Q_BLOCK / 16;      /* K % 64 == 0: whole blocks */
    for (int r = 0; r < M; r++) {
        const bf16 *xr = x + (size_t)r * lda;
        int8_t *qr = xq + (size_t)r * K;
        for (int c = 0; c < NC; c++) {
            const int k0 = Q_BLOCK * c;
            __m512 amax = _mm512_setzero_ps();
            for (int h = 0; h < n16; h++)
                amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16x16_to_ps(_mm256_loadu_si256((const __m256i *)(xr + k0 + 16 * h)))));
            const float mx = _mm512_reduce_max_ps(amax), inv = mx > 0.f ? 127.f / mx : 0.f;
            dq[(size_t)r * NC + c] = mx / 127.f;
            for (int h = 0; h < n16; h++) {
                __m512 v = _mm512_mul_ps(bf16x16_to_ps(_mm256_loadu_si256((const __m256i *)(xr + k0 + 16 * h))), _mm512_set1_ps(inv));
                __m512i qi = _mm512_cvtps_epi32(v);            /* round to nearest even; |qi| <= 127 */
                _mm_storeu_si128((__m128i *)(qr + k0 + 16 * h), _mm512_cvtsepi32_epi8(qi));
                sums[(size_t)r * QS_STRIDE(K) + k0 / 16 + h] = (float)_mm512_reduce_add_epi32(qi);
            }
        }
        float *sr = sums + (size_t)r * QS_STRIDE(K);
        sd_i32a *c8 = (sd_i32a *)(sr + QS_C32(K, 0)), *c16 = (sd_i32a *)(sr + QS_C32(K, 1)),
                *c128 = (sd_i32a *)(sr + QS_C32(K, 2));
        for (int b = 0; b < K / 32; b++) {
            sr[QS_SX(K) + b] = (sr[2 * b] + sr[2 * b + 1]) * dq[(size_t)r * NC + b];
            sr[QS_SX16(K) + 2 * b] = sr[2 * b] * dq[(size_t)r * NC + b];
            sr[QS_SX16(K) + 2 * b + 1] = sr[2 * b + 1] * dq[(size_t)r * NC + b];
            const int32_t s = (int32_t)sr[2 * b] + (int32_t)sr[2 * b + 1];
            c8[b] = -8 * s;
            c16[b] = -16 * s;
            c128[b] = -128 * s;
        }
    }
}

/* Dot products of one weight row (column n of y) with R activation rows (R compile-time after
 * inlining):  out[r] = sum over 256-chunks c of (sum_lanes s16 . dx . (u . xq) + sum_h o16[h] . dx .
 * sums[r][h]), dx the activation scale of each lane's 32 k. */
static inline __attribute__((always_inline)) void
q_column(int type, const uint8_t *row, long row_bytes, int K, const int8_t *xq, const float *dq,
         const float *sums, int R, float *out) {
    const int NC = (K + 255) / 256, KB = K / 32;
    const __m512i half = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);   /* lane h: block h/2 */
    const __m512i eighth = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[SD_QROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    __m512i w[4];
    float s16[16] __attribute__((aligned(64))), o16[16] __attribute__((aligned(64)));
    for (long p = 0; p < row_bytes; p += 64) prefetch(row + p);
    const __m512i lane4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int c = 0; c < NC; c++) {
        const int nb = (K - 256 * c < 256 ? K - 256 * c : 256) / 32;     /* even: K % 64 == 0 */
        qdecode_chunk(type, row, c, nb, w, s16, o16);
        const __m512 sv = _mm512_load_ps(s16);
        const __mmask16 mk = (__mmask16)((1u << (2 * nb)) - 1);
        const __m512 ov = _mm512_maskz_load_ps(mk, o16);
        __m512 ch[SD_QROWS], dx[SD_QROWS];     /* the chunk's <= 8 activation scales of row r, lanes 0..7 */
        for (int r = 0; r < R; r++) {
            ch[r] = _mm512_mul_ps(ov, _mm512_maskz_loadu_ps(mk, sums + (size_t)r * QS_STRIDE(K) + 16 * c));
            dx[r] = _mm512_maskz_loadu_ps((__mmask16)((1u << nb) - 1), dq + (size_t)r * KB + 8 * c);
            ch[r] = _mm512_mul_ps(ch[r], _mm512_permutexvar_ps(half, dx[r]));
        }
        for (int p = 0; p < nb / 2; p++) {
            /* lane l of a VPDPBUSD over weights 64p .. 64p+63 covers weights 64p+4l .. +3: scale s16[4p + l/4]
             * and activation scale 2p + l/8 */
            const __m512 sl = _mm512_permutexvar_ps(_mm512_add_epi32(lane4, _mm512_set1_epi32(4 * p)), sv);
            const __m512i lanes_p = _mm512_add_epi32(eighth, _mm512_set1_epi32(2 * p));
            for (int r = 0; r < R; r++) {
                const __m512i xv = _mm512_loadu_si512(xq + (size_t)r * K + 256 * c + 64 * p);
                const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p], xv);
                const __m512 slr = _mm512_mul_ps(sl, _mm512_permutexvar_ps(lanes_p, dx[r]));
                ch[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), slr, ch[r]);
            }
        }
        for (int r = 0; r < R; r++) acc[r] = _mm512_add_ps(ch[r], acc[r]);
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* q_column with the type and the row count fixed at compile time, for each type */
#define Q_COLUMN_FOR(TYPE, NAME)                                                                      \
    static void NAME(const uint8_t *row, long rb, int K, const int8_t *xq, const float *dq,           \
                     const float *ss, int R, float *res) {                                            \
        switch (R) {                                                                                  \
        case 1: q_column(TYPE, row, rb, K, xq, dq, ss, 1, res); break;                               \
        case 2: q_column(TYPE, row, rb, K, xq, dq, ss, 2, res); break;                               \
        case 3: q_column(TYPE, row, rb, K, xq, dq, ss, 3, res); break;                               \
        case 4: q_column(TYPE, row, rb, K, xq, dq, ss, 4, res); break;                               \
        case 5: q_column(TYPE, row, rb, K, xq, dq, ss, 5, res); break;                               \
        case 6: q_column(TYPE, row, rb, K, xq, dq, ss, 6, res); break;                               \
        case 7: q_column(TYPE, row, rb, K, xq, dq, ss, 7, res); break;                               \
        default: q_column(TYPE, row, rb, K, xq, dq, ss, 8, res); break;                              \
        }                                                                                             \
    }
Q_COLUMN_FOR(GQ_Q4_0, q_col_q4_0)
Q_COLUMN_FOR(GQ_Q4_1, q_col_q4_1)
Q_COLUMN_FOR(GQ_Q5_0, q_col_q5_0)
Q_COLUMN_FOR(GQ_Q5_1, q_col_q5_1)
Q_COLUMN_FOR(GQ_Q8_0, q_col_q8_0)
Q_COLUMN_FOR(GQ_Q4_K, q_col_q4_k)
Q_COLUMN_FOR(GQ_Q5_K, q_col_q5_k)
Q_COLUMN_FOR(GQ_Q6_K, q_col_q6_k)
Q_COLUMN_FOR(GQ_MXFP4, q_col_mxfp4)
Q_COLUMN_FOR(GQ_I8, q_col_i8)

typedef void (*q_col_fn)(const uint8_t *, long, int, const int8_t *, const float *, const float *, int, float *);

static q_col_fn q_col_for(int type) {
    switch (type) {
    case GQ_Q4_0: return q_col_q4_0;
    case GQ_Q4_1: return q_col_q4_1;
    case GQ_Q5_0: return q_col_q5_0;
    case GQ_Q5_1: return q_col_q5_1;
    case GQ_Q8_0: return q_col_q8_0;
    case GQ_Q4_K: return q_col_q4_k;
    case GQ_Q5_K: return q_col_q5_k;
    case GQ_Q6_K: return q_col_q6_k;
    case GQ_MXFP4: return q_col_mxfp4;
    case GQ_I8: return q_col_i8;
    default: return NULL;
    }
}

#include "quant16.c"    /* the 16-column interleaved layouts and kernels */

/* MXFP4 16 columns at a time, read in place: col[c] is column c's row in the file (16 rows anywhere),
 * out[16 r + c] its dot product with activation row r (R <= SD_QROWS).  Per block of 32 k the 16
 * columns' codes are loaded from their rows, mapped through the table (u = 2 x e2m1 + 12) and
 * transposed so that lane c of vector G holds column c's u of k 4G..4G+3, as the interleaved layouts
 * hold theirs: one VPDPBUSD per 4 k for all 16 columns, the offset -12 * sum(xq) added to the exact
 * integer sum, then times the block's scale and the activation's.  Every column's result is the same
 * whatever R and whichever other columns share the call (batch invariant). */
typedef int32_t sd_i32mx __attribute__((may_alias, aligned(1)));
static inline __m512i mx_bcast4(const int8_t *p) { return _mm512_set1_epi32(*(const sd_i32mx *)p); }

static void mx16_rows(const uint8_t *const *col, int K, const int8_t *xq, const float *dq, const float *sums, int R,
                      float *out) {
    const int QS = QS_STRIDE(K), KB = K / 32;
    const sd_i32a *c8 = (const sd_i32a *)(sums + QS_C32(K, 0));          /* -8 * sum(xq) per 32 k */
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                                               12, 11, 10, 9, 8, 6, 4, 0));
    __m512i idx[4];                   /* dword c < 8 of vector G: column c's dword G (4 columns a source) */
    for (int G = 0; G < 4; G++) {
        int32_t v[16] = {0};
        for (int c = 0; c < 8; c++) v[c] = 4 * (c % 4) + G + (c >= 4 ? 16 : 0);
        idx[G] = _mm512_loadu_si512(v);
    }
    __m512 acc[SD_QROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < KB; b++) {
        uint8_t e[16];
        __m512i lo[4], hi[4], u[8];
        for (int v = 0; v < 4; v++) {
            const uint8_t *p0 = col[4 * v] + (size_t)b * 17, *p1 = col[4 * v + 1] + (size_t)b * 17;
            const uint8_t *p2 = col[4 * v + 2] + (size_t)b * 17, *p3 = col[4 * v + 3] + (size_t)b * 17;
            e[4 * v] = p0[0], e[4 * v + 1] = p1[0], e[4 * v + 2] = p2[0], e[4 * v + 3] = p3[0];
            __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p0 + 1)));
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p1 + 1)), 1);
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p2 + 1)), 2);
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(p3 + 1)), 3);
            lo[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(x, m4));                      /* k 0..15 */
            hi[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(x, 4), m4)); /* k 16..31 */
        }
        for (int G = 0; G < 4; G++) {
            u[G] = _mm512_inserti64x4(_mm512_permutex2var_epi32(lo[0], idx[G], lo[1]),
                                      _mm512_castsi512_si256(_mm512_permutex2var_epi32(lo[2], idx[G], lo[3])), 1);
            u[G + 4] = _mm512_inserti64x4(_mm512_permutex2var_epi32(hi[0], idx[G], hi[1]),
                                          _mm512_castsi512_si256(_mm512_permutex2var_epi32(hi[2], idx[G], hi[3])), 1);
        }
        float scale[16] __attribute__((aligned(64)));
        for (int c = 0; c < 16; c++) scale[c] = e8m0_half(e[c]);
        const __m512 dv = _mm512_load_ps(scale);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + (size_t)r * K + 32 * b;
            __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();   /* two chains (exact ints) */
            for (int G = 0; G < 8; G += 2) {
                ia = _mm512_dpbusd_epi32(ia, u[G], mx_bcast4(xr + 4 * G));
                ib = _mm512_dpbusd_epi32(ib, u[G + 1], mx_bcast4(xr + 4 * G + 4));
            }
            ia = _mm512_add_epi32(_mm512_add_epi32(ia, ib), _mm512_set1_epi32(c8[(size_t)r * QS + b] / 2 * 3));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(dv, _mm512_set1_ps(dq[(size_t)r * KB + b])),
                                     acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

/* Whether the 16 columns of group g are all MXFP4 rows (of any segments); col[c]: column c's row (the last
 * column's past N, whose results store_block drops). */
static int mx16_columns(const sd_qmat *W, int g, const uint8_t **col) {
    int sc = 0;
    for (int c = 0; c < 16; c++) {
        const int n = g * 16 + c < W->N ? g * 16 + c : W->N - 1;
        while (n >= W->n_end[sc]) sc++;
        if (W->type[sc] != GQ_MXFP4) return 0;
        col[c] = W->data[sc] + (size_t)(n - (sc ? W->n_end[sc - 1] : 0)) * W->row_bytes[sc];
    }
    return 1;
}

/* One thread's share (t of nt) of y[M, N] (op) x[M, K] @ W^T: columns split in groups of 16.
 * Each thread quantizes all M activation rows itself (no barrier needed; the same result). */
static void qmm_part(const sd_qmat *W, const bf16 *x, int lda, const float *bias, void *y, int ldy, int M,
                     int mode, int t, int nt, int *cfg) {
    const int K = W->K, KB = K / 32, QS = QS_STRIDE(K), esz = out_esz(mode);
    /* scratch: [AMX: k16_amx_all's double buffers | fp32 accumulators [M][16]] | dq | sums | xq */
#if SD_QAMX
    const size_t pipe = sizeof(k16_pipe) + (size_t)M * 16 * sizeof(float);
#else
    const size_t pipe = 0;
#endif
    const size_t need = pipe + (size_t)M * K + ((size_t)M * (KB + QS) + 32) * 4 + 128;
    if (q_scratch_cap < need) {
        free(q_scratch);
        q_scratch = (char *)aligned_alloc(64, (need + 63) / 64 * 64);
        q_scratch_cap = q_scratch ? need : 0;
    }
    if (!q_scratch) return;
    float *dq = (float *)(q_scratch + pipe), *sums = dq + (size_t)M * KB + 16;
    int8_t *xq = (int8_t *)(sums + (size_t)M * QS + 16);
    q_quantize_rows(x, lda, M, K, xq, dq, sums);
    int g0, g1;
    split((W->N + 15) / 16, t, nt, &g0, &g1);
    float acc[16 * 16] __attribute__((aligned(64)));
    float res[SD_QROWS];
    const uint8_t *col[16];
    /* AMX tiles for blocks of QAMX_MIN_ROWS..16 rows of the interleaved layouts (the same results as the
     * VNNI kernels: quant16_amx.c) */
    const int amx = SD_QAMX && q_amx_on && M >= QAMX_MIN_ROWS;
    for (int g = g0; g < g1; g++) {
        int s = 0;                           /* the segment of the group's first column */
        while (g * 16 >= W->n_end[s]) s++;
        const size_t gb = q16_group_bytes(W->type[s], K);    /* an interleaved segment: 16-aligned */
        const uint8_t *grp = gb ? W->data[s] + (size_t)(g * 16 - (s ? W->n_end[s - 1] : 0)) / 16 * gb : NULL;
        const int chunk = amx && grp ? 16 : SD_QROWS;
#if SD_QAMX
        if (amx && grp && (W->type[s] == GQ_Q4_K16 || W->type[s] == GQ_Q6_K16)) {
            /* all rows at once, pipelined, each super-block decoded once (the same bits) */
            float *accm = (float *)(q_scratch + sizeof(k16_pipe));
            k16_amx_all(W->type[s], grp, K, xq, dq, sums, M, accm, cfg, (k16_pipe *)q_scratch);
            for (int m0 = 0; m0 < M; m0 += 16)
                store_block(accm + (size_t)16 * m0, M - m0 < 16 ? M - m0 : 16, g * 16, W->N, bias,
                            (char *)y + (size_t)m0 * ldy * esz, ldy, mode);
            continue;
        }
#endif
        for (int m0 = 0; m0 < M; m0 += chunk) {
            const int R = M - m0 < chunk ? M - m0 : chunk;
            const int8_t *xm = xq + (size_t)m0 * K;
            const float *dm = dq + (size_t)m0 * KB, *sm = sums + (size_t)m0 * QS;
            memset(acc, 0, sizeof acc);
            if (grp && amx && R >= QAMX_MIN_ROWS) {
#if SD_QAMX
                leg16_amx(W->type[s], grp, K, xm, dm, sm, R, acc, cfg);
#endif
            } else if (grp) {
                q16_rows(W->type[s], grp, K, xm, dm, sm, R, acc);
            } else if (mx16_columns(W, g, col)) {
                mx16_rows(col, K, xm, dm, sm, R, acc);
            } else {
                for (int c = 0; c < 16 && g * 16 + c < W->N; c++) {
                    const int n = g * 16 + c;
                    int sc = s;
                    while (n >= W->n_end[sc]) sc++;
                    const int nb = sc ? W->n_end[sc - 1] : 0;
                    const uint8_t *row = W->data[sc] + (size_t)(n - nb) * W->row_bytes[sc];
                    q_col_for(W->type[sc])(row, W->row_bytes[sc], K, xm, dm, sm, R, res);
                    for (int r = 0; r < R; r++) acc[16 * r + c] = res[r];
                }
            }
            store_block(acc, R, g * 16, W->N, bias, (char *)y + (size_t)m0 * ldy * esz, ldy, mode);
        }
    }
}

/* Standalone y = x @ W^T (+ bias): x [M, lda] bf16, y [M, ldy] bf16 (out_bf16) or fp32.
 * Returns 0, or -1 when W uses an unsupported type or K is not a multiple of 64. */
int sd_qlinear(const sd_qmat *W, const bf16 *x, int lda, const float *bias, void *y, int ldy, int M,
               int out_bf16, int nthreads) {
    if (W->K % 64 || W->nseg < 1 || W->nseg > SD_QSEG) return -1;
    for (int s = 0; s < W->nseg; s++)
        if (!q_block_ok(W->type[s])) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        int cfg = -1;
        qmm_part(W, x, lda, bias, y, ldy, M, out_bf16 ? OUT_BF16 : OUT_F32, omp_get_thread_num(),
                 omp_get_num_threads(), &cfg);
        if (cfg >= 0) _tile_release();
    }
    return 0;
}

#include "quant_dequant.c"   /* exact dequantization (the gguf package's values) */
