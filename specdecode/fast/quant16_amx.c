/* specdecode/fast/quant16_amx.c -- the 16-column kernels of quant16.c on AMX int8 tiles (included by quant16.c)
 *
 * Past one row the VNNI kernels are compute-bound: one VPDPBUSD per row per 64 products.  Here one
 * TDPBSUD computes the exact int32 dot products of up to 16 activation rows with 16 weight columns over
 * one scale block (32 k; Q6_K: 16 k):
 *   A = the activation rows (int8, q_quantize_rows' layout, row stride K), R x 32 (or 16) bytes;
 *   B = the weights of the block as unsigned bytes: the interleaved layouts already are AMX's B layout
 *       (vector G holds columns 0..15 x k 4G..4G+3), 4-bit ones after splitting their nibbles.
 * The int32 tiles are stored and scaled with exactly the fp32 operations of the VNNI kernel, in the same
 * order; an integer dot product is exact whichever instruction sums it, so every output equals the VNNI
 * kernel's bit for bit, for any row count: batch invariance holds across the two paths.
 *
 * Tiles: 0..3 C (R x 16 int32); 4, 5 A (R x KB int8); 6, 7 B (KB / 4 x 64 u8), KB = 32 (Q6_K: 16); the
 * 32-block formats use 4 and 6 only, the K formats (k16_amx_all) alternate between the two pairs.
 */

#if defined(__AVX512F__) && defined(__AMX_INT8__)
#define SD_QAMX 1
#define QAMX_CFG(KB, R) (1000 * (KB) + (R))   /* value of the per-thread tile-config cache */

static int q_amx_on;           /* set by sd_q_amx() once the process may use AMX tiles */

/* Turn the AMX int8 path on (1) or off (0); returns whether it is on (needs AMX-INT8 at build time). */
int sd_q_amx(int on) { q_amx_on = on != 0; return q_amx_on; }

static void qamx_config(int KB, int R, int *cfg) {
    if (*cfg == QAMX_CFG(KB, R)) return;
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) { c.rows[i] = (uint8_t)R; c.colsb[i] = 64; }
    for (int i = 4; i < 6; i++) { c.rows[i] = (uint8_t)R; c.colsb[i] = (uint16_t)KB; }
    for (int i = 6; i < 8; i++) { c.rows[i] = (uint8_t)(KB / 4); c.colsb[i] = 64; }
    /* gcc 12's _tile_loadconfig tells the compiler it reads 8 bytes (an "m" operand of a pointer), so
     * the stores past them can be dropped as dead (they were, ldtilecfg faulted); the barrier makes the
     * whole struct live */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
    *cfg = QAMX_CFG(KB, R);
}

/* CI = A . B, exact int32 [R][16], in C tile TC through A tile TA and B tile TB (literals) */
#define QAMX_DOT_T(TC, TA, TB, A, LDA, B, CI)                                                         \
    do {                                                                                              \
        _tile_loadd(TA, (A), (LDA));                                                                  \
        _tile_loadd(TB, (B), 64);                                                                     \
        _tile_zero(TC);                                                                               \
        _tile_dpbsud(TC, TA, TB);                                                                     \
        _tile_stored(TC, (CI), 64);                                                                   \
    } while (0)
/* CI = A(X + KB j) . B in C tile T */
#define QAMX_DOT(KB, j, T, X, B, LDX, CI) QAMX_DOT_T(T, 4, 6, (X) + (KB) * (j), LDX, B, CI)
/* blocks j .. j+3: CI[j + i] = A(X + KB (j + i)) . BS[j + i] */
#define QAMX_DOT4(KB, j, X, BS, LDX, CI)                                                              \
    do {                                                                                              \
        QAMX_DOT(KB, (j), 0, X, (BS)[(j)], LDX, (CI)[(j)]);                                           \
        QAMX_DOT(KB, (j) + 1, 1, X, (BS)[(j) + 1], LDX, (CI)[(j) + 1]);                               \
        QAMX_DOT(KB, (j) + 2, 2, X, (BS)[(j) + 2], LDX, (CI)[(j) + 2]);                               \
        QAMX_DOT(KB, (j) + 3, 3, X, (BS)[(j) + 3], LDX, (CI)[(j) + 3]);                               \
    } while (0)

/* Split 4 vectors of packed nibbles (low: k group 2t, high: 2t + 1) into 8 B rows at dst */
static inline void qamx_nibbles(const uint8_t *q, uint8_t *dst) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m512i v = _mm512_loadu_si512(q + 64 * t);
        _mm512_store_si512(dst + 128 * t, _mm512_and_si512(v, m4));
        _mm512_store_si512(dst + 128 * t + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
}

/* The 32-block formats (leg16_group's layouts), 8 blocks (one activation chunk) at a time */
static void leg16_amx(int type, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums,
                      int R, float *out, int *cfg) {
    const int NC = (K + 255) / 256, QS = QS_STRIDE(K), KB = K / 32, BB = leg16_bytes(type);   /* dq: per block */
    const int has_m = type == GQ_Q4_116 || type == GQ_Q5_116, five = type == GQ_Q5_016 || type == GQ_Q5_116;
    const int slot = type == GQ_Q4_016 ? 0 : type == GQ_Q5_016 ? 1 : 2;     /* leg16_group's sign offsets */
    uint8_t bb[8][512] __attribute__((aligned(64)));
    int32_t ci[8][16 * 16] __attribute__((aligned(64)));
    float dvs[8][16] __attribute__((aligned(64))), ovs[8][16] __attribute__((aligned(64)));
    __m512 acc[16];
    const __m512i b16 = _mm512_set1_epi8(16);
    qamx_config(32, R, cfg);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < NC; c++) {
        const int nb = KB - 8 * c < 8 ? KB - 8 * c : 8;
        const uint8_t *bw[8];
        for (int i = 0; i < nb; i++) {
            const uint8_t *blk = grp + (size_t)(8 * c + i) * BB, *q = blk + 32 + 32 * has_m;
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            _mm512_store_ps(dvs[i], dv);
            if (has_m) _mm512_store_ps(ovs[i], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))));
            if (type == GQ_Q8_016) { bw[i] = q; continue; }    /* already B rows: int8 + 128 */
            qamx_nibbles(q, bb[i]);
            if (five)
                for (int G = 0; G < 8; G++) {
                    uint64_t hb;
                    memcpy(&hb, q + 256 + 8 * G, 8);
                    const __m512i u = _mm512_load_si512(bb[i] + 64 * G);
                    _mm512_store_si512(bb[i] + 64 * G, _mm512_or_si512(u, _mm512_maskz_mov_epi8(_cvtu64_mask64(hb), b16)));
                }
            bw[i] = bb[i];
        }
        const int8_t *x = xq + 256 * c;
        int i = 0;
        for (; i + 4 <= nb; i += 4) QAMX_DOT4(32, i, x, bw, K, ci);
        for (; i < nb; i++) QAMX_DOT(32, i, 0, x, bw[i], K, ci[i]);
        for (int r = 0; r < R; r++) {       /* leg16_group's fp32 operations, in its order */
            const float *dr = dq + (size_t)r * KB + 8 * c;
            if (has_m) {
                const float *sr = sums + (size_t)r * QS + QS_SX(K) + 8 * c;
                for (int b = 0; b < nb; b++) {
                    const __m512 scale = _mm512_mul_ps(_mm512_load_ps(dvs[b]), _mm512_set1_ps(dr[b]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ci[b] + 16 * r)), scale, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_load_ps(ovs[b]), _mm512_set1_ps(sr[b]), acc[r]);
                }
            } else {
                const sd_i32a *cr = (const sd_i32a *)(sums + (size_t)r * QS + QS_C32(K, slot)) + 8 * c;
                for (int b = 0; b < nb; b++) {
                    const __m512 scale = _mm512_mul_ps(_mm512_load_ps(dvs[b]), _mm512_set1_ps(dr[b]));
                    const __m512i ib = _mm512_add_epi32(_mm512_load_si512(ci[b] + 16 * r), _mm512_set1_epi32(cr[b]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), scale, acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

/* Any number of rows (12..16 of a verify pass, or a prompt's chunk) against one Q4_K16 / Q6_K16 group,
 * software-pipelined over jobs (super-block, chunk of 16 rows): each super-block is decoded once for all
 * its chunks, and the tile products of the next job are issued one per row during the fp32 scaling of
 * the current one, into the other half of double buffers, with the A / B tiles alternating between two
 * registers each.  The rows' accumulators live in accm [M][16].  Per row the fp32 operations and their
 * order are those of q4k16_group / q6k16_group (super-block by super-block, block by block), so the
 * outputs are the VNNI kernels' bits.  2-core Sapphire Rapids, against one 16-row chunk at a time with
 * the super-block decoded per chunk: L2-resident Q4_K 64 rows 254-259 -> 293-303 GMAC/s per core; a
 * 700-token prefill of the 1.5B Q4_K_M 194-207 -> 210-230 tok/s (alternating runs). */
typedef struct k16_pipe {
    uint8_t bb[2][16][512] __attribute__((aligned(64)));   /* B rows of the decoded super-block */
    int32_t ci[2][16][16 * 16] __attribute__((aligned(64)));
    float scs[2][16][16] __attribute__((aligned(64))), off[2][16][16] __attribute__((aligned(64)));
} k16_pipe;
_Static_assert(sizeof(k16_pipe) % 64 == 0, "qmm_part places the accumulators right after it, 64-aligned");

static void k16_decode(int q6, const uint8_t *sb, uint8_t (*bb)[512], float (*scs)[16], float (*off)[16]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
    if (q6) {
        for (int b = 0; b < 16; b++) {
            const __m512 sc = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + 32 + 16 * b)))));
            _mm512_store_ps(scs[b], sc);
            _mm512_store_ps(off[b], _mm512_mul_ps(sc, _mm512_set1_ps(32.f)));
            const uint8_t *q = sb + 288 + 192 * b;
            const __m512i a = _mm512_loadu_si512(q), bq = _mm512_loadu_si512(q + 64), h = _mm512_loadu_si512(q + 128);
            _mm512_store_si512(bb[b], _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m2)));
            _mm512_store_si512(bb[b] + 64, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m2)));
            _mm512_store_si512(bb[b] + 128, _mm512_or_si512(_mm512_and_si512(bq, m4), _mm512_and_si512(h, m2)));
            _mm512_store_si512(bb[b] + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bq, 4), m4), _mm512_and_si512(_mm512_srli_epi16(h, 2), m2)));
        }
    } else {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
        for (int b = 0; b < 8; b++) {
            _mm512_store_ps(scs[b], _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + 64 + 16 * b))))));
            _mm512_store_ps(off[b], _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + 192 + 16 * b))))));
            qamx_nibbles(sb + 320 + 256 * b, bb[b]);
        }
    }
}

/* Block b's products of rows x[0..R) (row stride K) into ci[b]: C tile b % 4, A / B tiles alternating
 * 4|5 and 6|7, so the next product's loads need not wait for this one's */
static inline __attribute__((always_inline)) void
k16_dot(int b, int BK, int K, const int8_t *x, uint8_t (*bb)[512], int32_t (*ci)[256]) {
    switch (b & 3) {
    case 0: QAMX_DOT_T(0, 4, 6, x + BK * b, K, bb[b], ci[b]); break;
    case 1: QAMX_DOT_T(1, 5, 7, x + BK * b, K, bb[b], ci[b]); break;
    case 2: QAMX_DOT_T(2, 4, 6, x + BK * b, K, bb[b], ci[b]); break;
    default: QAMX_DOT_T(3, 5, 7, x + BK * b, K, bb[b], ci[b]); break;
    }
}

/* The fp32 scaling of one job's block products (q4k16_group / q6k16_group's operations in their order),
 * 8 blocks at a time (Q6_K's 16 in two halves) with the blocks' 16-lane scales in registers; the next
 * job's products (xn: its rows, or NULL) are issued one per row in between. */
static inline __attribute__((always_inline)) void
k16_scale(int q6, int32_t (*ci)[256], float (*scs)[16], float (*off)[16], const float *sums,
          const float *dq, int QS, int KB, int R, float *accm,
          const int8_t *xn, uint8_t (*bbn)[512], int32_t (*cin)[256], int BK, int K) {
    for (int h = 0; h < 8 << q6; h += 8) {
        __m512 sv[8], ov[8];
        for (int b = 0; b < 8; b++) { sv[b] = _mm512_load_ps(scs[h + b]); ov[b] = _mm512_load_ps(off[h + b]); }
#pragma GCC unroll 1
        for (int r = 0; r < R; r++) {
            const float *sr = sums + (size_t)r * QS + h, *dr = dq + (size_t)r * KB;
            __m512 a = _mm512_load_ps(accm + 16 * r);
#pragma GCC unroll 8
            for (int b = 0; b < 8; b++) {
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ci[h + b] + 16 * r)),
                                    _mm512_mul_ps(sv[b], _mm512_set1_ps(dr[(h + b) >> q6])), a);   /* Q6_K: 2 blocks per scale */
                a = _mm512_fnmadd_ps(ov[b], _mm512_set1_ps(sr[b]), a);
            }
            _mm512_store_ps(accm + 16 * r, a);
            if (xn && r < 8) k16_dot(h + r, BK, K, xn, bbn, cin);   /* the next job's products, one per row */
        }
        if (xn)
            for (int b = R; b < 8; b++) k16_dot(h + b, BK, K, xn, bbn, cin);
    }
}

static inline __attribute__((always_inline)) void
k16_amx_run(const int q6, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums, int M,
            float *accm, int *cfg, k16_pipe *pp) {
    const int NC = K / 256, KB = K / 32, QS = QS_STRIDE(K);
    const int NB = q6 ? 16 : 8, BK = q6 ? 16 : 32;       /* scale blocks per super-block, k per block */
    const int NM = (M + 15) / 16, jobs = NC * NM;         /* job i: super-block i / NM, rows 16 (i % NM) */
    const size_t SBB = q6 ? Q6K16_BYTES : Q4K16_BYTES;
    for (int r = 0; r < M; r++) _mm512_store_ps(accm + 16 * r, _mm512_setzero_ps());
    k16_decode(q6, grp, pp->bb[0], pp->scs[0], pp->off[0]);
    qamx_config(BK, M < 16 ? M : 16, cfg);
    for (int b = 0; b < NB; b++) k16_dot(b, BK, K, xq, pp->bb[0], pp->ci[0]);
    for (int i = 0; i < jobs; i++) {
        const int c = i / NM, m0 = 16 * (i % NM), R = M - m0 < 16 ? M - m0 : 16;
        const int8_t *xn = NULL;                         /* the next job's rows, its products issued */
        int32_t (*cin)[256] = pp->ci[(i + 1) & 1];        /* during this job's scaling */
        uint8_t (*bbn)[512] = NULL;
        if (i + 1 < jobs) {
            const int c1 = (i + 1) / NM, n0 = 16 * ((i + 1) % NM);
            if (c1 != c) k16_decode(q6, grp + (size_t)c1 * SBB, pp->bb[c1 & 1], pp->scs[c1 & 1], pp->off[c1 & 1]);
            qamx_config(BK, M - n0 < 16 ? M - n0 : 16, cfg);
            xn = xq + (size_t)n0 * K + 256 * c1;
            bbn = pp->bb[c1 & 1];
        }
        int32_t (*ci)[256] = pp->ci[i & 1];
        float (*scs)[16] = pp->scs[c & 1], (*off)[16] = pp->off[c & 1];
        const float *sx = sums + (size_t)m0 * QS + (q6 ? QS_SX16(K) : QS_SX(K)) + NB * c;   /* per block */
        k16_scale(q6, ci, scs, off, sx, dq + (size_t)m0 * KB + 8 * c, QS, KB, R, accm + 16 * (size_t)m0,
                  xn, bbn, cin, BK, K);
    }
}

/* the two formats compiled apart, q6 a constant in each (with q6 at run time a 700-token prefill of the
 * 1.5B ran 3-5% slower, alternating runs) */
static void k16_amx_all(int type, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums,
                        int M, float *accm, int *cfg, k16_pipe *pp) {
    if (type == GQ_Q6_K16) k16_amx_run(1, grp, K, xq, dq, sums, M, accm, cfg, pp);
    else k16_amx_run(0, grp, K, xq, dq, sums, M, accm, cfg, pp);
}

#else
#define SD_QAMX 0
static const int q_amx_on = 0;
int sd_q_amx(int on) { (void)on; return 0; }
#endif
