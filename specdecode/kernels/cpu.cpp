// specdecode CPU kernels: linear layers over dense (fp32, bf16) and block-quantized (Q8_0,
// Q4_1) weights, decode attention over a preallocated KV cache, and the Llama layer stack.
//
// Why: on CPUs without AMX or AVX-512 BF16, torch's GEMMs for one to a few rows run far
// below the memory bandwidth (bf16 is emulated, MKL takes a slow path on AMD), and the
// CPU flash-attention kernel costs several times a plain matmul-softmax-matmul for one
// query over a long cache. A decode step reads every weight once; these kernels stream
// them in the format they are stored in and run the whole layer stack in one call, so a
// step approaches what reading its weights and its keys and values costs (how close it
// gets on a machine: specdecode profile, docs/performance.md).
//
// Batch invariance (--exact): every output row is computed by one thread, by the same
// instructions in the same order, whatever else is in the batch and however many threads
// run. Linear layers split work over output features only, never over the reduction;
// the activation quantization is per row; attention reduces over a row's visible keys in
// fixed chunks of SD_KEY_CHUNK keys counted from the first visible key, so a token scored
// alone, within k + 1 drafts or inside a tree sees the same arithmetic.
//
// Built once per machine by specdecode/kernels/__init__.py (g++ -O3 -march=native
// -fopenmp -ffp-contract=off; no -ffast-math, so the compiler never reorders a float sum)
// and called through ctypes. Without AVX2/FMA/F16C the portable scalar code is compiled.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SD_AVX2 1
#else
#define SD_AVX2 0
#endif
// AVX-512 VNNI (Zen 4 and later, Intel from Ice Lake): vpdpbusd multiplies 4 unsigned by 4
// signed bytes and adds them to a 32-bit lane in one instruction, where AVX2 needs maddubs
// then madd. The integer sums are exact either way, so the results are bit for bit the same.
#if SD_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SD_VNNI 1
#else
#define SD_VNNI 0
#endif
// 512-bit VNNI (dot_q4_1x16)
#if SD_VNNI && defined(__AVX512F__) && defined(__AVX512BW__)
#define SD_VNNI512 1
#else
#define SD_VNNI512 0
#endif
#if SD_AVX2 && defined(__AVX512F__) && defined(__AVX512VL__)
#define SD_AVX512 1  // 32 vector registers (the 256-bit code then uses all of them)
#else
#define SD_AVX512 0
#endif

#define SD_VERSION 6
#define SD_KEY_CHUNK 256  // keys per attention partial; fixed, so results never depend on T
#define SD_MAX_HEAD_DIM 256
#define SD_MAX_GROUP 16  // query heads per KV head
#define SD_ACT_TABLE 65536  // bytes of pre-broadcast activation codes a thread keeps (linear_x8)
#define SD_X2_ROWS 16  // AVX2 without VNNI: from this many rows, Q4_1X8 groups in pairs (dot_q4_1x8x2)
#define SD_PREFETCH 2048  // bytes of Q4_1X8 weights prefetched ahead (Q8_0X8, twice as long a block: twice)

enum { SD_F32 = 0, SD_BF16 = 1, SD_Q8_0 = 2, SD_Q4_1 = 3, SD_F16 = 4, SD_Q4_1X8 = 5, SD_Q8_0X8 = 6, SD_Q4_1X16 = 7 };

extern "C" {

// One linear layer's weight [rows = out features, cols = in features].
//   F32:  w float[rows*cols]            BF16: w uint16[rows*cols]
//   Q8_0: w int8[rows*cols],  d fp16[rows*cols/32]          (w_i = d * q_i)
//   Q4_1: w uint8[rows*cols/2], d, m fp16[rows*cols/32]     (w_i = d * q_i + m)
//   Q4_1 blocks keep GGUF's nibble order: byte j of a block holds weights j (low nibble)
//   and j + 16 (high nibble).
//   Q4_1X8: Q4_1's values regrouped by 8 output rows (rows % 8 == 0): for group g and
//   block b, 128 bytes at w + 128 (g blocks + b) and 8 scales and 8 minima at
//   d, m + 8 (g blocks + b). Byte 32 i + 4 r + t holds row 8 g + r's weight 8 i + t of the
//   block (low nibble) and its weight 8 i + 4 + t (high nibble), so one 32-byte load
//   unpacks to 4 consecutive weights of each of the 8 rows, one row per 32-bit lane
//   (models/quant.py, PackedLinear.interleave_rows8).
//   Q4_1X16: Q4_1X8's groups in pairs (rows % 16 == 0), interleaved 32 bytes at a time:
//   for pair p = g / 2 and block b, 256 bytes at w + 256 (p blocks + b) whose bytes
//   64 i + 32 (g % 2) .. + 31 are group g's Q4_1X8 bytes 32 i .. 32 i + 31, and 16 scales
//   (and minima) at d, m + 16 (p blocks + b), group g's 8 at + 8 (g % 2). One 512-bit load
//   then holds 4 weights of each of the pair's 16 rows, and a thread's share of the pairs
//   is one stream (PackedLinear.interleave_rows16). Made only where the 512-bit VNNI
//   kernels run it (sd_pairs16); every build reads it.
//   Q8_0X8: Q8_0 regrouped the same way: for group g and block b, 256 bytes at
//   w + 256 (g blocks + b) and 8 scales at d + 8 (g blocks + b); byte 32 i + 4 r + t holds
//   row 8 g + r's weight 4 i + t of the block.
typedef struct {
    int32_t fmt;
    int32_t rows;
    int32_t cols;
    int32_t pad;
    const void* w;
    const uint16_t* d;
    const uint16_t* m;
    const float* bias;  // [rows] or NULL
} sd_linear;

typedef struct {
    sd_linear qkv, o, gate_up, down;
    const float* input_norm;
    const float* post_norm;
    void* k_cache;  // [batch, kv_heads, capacity, head_dim] in kv_fmt
    void* v_cache;
} sd_layer;

typedef struct {
    int32_t num_layers, hidden, intermediate, heads, kv_heads, head_dim;
    int32_t capacity, batch, kv_fmt, max_rows, num_threads, pad;
    float eps, attn_scale;
    const float* rope_cos;  // [max_positions, head_dim]
    const float* rope_sin;
    sd_layer* layers;
    // scratch for max_rows rows
    float* normed;   // [max_rows, max(hidden, intermediate)]
    float* qkv;      // [max_rows, (heads + 2 kv_heads) head_dim]
    float* attn;     // [max_rows, heads head_dim]
    float* gate_up;  // [max_rows, 2 intermediate]
    int8_t* xq;      // [max_rows, max(hidden, intermediate)]
    float* xd;       // [max_rows, max(hidden, intermediate) / 32]
    float* xs;       // [max_rows, max(hidden, intermediate) / 32]
    float* partial;  // attention partials: partial_items x (heads / kv_heads) x (head_dim + 2)
    int64_t partial_items;  // capacity of partial, in (row, kv head, chunk) items
} sd_model;

int sd_version(void) { return SD_VERSION; }
int sd_simd(void) { return SD_VNNI ? 3 : SD_AVX2 ? 2 : 0; }  // 3: AVX2 + AVX-512 VNNI
int sd_key_chunk(void) { return SD_KEY_CHUNK; }
int sd_pairs16(void) { return SD_VNNI512; }  // whether Q4_1X16 has its own kernels here

}  // extern "C"

// ---------------------------------------------------------------------------------------
// scalar helpers

static inline float fp16_to_f32(uint16_t h) {
#if SD_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7F800000 | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f32_to_fp16(float f) {
#if SD_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    // round to nearest even, via the classic bit manipulation (finite values)
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exponent = (int32_t)((x >> 23) & 0xFF) - 127 + 15;
    uint32_t mantissa = x & 0x7FFFFF;
    if (((x >> 23) & 0xFF) == 0xFF) return (uint16_t)(sign | 0x7C00 | (mantissa ? 0x200 : 0));
    if (exponent >= 31) return (uint16_t)(sign | 0x7C00);
    if (exponent <= 0) {
        if (exponent < -10) return (uint16_t)sign;
        mantissa |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exponent);
        uint32_t half = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)exponent << 10) | (mantissa >> 13), rest = mantissa & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
    return (uint16_t)half;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((bits >> 16) | 0x40);  // NaN
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

#if SD_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float hmax8(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// e^x, Cephes-style: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial; about 1 ulp.
// Inputs below -87.3 give 0 (softmax and SiLU only ever need that end).
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447505531f);
    __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}

static inline __m256 load8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#if SD_VNNI512
static inline __m512 load16_f16(const uint16_t* lo, const uint16_t* hi) {  // 8 values at lo, then 8 at hi
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i*)hi), _mm_loadu_si128((const __m128i*)lo)));
}
#endif
#endif

static inline float exp1(float x) {  // the scalar twin of exp8, lane for lane
#if SD_AVX2
    float out[8];
    _mm256_storeu_ps(out, exp8(_mm256_set1_ps(x)));
    return out[0];
#else
    return expf(x);
#endif
}

// ---------------------------------------------------------------------------------------
// activation quantization for the block-quantized formats: per row and block of 32,
// scale = max|x| / 127, q = round(x / scale) in [-127, 127], and the block's sum of the
// quantized values, scale * sum(q) (Q4_1's minimum multiplies it). For Q4_1 the quantized
// row is laid out by pairs of blocks to match one 32-byte load of two weight blocks:
// [b 0..15 | b+1 0..15 | b 16..31 | b+1 16..31]. ``offset`` stores each code plus 128 as an unsigned byte instead (the VNNI
// Q8_0X8 kernel's layout: vpdpbusd takes one unsigned operand).

static void quantize_rows(const float* x, int64_t rows, int cols, int64_t x_stride, int pair_layout,
                          int8_t* xq, float* xd, float* xs, int offset = 0) {
    const int blocks = cols / 32;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * x_stride;
        int8_t* q = xq + r * cols;
        for (int b = 0; b < blocks; b++) {
            const float* v = row + 32 * b;
            float amax = 0.0f, sum = 0.0f;
#if SD_AVX2
            __m256 m = _mm256_setzero_ps(), s = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.0f);
            for (int i = 0; i < 32; i += 8) {
                __m256 t = _mm256_loadu_ps(v + i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, t));
                s = _mm256_add_ps(s, t);
            }
            amax = hmax8(m);
            sum = hsum8(s);
#else
            float s8[8] = {0};
            for (int i = 0; i < 32; i++) {
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
                s8[i % 8] += v[i];
            }
            sum = ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]));
#endif
            float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            if (sum != sum) {  // a NaN (or +inf beside -inf) in the block: the max above drops a NaN, and
                scale = NAN;   // Q8_0 never reads the sum, so its product came out finite (found in review);
                inv = 0.0f;    // NaN now, as the torch backend's, and no NaN cast to an integer below
            }
            xd[r * blocks + b] = scale;
            int8_t tmp[32];
            int codes = 0;
            for (int i = 0; i < 32; i++) {
                tmp[i] = (int8_t)nearbyintf(v[i] * inv);
                codes += tmp[i];
            }
            // the sum the block's minimum multiplies is that of the quantized activations, as
            // llama.cpp's Q8_1 keeps it: with the exact sum of x, the product paired min * sum(x)
            // with d * q . xq, and the error per block was sum((w - min) * e) instead of
            // sum(w * e), about twice the logit error on Q4_1 (found in review: mean |error|
            // against fp32 on the default model 0.40, 0.19 this way; docs/performance.md)
            xs[r * blocks + b] = scale * (float)codes;  // NaN where the block held one (scale is)
            if (offset)
                for (int i = 0; i < 32; i++) tmp[i] = (int8_t)((uint8_t)tmp[i] ^ 0x80);  // q + 128, as a byte
            if (pair_layout) {
                int base = 64 * (b / 2) + 16 * (b & 1);
                memcpy(q + base, tmp, 16);
                memcpy(q + base + 32, tmp + 16, 16);
            } else {
                memcpy(q + 32 * b, tmp, 32);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// dot products of R activation rows with one weight row (the block formats: F weight rows).
// A tile of R rows shares the weight loads (and the Q4_1 unpacking); the float arithmetic
// of each (row, weight row) is the same whatever R and F are, and the integer sums of the
// block formats are exact, so a row's result never depends on the rows beside it. R * F is
// at most 2: AVX2 has 16 vector registers (F = 2 for one row cuts the per-weight-row
// overhead of short rows: gate/up 91 -> 74 µs per call on SmolLM2's 576-wide rows).

#if SD_AVX2
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
#endif
static inline float scalar_f32(const float* p) { return *p; }
static inline float scalar_bf16(const uint16_t* p) { return bf16_to_f32(*p); }

// dense weights (fp32 or bf16, read by Load8 / Load1): four accumulators per row, combined
// in a fixed order
#if SD_AVX2
template <int R, typename W, __m256 (*Load8)(const W*), float (*Load1)(const W*)>
static inline void dot_dense(const float* const* x, const W* w, int cols, float* out) {
    __m256 acc[R][4];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < 4; a++) acc[r][a] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 32 <= cols; k += 32) {
        for (int a = 0; a < 4; a++) {
            __m256 wv = Load8(w + k + 8 * a);
            for (int r = 0; r < R; r++) acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + k + 8 * a), wv, acc[r][a]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
        for (int t = k; t < cols; t++) s += x[r][t] * Load1(w + t);
        out[r] = s;
    }
}
#define SD_DOT_DENSE(R, W, LOAD8, LOAD1) dot_dense<R, W, LOAD8, LOAD1>
#else
template <int R, typename W, float (*Load1)(const W*)>
static inline void dot_dense(const float* const* x, const W* w, int cols, float* out) {
    for (int r = 0; r < R; r++) {
        float s = 0.0f;
        for (int t = 0; t < cols; t++) s += x[r][t] * Load1(w + t);
        out[r] = s;
    }
}
#define SD_DOT_DENSE(R, W, LOAD8, LOAD1) dot_dense<R, W, LOAD1>
#endif

#if SD_AVX2
// [b ×8] int32 partial sums of blocks b and b+1 -> [b b b+1 b+1 | b b b+1 b+1] (pairs summed)
// and two such -> [b0 b1 b2 b3 | b0 b1 b2 b3]; the halves are added at the end.
static inline __m256i halves_to_blocks(__m256i lo4, __m256i hi4) {  // [0..3|0..3], [4..7|4..7] -> [0..7]
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo4, hi4, 0x20), _mm256_permute2x128_si256(lo4, hi4, 0x31));
}

static inline __m256i q8_block_sum(__m256i wa, __m256i ws, const int8_t* x, __m256i ones) {
    __m256i xv = _mm256_loadu_si256((const __m256i*)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, ws)), ones);
}
#endif

// Q8_0 weights x Q8 activations: sum_b d_w[b] dx[b] sum_i q_w[i] q_x[i], for F consecutive
// weight rows at once (as dot_q4_1): out[f * R + r]
template <int R, int F>
static inline void dot_q8_0(const int8_t* const* xq, const float* const* xd, const int8_t* w, const uint16_t* d,
                            int64_t w_stride, int64_t d_stride, int cols, float* out) {
    const int blocks = cols / 32;
#if SD_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[F][R];
    for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++) acc[f][r] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= blocks; b += 8) {
        __m256i quad[2][F][R];  // blocks 0-3 and 4-7, as [0 1 2 3 | 0 1 2 3] halves
        for (int half = 0; half < 2; half++) {
            __m256i pair[2][F][R];
            for (int j = 0; j < 2; j++) {
                const int at = b + 4 * half + 2 * j;
                __m256i x0[R], x1[R];
                for (int r = 0; r < R; r++) {
                    x0[r] = _mm256_loadu_si256((const __m256i*)(xq[r] + 32 * at));
                    x1[r] = _mm256_loadu_si256((const __m256i*)(xq[r] + 32 * at + 32));
                }
                for (int f = 0; f < F; f++) {
                    const int8_t* w0 = w + f * w_stride + 32 * at;
                    __m256i ws0 = _mm256_loadu_si256((const __m256i*)w0), ws1 = _mm256_loadu_si256((const __m256i*)(w0 + 32));
                    __m256i wa0 = _mm256_sign_epi8(ws0, ws0), wa1 = _mm256_sign_epi8(ws1, ws1);
                    for (int r = 0; r < R; r++)
                        pair[j][f][r] = _mm256_hadd_epi32(
                            _mm256_madd_epi16(_mm256_maddubs_epi16(wa0, _mm256_sign_epi8(x0[r], ws0)), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(wa1, _mm256_sign_epi8(x1[r], ws1)), ones));
                }
            }
            for (int f = 0; f < F; f++)
                for (int r = 0; r < R; r++) quad[half][f][r] = _mm256_hadd_epi32(pair[0][f][r], pair[1][f][r]);
        }
        for (int f = 0; f < F; f++) {
            __m256 dw = load8_f16(d + f * d_stride + b);
            for (int r = 0; r < R; r++) {
                __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(xd[r] + b));
                acc[f][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves_to_blocks(quad[0][f][r], quad[1][f][r])), scale,
                                            acc[f][r]);
            }
        }
    }
    __m256 tail[F][R];  // the last blocks % 8 blocks, one at a time
    for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++) tail[f][r] = _mm256_setzero_ps();
    for (; b < blocks; b++) {
        for (int f = 0; f < F; f++) {
            __m256i ws = _mm256_loadu_si256((const __m256i*)(w + f * w_stride + 32 * b));
            __m256i wa = _mm256_sign_epi8(ws, ws);
            const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128(d[f * d_stride + b]));  // [d 0 0 0]
            for (int r = 0; r < R; r++) {
                __m256i sums = q8_block_sum(wa, ws, xq[r] + 32 * b, ones);
                __m256 scale = _mm256_broadcastss_ps(_mm_mul_ss(dw, _mm_load_ss(xd[r] + b)));
                tail[f][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, tail[f][r]);
            }
        }
    }
    for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++) out[f * R + r] = hsum8(acc[f][r]) + hsum8(tail[f][r]);
#else
    for (int f = 0; f < F; f++) {
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int t = 0; t < blocks; t++) {
                int32_t isum = 0;
                for (int i = 0; i < 32; i++) isum += (int32_t)w[f * w_stride + 32 * t + i] * (int32_t)xq[r][32 * t + i];
                s += (float)isum * (fp16_to_f32(d[f * d_stride + t]) * xd[r][t]);
            }
            out[f * R + r] = s;
        }
    }
#endif
}

#if SD_AVX2
// int32 sums of the two blocks of a Q4_1 pair against one activation row (pair layout):
// [b ×4 | b+1 ×4]
static inline __m256i q4_pair_sum(__m256i lo, __m256i hi, const int8_t* x, __m256i ones) {
    __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)x)),
                                   _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(x + 32))));
    return _mm256_madd_epi16(s16, ones);
}
#endif

// Q4_1 weights x Q8 activations (pair layout): sum_b d_w[b] dx[b] sum_i q_w[i] q_x[i] + sum_b m_w[b] sx[b],
// for F consecutive weight rows (w, d, m advanced by w_stride, dm_stride per row) at once:
// out[f * R + r]. The rows of a group share the activation loads and give the core F
// independent chains; each (row, feature) keeps the same arithmetic whatever F and R are.
template <int R, int F>
static inline void dot_q4_1(const int8_t* const* xq, const float* const* xd, const float* const* xs,
                            const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t w_stride, int64_t dm_stride,
                            int cols, float* out) {
    const int blocks = cols / 32;  // even: cols % 64 == 0
#if SD_AVX2
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 acc[F][R], macc[F][R];
    for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++) acc[f][r] = macc[f][r] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= blocks; b += 8) {
        __m256i half[2][F][R];  // pairs (0,1) -> [b0 b0 b2 b2 | b1 b1 b3 b3]; pairs (2,3) likewise for b4..b7
        for (int h = 0; h < 2; h++) {
            __m256i sums[2][F][R];
            for (int j = 0; j < 2; j++) {
                const int at = b + 4 * h + 2 * j;
                for (int f = 0; f < F; f++) {
                    __m256i v = _mm256_loadu_si256((const __m256i*)(w + f * w_stride + 16 * at));
                    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    for (int r = 0; r < R; r++) sums[j][f][r] = q4_pair_sum(lo, hi, xq[r] + 32 * at, ones);
                }
            }
            for (int f = 0; f < F; f++)
                for (int r = 0; r < R; r++) half[h][f][r] = _mm256_hadd_epi32(sums[0][f][r], sums[1][f][r]);
        }
        for (int f = 0; f < F; f++) {
            __m256 dw = load8_f16(d + f * dm_stride + b), mw = load8_f16(m + f * dm_stride + b);
            for (int r = 0; r < R; r++) {
                __m256i block_sums = _mm256_hadd_epi32(half[0][f][r], half[1][f][r]);  // [b0 b2 b4 b6 | b1 b3 b5 b7]
                __m256 scale = _mm256_permutevar8x32_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(xd[r] + b)), order);
                acc[f][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums), scale, acc[f][r]);
                macc[f][r] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(xs[r] + b), macc[f][r]);
            }
        }
    }
    // the last blocks % 8 blocks, a pair at a time: [b ×4 | b+1 ×4] lanes, minima on lanes 0 and 4
    const __m256i pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), min_lanes = _mm256_setr_epi32(0, 2, 2, 2, 1, 2, 2, 2);
    for (; b < blocks; b += 2) {
        for (int f = 0; f < F; f++) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(w + f * w_stride + 16 * b));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            int32_t d01, m01;  // the pair's two fp16 scales and minima -> [v0 v1 0 0]
            memcpy(&d01, d + f * dm_stride + b, 4);
            memcpy(&m01, m + f * dm_stride + b, 4);
            const __m128 dv = _mm_cvtph_ps(_mm_cvtsi32_si128(d01)), mv = _mm_cvtph_ps(_mm_cvtsi32_si128(m01));
            if (R > 1) {  // the same products, from scalars (measured faster with two rows)
                const float d0 = _mm_cvtss_f32(dv), d1 = _mm_cvtss_f32(_mm_movehdup_ps(dv));
                const float m0 = _mm_cvtss_f32(mv), m1 = _mm_cvtss_f32(_mm_movehdup_ps(mv));
                for (int r = 0; r < R; r++) {
                    __m256 scale = _mm256_set_m128(_mm_set1_ps(d1 * xd[r][b + 1]), _mm_set1_ps(d0 * xd[r][b]));
                    __m256 sums = _mm256_cvtepi32_ps(q4_pair_sum(lo, hi, xq[r] + 32 * b, ones));
                    acc[f][r] = _mm256_fmadd_ps(sums, scale, acc[f][r]);
                    __m256 mins = _mm256_setr_ps(m0 * xs[r][b], 0, 0, 0, m1 * xs[r][b + 1], 0, 0, 0);
                    macc[f][r] = _mm256_add_ps(macc[f][r], mins);
                }
                continue;
            }
            for (int r = 0; r < R; r++) {  // scale [d0 dx0 ×4 | d1 dx1 ×4]; minima on lanes 0 and 4, +0 elsewhere
                const __m128 xdv = _mm_castpd_ps(_mm_load_sd((const double*)(xd[r] + b)));
                const __m128 xsv = _mm_castpd_ps(_mm_load_sd((const double*)(xs[r] + b)));
                __m256 scale = _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(_mm_mul_ps(dv, xdv)), pair_lanes);
                __m256 sums = _mm256_cvtepi32_ps(q4_pair_sum(lo, hi, xq[r] + 32 * b, ones));
                acc[f][r] = _mm256_fmadd_ps(sums, scale, acc[f][r]);
                __m256 mins = _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(_mm_mul_ps(mv, xsv)), min_lanes);
                macc[f][r] = _mm256_add_ps(macc[f][r], mins);
            }
        }
    }
    for (int f = 0; f < F; f++)
        for (int r = 0; r < R; r++) out[f * R + r] = hsum8(_mm256_add_ps(acc[f][r], macc[f][r]));
#else
    for (int f = 0; f < F; f++) {
        const uint8_t* wf = w + f * w_stride;
        const uint16_t *df = d + f * dm_stride, *mf = m + f * dm_stride;
        for (int r = 0; r < R; r++) {
            float s = 0.0f, ms = 0.0f;
            for (int t = 0; t < blocks; t++) {
                const int8_t* x = xq[r] + 64 * (t / 2) + 16 * (t & 1);
                const uint8_t* q = wf + 16 * t;
                int32_t isum = 0;
                for (int i = 0; i < 16; i++) isum += (int32_t)(q[i] & 0x0F) * x[i] + (int32_t)(q[i] >> 4) * x[i + 32];
                s += (float)isum * (fp16_to_f32(df[t]) * xd[r][t]);
                ms += fp16_to_f32(mf[t]) * xs[r][t];
            }
            out[f * R + r] = s + ms;
        }
    }
#endif
}

#if SD_AVX2
// The value as computed here, in a register: the compiler may not regroup the integer sums
// across it. Left free, it sums the products of one activation row as they come and keeps
// the other rows' products for a tree at the end, which spills them for two or more rows.
#if SD_VNNI
static inline void pin(__m256i& v) { asm("" : "+v"(v)); }  // any of the 32 EVEX registers
#else
static inline void pin(__m256i& v) { asm("" : "+x"(v)); }
#endif

// Four activation codes, xq[4 i4 .. 4 i4 + 3], in every 32-bit lane: from the row's
// pre-broadcast table (linear_x8 builds one for a few rows: a load instead of a
// broadcast, which on Zen 1 takes an FP pipe beside the multiplies) or broadcast here.
// The same codes either way, so the sums are the same.
template <bool TABLE>
static inline __m256i act4(const int8_t* xq, const int32_t* xb, int64_t i4) {
    if (TABLE) return _mm256_load_si256((const __m256i*)(xb + 8 * i4));
    int32_t v;
    memcpy(&v, xq + 4 * i4, 4);
    return _mm256_set1_epi32(v);
}
#endif

// Q4_1X8 weights x Q8 activations (plain layout): 8 output rows against R activation
// rows, out[r * 8 + f]. Within a block, each 32-bit lane holds one weight row, so the
// activations are broadcast 4 at a time (act4) and the block's 32 products of a row add up in
// its lane: in int16 (at most 16 products of 15 x 127 per lane: 30,480, no overflow), then
// one widening to int32. No horizontal sums, and the 8 rows' scales convert in one
// instruction: on AVX2 cores without VNNI this takes about two thirds of the
// instructions of dot_q4_1 per weight. Each (row, feature) keeps the same arithmetic
// whatever R is: per block acc = fma(isum, d_w dx, acc) and macc = fma(m_w, sx, macc), then
// acc + macc.
// STRIDE 2 reads one group of a Q4_1X16 pair (its 32-byte runs 64 bytes apart, its blocks
// 256 bytes and its scales 16 apart) with the same arithmetic, for builds without the
// pairs' own kernels.
template <int R, bool TABLE, int STRIDE = 1>
static inline void dot_q4_1x8(const int8_t* const* xq, const int32_t* const* xb, const float* const* xd,
                              const float* const* xs, const uint8_t* w, const uint16_t* d, const uint16_t* m, int blocks,
                              float* out) {
#if SD_AVX2
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    // From 3 rows the min terms go in a loop of their own (the same FMAs in the same order),
    // which leaves the main loop R registers more; for 1 or 2 rows their serial FMAs would
    // cost more there than the registers gain.
    constexpr bool SPLIT = R > 2;
    __m256 acc[R], macc[R];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t* wb = w + 128 * STRIDE * b;
        // software prefetch 16 blocks ahead (a thread's weights are one stream; prefetching
        // past its end is harmless): one row from memory 72 -> 58 µs for gate/up, 39 -> 32 µs
        // for down on this machine's EPYC, where the hardware prefetcher alone left ~25% idle.
        // Non-temporal: a step's 100 MB of weights, each read once, then do not flush the
        // caches of what is reused (activations, the interpreter between steps): one token
        // 5.71 -> 5.37 ms at 100 tokens of context, 8.39 -> 8.15 at 1,500
        _mm_prefetch((const char*)(wb + SD_PREFETCH), _MM_HINT_NTA);
        _mm_prefetch((const char*)(wb + SD_PREFETCH + 64), _MM_HINT_NTA);
        if ((b & 3) == 0) {
            _mm_prefetch((const char*)(d + 8 * STRIDE * b + SD_PREFETCH / 16), _MM_HINT_NTA);
            _mm_prefetch((const char*)(m + 8 * STRIDE * b + SD_PREFETCH / 16), _MM_HINT_NTA);
        }
#if SD_VNNI
        // low and high nibbles in two chains of 4 vpdpbusd each, added at the end
        __m256i slo[R], shi[R];
        for (int r = 0; r < R; r++) slo[r] = shi[r] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 32 * STRIDE * i));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int r = 0; r < R; r++) {
                slo[r] = _mm256_dpbusd_epi32(slo[r], lo, act4<TABLE>(xq[r], xb[r], 8 * b + 2 * i));
                shi[r] = _mm256_dpbusd_epi32(shi[r], hi, act4<TABLE>(xq[r], xb[r], 8 * b + 2 * i + 1));
            }
        }
        (void)ones;  // AVX2's widening only
        const __m256 dw = load8_f16(d + 8 * STRIDE * b);
        for (int r = 0; r < R; r++) {
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_add_epi32(slo[r], shi[r]));
#else
        __m256i s16[R];
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 32 * STRIDE * i));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, act4<TABLE>(xq[r], xb[r], 8 * b + 2 * i)),
                                                   _mm256_maddubs_epi16(hi, act4<TABLE>(xq[r], xb[r], 8 * b + 2 * i + 1)));
                s16[r] = i == 0 ? p : _mm256_add_epi16(s16[r], p);
                pin(s16[r]);
            }
        }
        const __m256 dw = load8_f16(d + 8 * STRIDE * b);
        for (int r = 0; r < R; r++) {
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));
#endif
            acc[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_set1_ps(xd[r][b])), acc[r]);
        }
        if (!SPLIT) {
            const __m256 mw = load8_f16(m + 8 * STRIDE * b);
            for (int r = 0; r < R; r++) macc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r][b]), macc[r]);
        }
    }
    for (int b = 0; SPLIT && b < blocks; b++) {
        const __m256 mw = load8_f16(m + 8 * STRIDE * b);
        for (int r = 0; r < R; r++) macc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r][b]), macc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], macc[r]));
#else
    (void)xb;  // the portable code reads the codes themselves
    for (int r = 0; r < R; r++)
        for (int f = 0; f < 8; f++) {
            float s = 0.0f, ms = 0.0f;
            for (int b = 0; b < blocks; b++) {
                const uint8_t* wb = w + 128 * STRIDE * b + 4 * f;
                const int8_t* x = xq[r] + 32 * b;
                int32_t isum = 0;
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++)
                        isum += (int32_t)(wb[32 * STRIDE * i + t] & 0x0F) * x[8 * i + t] +
                                (int32_t)(wb[32 * STRIDE * i + t] >> 4) * x[8 * i + 4 + t];
                s = fmaf((float)isum, fp16_to_f32(d[8 * STRIDE * b + f]) * xd[r][b], s);
                ms = fmaf(fp16_to_f32(m[8 * STRIDE * b + f]), xs[r][b], ms);
            }
            out[8 * r + f] = s + ms;
        }
#endif
}

// Q4_1X8, two adjacent groups (16 output rows) against R activation rows on AVX2 without
// VNNI: out[16 r + f], f < 8 from group g (w0, d0, m0), f >= 8 from group g + 1. One pass
// of the block loop and one call serve both groups (their prefetches, scale loads and
// addresses); the activation codes are still loaded once per maddubs (the compiler folds
// them into it; pinning them in registers for both groups spilled and ran slower). These
// cores retire about two 256-bit integer ops per cycle here (a loop of independent
// vpaddw: 5.6 G/s at ~3 GHz), and the one-group tiles already ran at about 20 ops per
// 256 products, so this gains only where the loop's own work showed (many rows). Every
// lane does what dot_q4_1x8 does for its (row, feature): the same int16 then int32 sums,
// then the same float operations in the same order, so a row's outputs are the same bits.
#if SD_AVX2 && !SD_VNNI
template <int R, bool TABLE>
static inline void dot_q4_1x8x2(const int8_t* const* xq, const int32_t* const* xb, const float* const* xd,
                                const float* const* xs, const uint8_t* w0, const uint8_t* w1, const uint16_t* d0,
                                const uint16_t* d1, const uint16_t* m0, const uint16_t* m1, int blocks, float* out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc0[R], acc1[R];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *a = w0 + 128 * b, *c = w1 + 128 * b;
        _mm_prefetch((const char*)(a + SD_PREFETCH), _MM_HINT_NTA);
        _mm_prefetch((const char*)(a + SD_PREFETCH + 64), _MM_HINT_NTA);
        _mm_prefetch((const char*)(c + SD_PREFETCH), _MM_HINT_NTA);
        _mm_prefetch((const char*)(c + SD_PREFETCH + 64), _MM_HINT_NTA);
        if ((b & 3) == 0) {
            _mm_prefetch((const char*)(d0 + 8 * b + SD_PREFETCH / 16), _MM_HINT_NTA);
            _mm_prefetch((const char*)(d1 + 8 * b + SD_PREFETCH / 16), _MM_HINT_NTA);
            _mm_prefetch((const char*)(m0 + 8 * b + SD_PREFETCH / 16), _MM_HINT_NTA);
            _mm_prefetch((const char*)(m1 + 8 * b + SD_PREFETCH / 16), _MM_HINT_NTA);
        }
        __m256i s0[R], s1[R];
        for (int i = 0; i < 4; i++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i*)(a + 32 * i));
            const __m256i v1 = _mm256_loadu_si256((const __m256i*)(c + 32 * i));
            const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
            const __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
            for (int r = 0; r < R; r++) {
                const __m256i x0 = act4<TABLE>(xq[r], xb[r], 8 * b + 2 * i);
                const __m256i x1 = act4<TABLE>(xq[r], xb[r], 8 * b + 2 * i + 1);
                const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1));
                const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0), _mm256_maddubs_epi16(hi1, x1));
                s0[r] = i == 0 ? p0 : _mm256_add_epi16(s0[r], p0);
                s1[r] = i == 0 ? p1 : _mm256_add_epi16(s1[r], p1);
                pin(s0[r]);
                pin(s1[r]);
            }
        }
        const __m256 dw0 = load8_f16(d0 + 8 * b), dw1 = load8_f16(d1 + 8 * b);
        for (int r = 0; r < R; r++) {
            const __m256 dx = _mm256_set1_ps(xd[r][b]);
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0[r], ones)), _mm256_mul_ps(dw0, dx), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1[r], ones)), _mm256_mul_ps(dw1, dx), acc1[r]);
        }
    }
    // the min terms, in a loop of their own as dot_q4_1x8 keeps them from 3 rows (for 1 or
    // 2 rows it adds them inside its block loop: the same FMAs in the same order)
    __m256 macc0[R], macc1[R];
    for (int r = 0; r < R; r++) macc0[r] = macc1[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const __m256 mw0 = load8_f16(m0 + 8 * b), mw1 = load8_f16(m1 + 8 * b);
        for (int r = 0; r < R; r++) {
            const __m256 sx = _mm256_set1_ps(xs[r][b]);
            macc0[r] = _mm256_fmadd_ps(mw0, sx, macc0[r]);
            macc1[r] = _mm256_fmadd_ps(mw1, sx, macc1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out + 16 * r, _mm256_add_ps(acc0[r], macc0[r]));
        _mm256_storeu_ps(out + 16 * r + 8, _mm256_add_ps(acc1[r], macc1[r]));
    }
}
#endif

#if SD_VNNI512
// One block of 16 weight rows (lanes 0-7 one group's rows, 8-15 the next group's) against
// R activation rows: `load(i)` gives the block's 32-byte runs i of both groups in one
// register, `dw` the 16 rows' scales; acc[r] += isum * (dw * xd[r][b]) per lane, with the
// integer sums as dot_q4_1x8's (low and high nibbles in two chains of 4 vpdpbusd).
template <int R, typename Load>
static inline void q4_1_block16(Load load, __m512 dw, const int8_t* const* xq, const float* const* xd, int b,
                                __m512* acc) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i slo[R], shi[R];
    for (int r = 0; r < R; r++) slo[r] = shi[r] = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        const __m512i v = load(i);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; r++) {
            int32_t x0, x1;
            memcpy(&x0, xq[r] + 4 * (8 * b + 2 * i), 4);
            memcpy(&x1, xq[r] + 4 * (8 * b + 2 * i + 1), 4);
            slo[r] = _mm512_dpbusd_epi32(slo[r], lo, _mm512_set1_epi32(x0));
            shi[r] = _mm512_dpbusd_epi32(shi[r], hi, _mm512_set1_epi32(x1));
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(slo[r], shi[r]));
        acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, _mm512_set1_ps(xd[r][b])), acc[r]);
    }
}
#endif

// Q4_1X8, two adjacent groups (16 output rows) against R activation rows in 512-bit
// registers: out[16 r + f], f < 8 from group g (w0, d0, m0), f >= 8 from group g + 1.
// Each broadcast of 4 activation codes then feeds 16 weight rows instead of 8. At 8 rows
// the 256-bit kernel is bound by those broadcasts more than by vpdpbusd (with one
// broadcast shared by all rows, a wrong result but a timing, it ran twice as fast; an
// EVEX {1to8} operand in place of the separate broadcast gained nothing); on Zen 4 this
// gained 10% per linear layer from the caches, about 5% a step. Every lane does what
// dot_q4_1x8 does for its (row, feature): the same integer sums, then the same float
// operations in the same order, so a row's outputs are the same bits from either kernel.
#if SD_VNNI512
template <int R>
static inline void dot_q4_1x16(const int8_t* const* xq, const float* const* xd, const float* const* xs,
                               const uint8_t* w0, const uint8_t* w1, const uint16_t* d0, const uint16_t* d1,
                               const uint16_t* m0, const uint16_t* m1, int blocks, float* out) {
    __m512 acc[R], macc[R];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *a = w0 + 128 * b, *c = w1 + 128 * b;
        // as dot_q4_1x8's, 16 blocks ahead in both streams: past the last block that is the
        // next pair's (groups g + 2 and g + 3, one group further on), not group g + 1, which
        // this pair is reading already (prefetching there left the step from memory slower
        // than the 256-bit tiles')
        const int64_t ahead = SD_PREFETCH + (b + SD_PREFETCH / 128 >= blocks ? 128 * (int64_t)blocks : 0);
        _mm_prefetch((const char*)(a + ahead), _MM_HINT_NTA);
        _mm_prefetch((const char*)(a + ahead + 64), _MM_HINT_NTA);
        _mm_prefetch((const char*)(c + ahead), _MM_HINT_NTA);
        _mm_prefetch((const char*)(c + ahead + 64), _MM_HINT_NTA);
        if ((b & 3) == 0) {
            const int64_t scales = ahead / 16;  // 8 fp16 per 128-byte block
            _mm_prefetch((const char*)(d0 + scales), _MM_HINT_NTA);
            _mm_prefetch((const char*)(d1 + scales), _MM_HINT_NTA);
            _mm_prefetch((const char*)(m0 + scales), _MM_HINT_NTA);
            _mm_prefetch((const char*)(m1 + scales), _MM_HINT_NTA);
        }
        q4_1_block16<R>([&](int i) {
            return _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(a + 32 * i))),
                                      _mm256_loadu_si256((const __m256i*)(c + 32 * i)), 1);
        }, load16_f16(d0 + 8 * b, d1 + 8 * b), xq, xd, b, acc);
    }
    for (int b = 0; b < blocks; b++) {  // the min terms, as dot_q4_1x8's SPLIT loop
        const __m512 mw = load16_f16(m0 + 8 * b, m1 + 8 * b);
        for (int r = 0; r < R; r++) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r][b]), macc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(acc[r], macc[r]));
}
#endif

#if SD_VNNI512
// Q4_1X16: a pair of groups (16 output rows) against R <= 8 activation rows, out[16 r + f].
// One 512-bit load holds the pair's 16 rows of 4 weights (the layout puts the two groups'
// blocks side by side), so a thread's pairs are one stream of weights, scales and minima.
// Every lane does what dot_q4_1x8 does for its (row, feature): the same integer sums, then
// the same float operations in the same order (the min terms in a loop of their own from 3
// rows), so every output is the same bits as the 8-row layout's. Against the 8-row layout
// on Zen 4 (whole steps, scripts/layout_ab.py, four runs in different phases of the
// machine): T = 4 to 8 2-9% faster in 19 of 21 (context, T) cells (one even, one 4%
// slower), T = 1 to 3 between 4% faster and 10% slower, within the runs' noise
// (docs/performance.md). Pairs of separate groups (dot_q4_1x16) had been slower from
// memory below 8 rows: two streams per thread.
template <int R>
static inline void dot_q4_1x16i(const int8_t* const* xq, const float* const* xd, const float* const* xs,
                                const uint8_t* w, const uint16_t* d, const uint16_t* m, int blocks, float* out) {
    constexpr bool SPLIT = R > 2;  // as dot_q4_1x8's
    __m512 acc[R], macc[R];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t* wb = w + 256 * b;
        // as dot_q4_1x8's, as far ahead in bytes of the pair's stream (16 blocks of a pair
        // hold 32 of a group)
        for (int line = 0; line < 256; line += 64) _mm_prefetch((const char*)(wb + 2 * SD_PREFETCH + line), _MM_HINT_NTA);
        if ((b & 1) == 0) {
            _mm_prefetch((const char*)(d + 16 * b + SD_PREFETCH / 8), _MM_HINT_NTA);
            _mm_prefetch((const char*)(m + 16 * b + SD_PREFETCH / 8), _MM_HINT_NTA);
        }
        // lanes 0-7: group g's 32 bytes i of the block, lanes 8-15: group g + 1's
        q4_1_block16<R>([&](int i) { return _mm512_loadu_si512((const void*)(wb + 64 * i)); },
                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + 16 * b))), xq, xd, b, acc);
        if (!SPLIT) {
            const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + 16 * b)));
            for (int r = 0; r < R; r++) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r][b]), macc[r]);
        }
    }
    for (int b = 0; SPLIT && b < blocks; b++) {
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + 16 * b)));
        for (int r = 0; r < R; r++) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r][b]), macc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(acc[r], macc[r]));
}
#endif

// Q8_0X8 against R activation rows: out[8 r + f] = row r . weight row f of the group. As
// Q4_1X8, one weight row per 32-bit lane and the activations broadcast 4 at a time. Two
// int8 codes multiply in one of two ways, with the same exact integer sum:
// - ``offset`` (VNNI only, linear_x8 asks for it from SD_Q8_OFFSET_ROWS rows): the
//   activation codes come offset by 128 (unsigned, quantize_rows' offset layout) and
//   vpdpbusd multiplies them by the signed weights; the block's sum of the weights (one
//   more vpdpbusd per load, shared by the R rows) times 128 comes off at the end. Two
//   instructions per row and load fewer: 8 rows of the 49,152-row head 1.29 -> 0.93 ms on
//   Zen 4, 4 rows 0.69 -> 0.54 ms; for 2 and 3 rows it measured 2-5% slower, so they keep
//   the sign trick.
// - otherwise the sign trick (|w| times x with w's sign); without VNNI with a widening to
//   int32 per load, since two maddubs sums of up to 2 x 127 x 127 can overflow int16.
// Per (row, feature): acc = fma(isum, d_w dx, acc) per block, whatever R is. On AVX2 cores
// it takes about 0.6 of the instructions of dot_q8_0 per weight (no horizontal sums): the
// 49,152-row head of SmolLM2 from memory, 2 threads, 1.71 -> 1.25 ms on this EPYC.
#define SD_Q8_OFFSET_ROWS 4
template <int R, bool TABLE>
static inline void dot_q8_0x8(const int8_t* const* xq, const int32_t* const* xb, const float* const* xd, const int8_t* w,
                              const uint16_t* d, int blocks, bool offset, float* out) {
#if SD_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t* wb = w + 256 * b;
        for (int line = 0; line < 256; line += 64)  // as dot_q4_1x8's
            _mm_prefetch((const char*)(wb + 2 * SD_PREFETCH + line), _MM_HINT_NTA);
        if ((b & 3) == 0) _mm_prefetch((const char*)(d + 8 * b + SD_PREFETCH / 16), _MM_HINT_NTA);
        __m256i s32[R];
#if SD_VNNI
        if (offset) {
            const __m256i bytes1 = _mm256_set1_epi8(1);
            __m256i wsum = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 32 * i));
                wsum = _mm256_dpbusd_epi32(wsum, bytes1, v);
                for (int r = 0; r < R; r++) {
                    s32[r] = _mm256_dpbusd_epi32(i == 0 ? _mm256_setzero_si256() : s32[r],
                                                 act4<TABLE>(xq[r], xb[r], 8 * b + i), v);
                    pin(s32[r]);
                }
            }
            const __m256i correction = _mm256_slli_epi32(wsum, 7);  // sum (x + 128) w - 128 sum w = sum x w
            for (int r = 0; r < R; r++) s32[r] = _mm256_sub_epi32(s32[r], correction);
        } else {
            for (int i = 0; i < 8; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 32 * i));
                const __m256i magnitude = _mm256_sign_epi8(v, v);
                for (int r = 0; r < R; r++) {
                    const __m256i signed_x = _mm256_sign_epi8(act4<TABLE>(xq[r], xb[r], 8 * b + i), v);
                    s32[r] = _mm256_dpbusd_epi32(i == 0 ? _mm256_setzero_si256() : s32[r], magnitude, signed_x);
                    pin(s32[r]);
                }
            }
        }
        (void)ones;  // AVX2's widening only
#else
        (void)offset;
        for (int i = 0; i < 8; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 32 * i));
            const __m256i magnitude = _mm256_sign_epi8(v, v);
            for (int r = 0; r < R; r++) {
                const __m256i signed_x = _mm256_sign_epi8(act4<TABLE>(xq[r], xb[r], 8 * b + i), v);
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones);
                s32[r] = i == 0 ? p : _mm256_add_epi32(s32[r], p);
                pin(s32[r]);
            }
        }
#endif
        const __m256 dw = load8_f16(d + 8 * b);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[r][b])), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
#else
    (void)xb, (void)offset;  // the portable code reads the codes themselves (never offset)
    for (int r = 0; r < R; r++)
        for (int f = 0; f < 8; f++) {
            float s = 0.0f;
            for (int b = 0; b < blocks; b++) {
                const int8_t* wb = w + 256 * b + 4 * f;
                const int8_t* x = xq[r] + 32 * b;
                int32_t isum = 0;
                for (int i = 0; i < 8; i++)
                    for (int t = 0; t < 4; t++) isum += (int32_t)wb[32 * i + t] * x[4 * i + t];
                s = fmaf((float)isum, fp16_to_f32(d[8 * b + f]) * xd[r][b], s);
            }
            out[8 * r + f] = s;
        }
#endif
}

// ---------------------------------------------------------------------------------------
// linear: out[r, n] (+)= x[r, :] . w[n, :] (+ bias[n]), r < rows. Orphaned worksharing:
// inside a parallel region the output features are split over its threads.

#define SD_ROW_TILE 2

struct scratch_q {
    int8_t* xq;
    float* xd;
    float* xs;
    bool offset;  // xq holds codes + 128 (quantize_rows' offset layout; linear_x8 sets it)
};

// vals[f * R + r] = x[r0 + r] . w[n + f * step], f < F, r < R
template <int R, int F>
static inline void linear_tile(const sd_linear* L, const float* x, int64_t x_stride, const scratch_q& q, int64_t r0,
                               int n, int step, float* vals) {
    const int cols = L->cols, blocks = cols / 32;
    if (L->fmt == SD_Q4_1) {
        const int8_t* xr[R];
        const float *dr[R], *sr[R];
        for (int r = 0; r < R; r++)
            xr[r] = q.xq + (r0 + r) * cols, dr[r] = q.xd + (r0 + r) * blocks, sr[r] = q.xs + (r0 + r) * blocks;
        dot_q4_1<R, F>(xr, dr, sr, (const uint8_t*)L->w + (int64_t)n * cols / 2, L->d + (int64_t)n * blocks,
                       L->m + (int64_t)n * blocks, (int64_t)step * cols / 2, (int64_t)step * blocks, cols, vals);
        return;
    }
    if (L->fmt == SD_Q8_0) {
        const int8_t* xr[R];
        const float* dr[R];
        for (int r = 0; r < R; r++) xr[r] = q.xq + (r0 + r) * cols, dr[r] = q.xd + (r0 + r) * blocks;
        for (int f = 0; f < F; f++) {  // one weight row at a time: two spill registers on AVX2
            const int64_t row = n + (int64_t)f * step;
            dot_q8_0<R, 1>(xr, dr, (const int8_t*)L->w + row * cols, L->d + row * blocks, cols, blocks, cols, vals + f * R);
        }
        return;
    }
    for (int f = 0; f < F; f++) {
        float* v = vals + f * R;
        const int64_t row = n + (int64_t)f * step;
        switch (L->fmt) {
            case SD_F32: {
                const float* xr[R];
                for (int r = 0; r < R; r++) xr[r] = x + (r0 + r) * x_stride;
                SD_DOT_DENSE(R, float, load8_f32, scalar_f32)(xr, (const float*)L->w + row * cols, cols, v);
                break;
            }
            case SD_BF16: {
                const float* xr[R];
                for (int r = 0; r < R; r++) xr[r] = x + (r0 + r) * x_stride;
                SD_DOT_DENSE(R, uint16_t, load8_bf16, scalar_bf16)(xr, (const uint16_t*)L->w + row * cols, cols, v);
                break;
            }
        }
    }
}

static inline void store_out(const sd_linear* L, float* out, int64_t out_stride, int accumulate, int64_t r, int n,
                             float v) {
    if (L->bias) v += L->bias[n];
    float* dst = out + r * out_stride + n;
    *dst = accumulate ? *dst + v : v;
}

// activation rows r0 .. r0 + R - 1 of a tile: codes, their pre-broadcast table (or null),
// block scales and block sums
template <int R, bool TABLE>
struct tile_rows {
    const int8_t* xq[R];
    const int32_t* xb[R];
    const float *xd[R], *xs[R];
    tile_rows(const scratch_q& q, const int32_t* table, int64_t r0, int cols) {
        const int blocks = cols / 32;
        for (int r = 0; r < R; r++) {
            xq[r] = q.xq + (r0 + r) * cols, xd[r] = q.xd + (r0 + r) * blocks, xs[r] = q.xs + (r0 + r) * blocks;
            xb[r] = TABLE ? table + (r0 + r) * cols * 2 : nullptr;  // 8 int32 per 4 codes
        }
    }
};

// Q4_1X8 and Q8_0X8: one group of 8 output features against R activation rows
template <int R, bool TABLE>
static inline void linear_x8_tile(const sd_linear* L, const scratch_q& q, const int32_t* table, int64_t r0, int g,
                                  float* out, int64_t out_stride, int accumulate) {
    const int blocks = L->cols / 32;
    const tile_rows<R, TABLE> x(q, table, r0, L->cols);
    const int64_t at = (int64_t)g * blocks;
    float vals[8 * R];
    if (L->fmt == SD_Q4_1X8) {
        dot_q4_1x8<R, TABLE>(x.xq, x.xb, x.xd, x.xs, (const uint8_t*)L->w + 128 * at, L->d + 8 * at, L->m + 8 * at,
                             blocks, vals);
    } else if (L->fmt == SD_Q4_1X16) {  // group g of its pair, through the 8-row kernels
        const int64_t pair = (int64_t)(g / 2) * blocks, half = g % 2;
        dot_q4_1x8<R, TABLE, 2>(x.xq, x.xb, x.xd, x.xs, (const uint8_t*)L->w + 256 * pair + 32 * half,
                                L->d + 16 * pair + 8 * half, L->m + 16 * pair + 8 * half, blocks, vals);
    } else
        dot_q8_0x8<R, TABLE>(x.xq, x.xb, x.xd, (const int8_t*)L->w + 256 * at, L->d + 8 * at, blocks, q.offset, vals);
    for (int r = 0; r < R; r++)
        for (int f = 0; f < 8; f++) store_out(L, out, out_stride, accumulate, r0 + r, 8 * g + f, vals[8 * r + f]);
}

// The tiles of two or more rows are called, not inlined: inside one large function the
// register allocator spilled their sums and masks (2 tokens 9.0 -> 8.3 ms a step here). A
// call per group of 8 features costs nothing beside the 18-48 blocks each one reads.
template <int R, bool TABLE>
__attribute__((noinline)) static void linear_x8_rows(const sd_linear* L, const scratch_q& q, const int32_t* table,
                                                     int64_t r0, int g, float* out, int64_t out_stride, int accumulate) {
    linear_x8_tile<R, TABLE>(L, q, table, r0, g, out, out_stride, accumulate);
}

#if SD_AVX2 && !SD_VNNI
// Q4_1X8 groups g and g + 1 against R rows (dot_q4_1x8x2)
template <int R, bool TABLE>
__attribute__((noinline)) static void linear_x8x2_rows(const sd_linear* L, const scratch_q& q, const int32_t* table,
                                                       int64_t r0, int g, float* out, int64_t out_stride,
                                                       int accumulate) {
    const int blocks = L->cols / 32;
    const tile_rows<R, TABLE> x(q, table, r0, L->cols);
    const int64_t at = (int64_t)g * blocks, next = at + blocks;
    const uint8_t* w = (const uint8_t*)L->w;
    float vals[16 * R];
    dot_q4_1x8x2<R, TABLE>(x.xq, x.xb, x.xd, x.xs, w + 128 * at, w + 128 * next, L->d + 8 * at, L->d + 8 * next,
                           L->m + 8 * at, L->m + 8 * next, blocks, vals);
    for (int r = 0; r < R; r++)
        for (int f = 0; f < 16; f++) store_out(L, out, out_stride, accumulate, r0 + r, 8 * g + f, vals[16 * r + f]);
}
#endif

#if SD_VNNI512
// Q4_1X8 groups g and g + 1 against R rows (dot_q4_1x16)
template <int R>
__attribute__((noinline)) static void linear_x16_rows(const sd_linear* L, const scratch_q& q, int64_t r0, int g,
                                                      float* out, int64_t out_stride, int accumulate) {
    const int blocks = L->cols / 32;
    const tile_rows<R, false> x(q, nullptr, r0, L->cols);
    const int64_t at = (int64_t)g * blocks, next = at + blocks;
    const uint8_t* w = (const uint8_t*)L->w;
    float vals[16 * R];
    dot_q4_1x16<R>(x.xq, x.xd, x.xs, w + 128 * at, w + 128 * next, L->d + 8 * at, L->d + 8 * next, L->m + 8 * at,
                   L->m + 8 * next, blocks, vals);
    for (int r = 0; r < R; r++)
        for (int f = 0; f < 16; f++) store_out(L, out, out_stride, accumulate, r0 + r, 8 * g + f, vals[16 * r + f]);
}
#endif

#if SD_VNNI512
// Q4_1X16 pair p (groups 2p and 2p + 1) against R rows (dot_q4_1x16i)
template <int R>
__attribute__((noinline)) static void linear_x16i_rows(const sd_linear* L, const scratch_q& q, int64_t r0, int p,
                                                       float* out, int64_t out_stride, int accumulate) {
    const int blocks = L->cols / 32;
    const tile_rows<R, false> x(q, nullptr, r0, L->cols);
    const int64_t at = (int64_t)p * blocks;
    float vals[16 * R];
    dot_q4_1x16i<R>(x.xq, x.xd, x.xs, (const uint8_t*)L->w + 256 * at, L->d + 16 * at, L->m + 16 * at, blocks, vals);
    for (int r = 0; r < R; r++)
        for (int f = 0; f < 16; f++) store_out(L, out, out_stride, accumulate, r0 + r, 16 * p + f, vals[16 * r + f]);
}
#endif

// rows r.. of group g through the 256-bit tiles: eight rows at a time with VNNI (32 vector
// registers: 8 rows of a step 12.1 -> 9.5 ms on Zen 4), then 5-7 rows in one tile (a
// tile of 4 and one of 1-3 read the weights twice: whole steps at 100 tokens of context
// on Zen 4, T = 5 / 6 / 7 took 5.05 / 5.65 / ~5.9 ms beside 3.86 for T = 4 and 6.03 for
// T = 8), then four, then the 1-3 left
template <bool TABLE>
static inline void x8_rows_from(const sd_linear* L, const scratch_q& q, const int32_t* table, int64_t r, int64_t rows,
                                int g, float* out, int64_t out_stride, int accumulate) {
#if SD_VNNI
    for (; r + 8 <= rows; r += 8) linear_x8_rows<8, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
    switch (rows - r) {
        case 7: return linear_x8_rows<7, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
        case 6: return linear_x8_rows<6, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
        case 5: return linear_x8_rows<5, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
        default: break;
    }
#endif
    for (; r + 4 <= rows; r += 4) linear_x8_rows<4, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
    if (rows - r == 3) linear_x8_rows<3, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
    if (rows - r == 2) linear_x8_rows<2, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
    if (rows - r == 1) linear_x8_rows<1, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
}

// every group of 8 output features, split over the threads (one contiguous stream of
// weights per thread), the activation rows up to four (eight with VNNI) at a time: each
// row is computed the same way in every tile (integer sums, then the same float operations
// in the same order)
template <bool TABLE>
static inline void x8_groups(const sd_linear* L, const scratch_q& q, const int32_t* table, int64_t rows, float* out,
                             int64_t out_stride, int accumulate) {
    const int groups = L->rows / 8;
#if SD_VNNI512
    if (L->fmt == SD_Q4_1X16) {  // pairs of groups: 8 rows at a time, then the 1-7 left in one tile
#pragma omp for schedule(static)
        for (int p = 0; p < groups / 2; p++) {
            int64_t r = 0;
            for (; r + 8 <= rows; r += 8) linear_x16i_rows<8>(L, q, r, p, out, out_stride, accumulate);
            switch (rows - r) {
                case 7: linear_x16i_rows<7>(L, q, r, p, out, out_stride, accumulate); break;
                case 6: linear_x16i_rows<6>(L, q, r, p, out, out_stride, accumulate); break;
                case 5: linear_x16i_rows<5>(L, q, r, p, out, out_stride, accumulate); break;
                case 4: linear_x16i_rows<4>(L, q, r, p, out, out_stride, accumulate); break;
                case 3: linear_x16i_rows<3>(L, q, r, p, out, out_stride, accumulate); break;
                case 2: linear_x16i_rows<2>(L, q, r, p, out, out_stride, accumulate); break;
                case 1: linear_x16i_rows<1>(L, q, r, p, out, out_stride, accumulate); break;
                default: break;
            }
        }
        return;
    }
#endif
    if (rows == 1) {
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) linear_x8_tile<1, TABLE>(L, q, table, 0, g, out, out_stride, accumulate);
        return;
    }
#if SD_VNNI512
    // Q4_1X8 from 8 rows: pairs of groups in 512-bit registers, 8 rows at a time; the rows
    // left over (and an odd last group) go through the 256-bit tiles, group by group. The
    // same bits as the 256-bit tiles alone (SmolLM2's layers and head, 1-64 rows, 1 and 2
    // threads, checked). Zen 4, whole steps at 150 tokens of context, 2 threads: T = 8
    // 6.14 -> 5.94 ms, 16 12.25 -> 11.53, 64 52.4 -> 49.5. Tiles of 4 rows were faster
    // from the caches but slower from memory (T = 4 3.76 -> 4.24 ms), so 4 to 7 rows keep
    // the 256-bit tiles.
    if (L->fmt == SD_Q4_1X8 && rows >= 8) {
#pragma omp for schedule(static)
        for (int pair = 0; pair < (groups + 1) / 2; pair++) {
            const int g = 2 * pair;
            int64_t r = 0;
            if (g + 1 < groups) {
                for (; r + 8 <= rows; r += 8) linear_x16_rows<8>(L, q, r, g, out, out_stride, accumulate);
            }
            for (int h = g; h < g + 2 && h < groups; h++)
                x8_rows_from<TABLE>(L, q, table, r, rows, h, out, out_stride, accumulate);
        }
        return;
    }
#endif
#if SD_AVX2 && !SD_VNNI
    // From 16 rows (chunks of a prompt, large batches): pairs of groups, four rows at a
    // time, then the 1-3 rows left in one tile of the pair; an odd last group through the
    // one-group tiles. Whole steps on a Zen 3 (AVX2, 2 threads, scripts/step_ab.py, medians
    // of round minima), at 100 tokens of context: T = 16 20.7 -> 18.9 ms, 64 79.3 -> 69.6;
    // at 1,500: 36.4 -> 34.9, 142.3 -> 132.6. Below 16 rows, from memory, it was no faster
    // (T = 4 slower: two weight streams at once), so those keep the one-group tiles.
    if (L->fmt == SD_Q4_1X8 && rows >= SD_X2_ROWS) {
#pragma omp for schedule(static)
        for (int pair = 0; pair < (groups + 1) / 2; pair++) {
            const int g = 2 * pair;
            if (g + 1 == groups) {
                x8_rows_from<TABLE>(L, q, table, 0, rows, g, out, out_stride, accumulate);
                continue;
            }
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) linear_x8x2_rows<4, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
            if (rows - r == 3) linear_x8x2_rows<3, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
            if (rows - r == 2) linear_x8x2_rows<2, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
            if (rows - r == 1) linear_x8x2_rows<1, TABLE>(L, q, table, r, g, out, out_stride, accumulate);
        }
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) x8_rows_from<TABLE>(L, q, table, 0, rows, g, out, out_stride, accumulate);
}

static void linear_x8(const sd_linear* L, const float* x, int64_t rows, int64_t x_stride, float* out,
                      int64_t out_stride, int accumulate, const scratch_q& scratch) {
    const scratch_q q = {scratch.xq, scratch.xd, scratch.xs,
                         SD_VNNI && L->fmt == SD_Q8_0X8 && rows >= SD_Q8_OFFSET_ROWS};
    quantize_rows(x, rows, L->cols, x_stride, 0, q.xq, q.xd, q.xs, q.offset);  // ends with a barrier
#if SD_AVX2
    // A few rows: each thread broadcasts their codes into a table of its own (8x their size,
    // at most SD_ACT_TABLE bytes: it stays in L1/L2), which the kernels then load. The
    // regrouped layers are bound by their instructions on Zen 1, not by memory (the same
    // time with the weights in cache), and this takes the 8 broadcasts per block and row
    // off the vector pipes: one token 5.09 -> 4.82 ms at 100 tokens of context, 4 tokens
    // 16.7 -> 15.8 ms. With VNNI (Zen 4) the broadcasts from memory cost less than the
    // table's loads: 8 rows of gate/up 84 -> 64 µs without it.
    if (!SD_VNNI && rows * L->cols * 8 <= SD_ACT_TABLE) {
        alignas(32) int32_t table[SD_ACT_TABLE / 4];
        for (int64_t i = 0; i < rows * L->cols / 4; i++) {
            int32_t v;
            memcpy(&v, q.xq + 4 * i, 4);
            _mm256_store_si256((__m256i*)(table + 8 * i), _mm256_set1_epi32(v));
        }
        return x8_groups<true>(L, q, table, rows, out, out_stride, accumulate);
    }
#endif
    x8_groups<false>(L, q, nullptr, rows, out, out_stride, accumulate);
}

static void linear(const sd_linear* L, const float* x, int64_t rows, int64_t x_stride, float* out, int64_t out_stride,
                   int accumulate, const scratch_q& q) {
    if (L->fmt == SD_Q4_1X8 || L->fmt == SD_Q8_0X8 || L->fmt == SD_Q4_1X16) return linear_x8(L, x, rows, x_stride, out, out_stride, accumulate, q);
    if (L->fmt == SD_Q8_0 || L->fmt == SD_Q4_1)
        quantize_rows(x, rows, L->cols, x_stride, L->fmt == SD_Q4_1, q.xq, q.xd, q.xs);  // ends with a barrier
    const int features = L->rows;
    if (rows == 1) {
        // One row: two weight rows at a time (independent chains, shared activation loads),
        // taken from the two halves of this thread's share so that the weights are still
        // read as two long sequential streams (adjacent pairs measured 2x slower from DRAM).
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
        const int lo = (int)((int64_t)features * thread / threads), hi = (int)((int64_t)features * (thread + 1) / threads);
        const int half = (hi - lo) / 2;
        for (int i = 0; i < half; i++) {
            float vals[2];
            linear_tile<1, 2>(L, x, x_stride, q, 0, lo + i, half, vals);
            store_out(L, out, out_stride, accumulate, 0, lo + i, vals[0]);
            store_out(L, out, out_stride, accumulate, 0, lo + half + i, vals[1]);
        }
        if ((hi - lo) % 2) {
            float v;
            linear_tile<1, 1>(L, x, x_stride, q, 0, hi - 1, 1, &v);
            store_out(L, out, out_stride, accumulate, 0, hi - 1, v);
        }
#pragma omp barrier
        return;
    }
    const int64_t full = rows / SD_ROW_TILE * SD_ROW_TILE;
#pragma omp for schedule(static)
    for (int n = 0; n < features; n++) {
        float vals[SD_ROW_TILE];
        const float bias = L->bias ? L->bias[n] : 0.0f;
        for (int64_t r = 0; r < rows; r += SD_ROW_TILE) {
            const int tile = r < full ? SD_ROW_TILE : (int)(rows - r);
            if (tile == 2)
                linear_tile<2, 1>(L, x, x_stride, q, r, n, 1, vals);
            else
                linear_tile<1, 1>(L, x, x_stride, q, r, n, 1, vals);
            for (int t = 0; t < tile; t++) {
                float v = L->bias ? vals[t] + bias : vals[t];
                float* dst = out + (r + t) * out_stride + n;
                *dst = accumulate ? *dst + v : v;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// elementwise stages

// out row r at out + r * out_stride (an EAGLE head writes two norms side by side)
static void rms_norm(const float* x, const float* weight, int64_t rows, int cols, float eps, float* out,
                     int64_t out_stride) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float* v = x + r * cols;
        float* o = out + r * out_stride;
        float ss;
#if SD_AVX2
        __m256 acc = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= cols; k += 8) {
            __m256 t = _mm256_loadu_ps(v + k);
            acc = _mm256_fmadd_ps(t, t, acc);
        }
        ss = hsum8(acc);
        for (; k < cols; k++) ss += v[k] * v[k];
#else
        ss = 0.0f;
        for (int k = 0; k < cols; k++) ss += v[k] * v[k];
#endif
        float inv = 1.0f / sqrtf(ss / (float)cols + eps);
        for (int k = 0; k < cols; k++) o[k] = weight[k] * (v[k] * inv);
    }
}

static inline float silu_mul1(float g, float u) { return g / (1.0f + exp1(-g)) * u; }

static void silu_mul(const float* gate_up, int64_t rows, int inter, float* out) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        int k = 0;
#if SD_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
        for (; k + 8 <= inter; k += 8) {
            __m256 gv = _mm256_loadu_ps(g + k);
            __m256 den = _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, neg)));
            _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + k)));
        }
#endif
        for (; k < inter; k++) o[k] = silu_mul1(g[k], u[k]);
    }
}

static inline void store_kv(void* cache, int fmt, int64_t index, const float* src, int n) {
    if (fmt == SD_F32) {
        memcpy((float*)cache + index, src, sizeof(float) * n);
    } else if (fmt == SD_BF16) {
        uint16_t* dst = (uint16_t*)cache + index;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        uint16_t* dst = (uint16_t*)cache + index;
        for (int i = 0; i < n; i++) dst[i] = f32_to_fp16(src[i]);
    }
}

// RoPE (rotate-half convention) on q and k of every row, then k and v into the cache at
// slots starts[b] + t of cache row cache_rows[b]; positions[b * T + t].
static void rope_and_store(const sd_model* M, const sd_layer* L, float* qkv, int batch, int T, const int* starts,
                           const int* cache_rows, const int64_t* positions) {
    const int H = M->heads, G = M->kv_heads, D = M->head_dim, half = D / 2;
    const int width = (H + 2 * G) * D;
    const int64_t rows = (int64_t)batch * T;
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const int b = (int)(row / T), t = (int)(row % T);
        float* v = qkv + row * width;
        const int64_t pos = positions[row];
        const float* cs = M->rope_cos + pos * D;
        const float* sn = M->rope_sin + pos * D;
        for (int h = 0; h < H + G; h++) {
            float* x = v + h * D;
            float rotated[SD_MAX_HEAD_DIM];
            for (int i = 0; i < half; i++) {
                rotated[i] = x[i] * cs[i] - x[i + half] * sn[i];
                rotated[i + half] = x[i + half] * cs[i + half] + x[i] * sn[i + half];
            }
            memcpy(x, rotated, sizeof(float) * D);
        }
        for (int g = 0; g < G; g++) {
            int64_t slot = (((int64_t)cache_rows[b] * G + g) * M->capacity + starts[b] + t) * D;
            store_kv(L->k_cache, M->kv_fmt, slot, v + (H + g) * D, D);
            store_kv(L->v_cache, M->kv_fmt, slot, v + (H + G + g) * D, D);
        }
    }
}

// ---------------------------------------------------------------------------------------
// attention

static inline void load_row(const void* cache, int fmt, int64_t index, int D, float* out) {
    if (fmt == SD_F32) {
        memcpy(out, (const float*)cache + index, sizeof(float) * D);
        return;
    }
    const uint16_t* src = (const uint16_t*)cache + index;
    int i = 0;
#if SD_AVX2
    for (; i + 8 <= D; i += 8) _mm256_storeu_ps(out + i, fmt == SD_BF16 ? load8_bf16(src + i) : load8_f16(src + i));
#endif
    for (; i < D; i++) out[i] = fmt == SD_BF16 ? bf16_to_f32(src[i]) : fp16_to_f32(src[i]);
}

// Keys in "split" order (AVX2 builds): within each block of 16 elements, the 8 even ones
// then the 8 odd ones. A bf16 row converts to it with one AND and one shift per 16
// elements (a bf16 is the high half of its fp32), where widening in order costs a shuffle
// and a shift per 8, and on Zen 1 both compete with the FMAs for the same pipes. Queries
// are put in the same order, so a dot product is the same sum whichever path computes it;
// a tail of 8 elements (head_dim % 16 == 8) stays in order.
static inline void split_order(const float* x, int D, float* out) {
    int i = 0;
    for (; i + 16 <= D; i += 16)
        for (int l = 0; l < 8; l++) out[i + l] = x[i + 2 * l], out[i + 8 + l] = x[i + 2 * l + 1];
    for (; i < D; i++) out[i] = x[i];
}

#if SD_AVX2
static inline void load16_bf16_split(const uint16_t* p, __m256* even, __m256* odd) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xFFFF0000u)));
}

// the inverse of split order for 16 elements held as (even, odd): out[0..15] in order
static inline void store16_unsplit(__m256 even, __m256 odd, float* out) {
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif

// one cached key row as fp32 in split order
static inline void load_row_split(const void* cache, int fmt, int64_t index, int D, float* out) {
#if SD_AVX2
    if (fmt == SD_BF16) {
        const uint16_t* src = (const uint16_t*)cache + index;
        int i = 0;
        for (; i + 16 <= D; i += 16) {
            __m256 even, odd;
            load16_bf16_split(src + i, &even, &odd);
            _mm256_storeu_ps(out + i, even);
            _mm256_storeu_ps(out + i + 8, odd);
        }
        if (i < D) _mm256_storeu_ps(out + i, load8_bf16(src + i));
        return;
    }
#endif
    float row[SD_MAX_HEAD_DIM];
    load_row(cache, fmt, index, D, row);
    split_order(row, D, out);
}

static inline float dot_row(const float* a, const float* b, int D) {
#if SD_AVX2
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < D; i++) s += a[i] * b[i];
    return s;
#else
    float s = 0.0f;
    for (int i = 0; i < D; i++) s += a[i] * b[i];
    return s;
#endif
}

static inline void axpy(float a, const float* x, float* y, int D) {
    int i = 0;
#if SD_AVX2
    __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= D; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < D; i++) y[i] = fmaf(a, x[i], y[i]);
}

// The visible keys of row t, in order: every cached slot before `start`, then the new
// tokens t may see (its tree-mask row, or t' <= t). The n-th visible key sits at slot
// n if n < start, else at start + new_index[n - start].
static inline int visible_new(int T, int t, const uint8_t* mask, int* new_index) {
    int count = 0;
    for (int j = 0; j < T; j++)
        if (mask ? mask[(int64_t)t * T + j] : j <= t) new_index[count++] = j;
    return count;
}

#define SD_KEY_TILE 32  // keys converted to fp32 at a time (8 KB at head_dim 64: stays in L1)

#if SD_AVX2
// dot products of q with 8 key rows (fp32, row stride D), each reduced across lanes by the
// same tree whatever the other 7 keys are: [q.k0, ..., q.k7]
static inline __m256 dot8_keys(const float* q, const float* keys, int D) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + j * D + i), a[j]);
    }
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);  // [k0..k3 | k0..k3], [k4..k7 | ..]
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif

// fp32 copies of `count` visible key (or value) rows starting at visible index `first`.
// Each row read prefetches the row 32 slots on, by address (usually the next tile's or the
// next chunk's row; near the end of the cached keys a new token's, an unused slot's or one
// past the cache: computed as an integer, and a prefetch never faults). The tiles of
// several rows lacked it: `perf` put the most samples of the tile path on these loads when
// the cache came from memory. Whole steps, scripts/step_ab.py, minimum of 6 rounds on a
// Zen 3: T = 4 / 8 at 1,500 tokens of context 16.38 -> 15.75 / 24.16 -> 22.81 ms, at 4,000
// 24.45 -> 22.81 / 50.45 -> 47.07 (medians 0.5-4% lower).
static inline void gather_rows(const void* cache, int fmt, int64_t base, int start, const int* new_index, int first,
                               int count, int D, float* out, bool split) {
    const int row_bytes = D * (fmt == SD_F32 ? 4 : 2);
    for (int n = 0; n < count; n++) {
        const int visible_index = first + n;
        const int64_t slot = visible_index < start ? visible_index : start + new_index[visible_index - start];
        const uintptr_t ahead = (uintptr_t)cache + (uintptr_t)((base + slot + 32) * row_bytes);
        for (int line = 0; line < row_bytes; line += 64) __builtin_prefetch((const void*)(ahead + line), 0, 3);
        if (split)
            load_row_split(cache, fmt, (base + slot) * D, D, out + (int64_t)n * D);
        else
            load_row(cache, fmt, (base + slot) * D, D, out + (int64_t)n * D);
    }
}

// Score rows that see the same keys of a chunk share its fp32 key and value tiles: every
// chunk wholly before `start` (cached keys, which all new rows see), up to SD_SCORE_ROWS
// query heads at a time. Sharing changes only how often a tile is converted, never the
// arithmetic of a row, which is the same for one row alone.
#define SD_SCORE_ROWS 48

#if SD_AVX2
// The softmax of one head's scores over a chunk: s[n] <- exp(s[n] - max); writes the
// partial's max and sum. Shared by both chunk paths below.
static inline void chunk_softmax(float* s, int count, float* partial) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int n = 0;
    for (; n + 8 <= count; n += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + n));
    float mx = hmax8(mv);
    for (int i = n; i < count; i++) mx = s[i] > mx ? s[i] : mx;
    __m256 sv = _mm256_setzero_ps(), mxv = _mm256_set1_ps(mx);
    for (n = 0; n + 8 <= count; n += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + n), mxv));
        _mm256_storeu_ps(s + n, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum8(sv);
    for (; n < count; n++) {
        s[n] = exp1(s[n] - mx);
        sum += s[n];
    }
    partial[0] = mx;
    partial[1] = sum;
}

// One chunk for NH <= 3 query heads (one score row of a GQA model; with 32 vector
// registers up to 6, two rows of SmolLM2: 2 tokens at 4,000 of context 9.8 -> 8.4 ms a step
// on Zen 4) over a bf16 cache at head_dim 64, reading keys and values straight from the
// cache: each key and value row is widened once, in registers, for all NH heads (the tile
// path below converts a tile to fp32 in memory and reads it once per head). The
// arithmetic per (head, key) is the tile
// path's, operation for operation: the same FMA chains, the same reduction tree as
// dot8_keys (its lanes 0-3), the output accumulated key by key in order. Tests compare
// the two paths bit for bit (a row alone here, the same row among others on the tile path);
// with 32 registers every bf16 chunk at head_dim 64 comes here, and the tests compare the
// groupings of heads instead (1 to 6 at a time).
template <int NH>
static void attend_chunk_direct(const sd_model* M, const sd_layer* L, const float* const* q, float* const* out_partials,
                                int64_t base, int start, const int* new_index, int first, int count) {
    const uint16_t* kc = (const uint16_t*)L->k_cache;
    const uint16_t* vc = (const uint16_t*)L->v_cache;
    static const uint16_t zeros[64] = {0};
    float scores[NH][SD_KEY_CHUNK + 8];
    const __m256 attn_scale = _mm256_set1_ps(M->attn_scale);
    // the chunk's key and value rows, then zero rows for the last group of 4 and for
    // prefetching past the end
    const uint16_t* krow[SD_KEY_CHUNK + 20];
    const uint16_t* vrow[SD_KEY_CHUNK + 12];
    for (int n = 0; n < count; n++) {
        const int visible_index = first + n;
        const int64_t slot = visible_index < start ? visible_index : start + new_index[visible_index - start];
        krow[n] = kc + (base + slot) * 64;
        vrow[n] = vc + (base + slot) * 64;
    }
    for (int n = count; n < count + 20; n++) krow[n] = zeros;
    for (int n = count; n < count + 12; n++) vrow[n] = zeros;
    for (int n = 0; n < count; n += 4) {
        __m256 a[NH][4];
        const uint16_t* const* k = krow + n;
        for (int j = 0; j < 4; j++) {  // the keys 16 ahead, and these keys' values for the second pass
            _mm_prefetch((const char*)krow[n + 16 + j], _MM_HINT_T0);
            _mm_prefetch((const char*)krow[n + 16 + j] + 64, _MM_HINT_T0);
            _mm_prefetch((const char*)vrow[n + j], _MM_HINT_T1);
            _mm_prefetch((const char*)vrow[n + j] + 64, _MM_HINT_T1);
        }
        for (int h = 0; h < NH; h++)
            for (int j = 0; j < 4; j++) a[h][j] = _mm256_setzero_ps();
        for (int i = 0; i < 64; i += 16)  // q in split order (attend_chunk), read from L1 by each FMA
            for (int j = 0; j < 4; j++) {
                __m256 even, odd;
                load16_bf16_split(k[j] + i, &even, &odd);
                for (int h = 0; h < NH; h++) a[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i), even, a[h][j]);
                for (int h = 0; h < NH; h++) a[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i + 8), odd, a[h][j]);
            }
        for (int h = 0; h < NH; h++) {
            __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
            __m128 dots = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
            _mm_storeu_ps(scores[h] + n, _mm_mul_ps(dots, _mm256_castps256_ps128(attn_scale)));
        }
    }
    for (int h = 0; h < NH; h++) chunk_softmax(scores[h], count, out_partials[h]);
    // The outputs, key by key in order: with 32 vector registers all 64 elements of the NH
    // heads in one pass over the values, prefetched 8 keys ahead (4,000 tokens of context:
    // a step 7.4 -> 6.6 ms on Zen 4), else 32 at a time in two. With 16 registers three
    // heads take 16 at a time in four: 32 at a time held 12 sums, 4 value vectors and the
    // broadcast score in 17 registers, one sum was spilled, and its store and reload each
    // key became the loop's critical path (perf on a Zen 3: 30% of the kernel's samples on
    // that store). There the first pass also prefetches the value rows 16 keys ahead: the
    // keys' pass did not keep them close enough (samples piled on the value loads). Attention
    // alone, 30 layers, one token, Zen 3: 4.69 -> 3.79 ms at 1,500 tokens of context, 10.82
    // -> 9.10 at 4,000 (scripts/attention_ab.py, the two builds alternating).
    constexpr int HALF = SD_AVX512 && NH <= 3 ? 64 : !SD_AVX512 && NH == 3 ? 16 : 32;
    for (int half = 0; half < 64; half += HALF) {
        constexpr int C = HALF / 8;
        __m256 o[NH][C];
        for (int h = 0; h < NH; h++)
            for (int c = 0; c < C; c++) o[h][c] = _mm256_setzero_ps();
        for (int n = 0; n < count; n++) {  // o[h]: elements (even, odd) of 16, C / 2 times
            if (SD_AVX512) {  // measured on Zen 4 only
                _mm_prefetch((const char*)vrow[n + 8] + 2 * half, _MM_HINT_T0);
                if (C == 8) _mm_prefetch((const char*)vrow[n + 8] + 64, _MM_HINT_T0);
            } else if (NH == 3 && half == 0) {  // by address (integers: it may point past the cache)
                const uintptr_t ahead = (uintptr_t)vrow[n] + 16 * 64 * sizeof(uint16_t);
                _mm_prefetch((const char*)ahead, _MM_HINT_T0);
                _mm_prefetch((const char*)(ahead + 64), _MM_HINT_T0);
            }
            const uint16_t* v = vrow[n] + half;
            __m256 vv[C];
            for (int c = 0; c < C; c += 2) load16_bf16_split(v + 8 * c, &vv[c], &vv[c + 1]);
            for (int h = 0; h < NH; h++) {
                __m256 pv = _mm256_set1_ps(scores[h][n]);
                for (int c = 0; c < C; c++) o[h][c] = _mm256_fmadd_ps(pv, vv[c], o[h][c]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int c = 0; c < C; c += 2) store16_unsplit(o[h][c], o[h][c + 1], out_partials[h] + 2 + half + 8 * c);
    }
}
#endif

// One chunk of keys for the query heads of one KV head, for n_rows score rows that see the
// same keys in it: partial (max, sum, output) per row and head, layout [max, sum, out[D]].
// Per key and head the arithmetic is fixed: the score by dot8_keys' tree (a tail tile is
// padded with zero rows), the exponentials 8 at a time, the output accumulated key by key
// in order.
static void attend_chunk(const sd_model* M, const sd_layer* L, const float* const* qkv_rows, float* const* partials,
                         int n_rows, int b, int g, int start, const int* new_index, int chunk, int visible) {
    const int D = M->head_dim, H = M->heads, G = M->kv_heads, per = H / G;
    const int first = chunk * SD_KEY_CHUNK;
    const int count = visible - first < SD_KEY_CHUNK ? visible - first : SD_KEY_CHUNK;
    const int64_t base = ((int64_t)b * G + g) * M->capacity;
    const int heads = n_rows * per;  // <= SD_SCORE_ROWS
    float scores[SD_SCORE_ROWS][SD_KEY_CHUNK + 8];
    float rows[SD_KEY_TILE * SD_MAX_HEAD_DIM];
    const float* q[SD_SCORE_ROWS];
#if SD_AVX2
    float q_split[SD_SCORE_ROWS][SD_MAX_HEAD_DIM];  // the keys' split order
#endif
    for (int r = 0; r < n_rows; r++)
        for (int h = 0; h < per; h++) {
            q[r * per + h] = qkv_rows[r] + (g * per + h) * D;
#if SD_AVX2
            split_order(q[r * per + h], D, q_split[r * per + h]);
            q[r * per + h] = q_split[r * per + h];
#endif
        }
#if SD_AVX2
    if (M->kv_fmt == SD_BF16 && D == 64 && (SD_AVX512 || heads <= 3)) {
        float* outs[SD_SCORE_ROWS];
        for (int h = 0; h < heads; h++) outs[h] = partials[h / per] + (int64_t)(h % per) * (D + 2);
#if SD_AVX512
        // more heads in groups of 6, each group reading the chunk's rows again (from L2): 4
        // tokens at 4,000 of context 17.3 -> 14.2 ms a step on Zen 4, prefill unchanged
        if (heads > 3) {
            for (int h0 = 0; h0 < heads; h0 += 6) {
                const int n = heads - h0 < 6 ? heads - h0 : 6;
                if (n == 6)
                    attend_chunk_direct<6>(M, L, q + h0, outs + h0, base, start, new_index, first, count);
                else if (n == 5)
                    attend_chunk_direct<5>(M, L, q + h0, outs + h0, base, start, new_index, first, count);
                else if (n == 4)
                    attend_chunk_direct<4>(M, L, q + h0, outs + h0, base, start, new_index, first, count);
                else if (n == 3)
                    attend_chunk_direct<3>(M, L, q + h0, outs + h0, base, start, new_index, first, count);
                else if (n == 2)
                    attend_chunk_direct<2>(M, L, q + h0, outs + h0, base, start, new_index, first, count);
                else
                    attend_chunk_direct<1>(M, L, q + h0, outs + h0, base, start, new_index, first, count);
            }
            return;
        }
#endif
        if (heads == 3)
            attend_chunk_direct<3>(M, L, q, outs, base, start, new_index, first, count);
        else if (heads == 2)
            attend_chunk_direct<2>(M, L, q, outs, base, start, new_index, first, count);
        else
            attend_chunk_direct<1>(M, L, q, outs, base, start, new_index, first, count);
        return;
    }
#endif
    for (int tile = 0; tile < count; tile += SD_KEY_TILE) {
        const int n_tile = count - tile < SD_KEY_TILE ? count - tile : SD_KEY_TILE;
        gather_rows(L->k_cache, M->kv_fmt, base, start, new_index, first + tile, n_tile, D, rows, SD_AVX2);
        const int padded = (n_tile + 7) / 8 * 8;
        memset(rows + (int64_t)n_tile * D, 0, sizeof(float) * D * (padded - n_tile));
        for (int h = 0; h < heads; h++) {
#if SD_AVX2
            for (int n = 0; n < padded; n += 8)
                _mm256_storeu_ps(scores[h] + tile + n,
                                 _mm256_mul_ps(dot8_keys(q[h], rows + (int64_t)n * D, D), _mm256_set1_ps(M->attn_scale)));
#else
            for (int n = 0; n < n_tile; n++) scores[h][tile + n] = dot_row(q[h], rows + (int64_t)n * D, D) * M->attn_scale;
#endif
        }
    }
    for (int h = 0; h < heads; h++) {
        float* p = partials[h / per] + (int64_t)(h % per) * (D + 2);
#if SD_AVX2
        chunk_softmax(scores[h], count, p);
#else
        float* s = scores[h];
        float mx = -INFINITY, sum = 0.0f;
        for (int i = 0; i < count; i++) mx = s[i] > mx ? s[i] : mx;
        for (int n = 0; n < count; n++) {
            s[n] = exp1(s[n] - mx);
            sum += s[n];
        }
        p[0] = mx;
        p[1] = sum;
#endif
        memset(p + 2, 0, sizeof(float) * D);
    }
    for (int tile = 0; tile < count; tile += SD_KEY_TILE) {
        const int n_tile = count - tile < SD_KEY_TILE ? count - tile : SD_KEY_TILE;
        gather_rows(L->v_cache, M->kv_fmt, base, start, new_index, first + tile, n_tile, D, rows, false);
        for (int h = 0; h < heads; h++) {
            float* out = partials[h / per] + (int64_t)(h % per) * (D + 2) + 2;
            const float* s = scores[h] + tile;
#if SD_AVX2
            if (D == 64) {  // the output row stays in registers across the tile
                __m256 o[8];
                for (int i = 0; i < 8; i++) o[i] = _mm256_loadu_ps(out + 8 * i);
                for (int n = 0; n < n_tile; n++) {
                    __m256 pv = _mm256_set1_ps(s[n]);
                    for (int i = 0; i < 8; i++) o[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(rows + n * 64 + 8 * i), o[i]);
                }
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + 8 * i, o[i]);
                continue;
            }
#endif
            for (int n = 0; n < n_tile; n++) axpy(s[n], rows + (int64_t)n * D, out, D);
        }
    }
}

// out[row, h*D:(h+1)*D] for rows [row0, row0 + rows); partials: rows x G x chunks x per x (D+2)
static void attention_rows(const sd_model* M, const sd_layer* L, const float* qkv, int batch, int T, const int* starts,
                           const int* cache_rows, int max_start, const uint8_t* mask, int64_t row0, int64_t rows,
                           float* out) {
    const int D = M->head_dim, H = M->heads, G = M->kv_heads, per = H / G;
    const int width = (H + 2 * G) * D;
    const int max_chunks = (max_start + T + SD_KEY_CHUNK - 1) / SD_KEY_CHUNK;
    const int64_t stride = (int64_t)per * (D + 2);
    // work items: (group of up to `group` consecutive rows, KV head, chunk); a group's rows
    // of one sequence share the chunks they all see whole
    const int group = SD_SCORE_ROWS / per;
    const int64_t groups = (rows + group - 1) / group;
    const int64_t items = groups * G * max_chunks;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t first_row = item / ((int64_t)G * max_chunks) * group;
        const int g = (int)(item / max_chunks % G), chunk = (int)(item % max_chunks);
        const int64_t end_row = first_row + group < rows ? first_row + group : rows;
        for (int64_t i = first_row; i < end_row;) {
            const int b = (int)((row0 + i) / T);
            int64_t run_end = i + 1;  // rows of the same sequence
            while (run_end < end_row && (row0 + run_end) / T == b) run_end++;
            const int start = starts[b], cache_row = cache_rows[b];
            const float* qkv_rows[SD_SCORE_ROWS];
            float* partials[SD_SCORE_ROWS];
            int new_index[512];
            if ((chunk + 1) * SD_KEY_CHUNK <= start) {  // cached keys only: every row sees them all
                const int n = (int)(run_end - i);
                for (int r = 0; r < n; r++) {
                    qkv_rows[r] = qkv + (row0 + i + r) * width;
                    partials[r] = M->partial + (((i + r) * G + g) * max_chunks + chunk) * stride;
                }
                attend_chunk(M, L, qkv_rows, partials, n, cache_row, g, start, new_index, chunk, start);
            } else {
                for (int64_t r = i; r < run_end; r++) {
                    const int t = (int)((row0 + r) % T);
                    const int visible = start + visible_new(T, t, mask, new_index);
                    if (chunk * SD_KEY_CHUNK >= visible) continue;
                    qkv_rows[0] = qkv + (row0 + r) * width;
                    partials[0] = M->partial + ((r * G + g) * max_chunks + chunk) * stride;
                    attend_chunk(M, L, qkv_rows, partials, 1, cache_row, g, start, new_index, chunk, visible);
                }
            }
            i = run_end;
        }
    }
    // combine the chunks of each (row, head) in chunk order
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < rows * H; rh++) {
        const int64_t row = row0 + rh / H;
        const int h = (int)(rh % H), g = h / per, hg = h % per;
        const int t = (int)(row % T);
        int new_index[512];
        const int visible = starts[row / T] + visible_new(T, t, mask, new_index);
        const int chunks = (visible + SD_KEY_CHUNK - 1) / SD_KEY_CHUNK;
        const float* first = M->partial + ((rh / H) * G + g) * max_chunks * stride + hg * (D + 2);
        float mx = -INFINITY;
        for (int c = 0; c < chunks; c++) mx = first[c * stride] > mx ? first[c * stride] : mx;
        float acc[SD_MAX_HEAD_DIM] = {0};
        float sum = 0.0f;
        for (int c = 0; c < chunks; c++) {
            const float* p = first + c * stride;
            float w = exp1(p[0] - mx);
            sum += w * p[1];
            axpy(w, p + 2, acc, D);
        }
        float inv = 1.0f / sum;
        float* o = out + row * H * D + h * D;
        for (int i = 0; i < D; i++) o[i] = acc[i] * inv;
    }
}

static void attention(const sd_model* M, const sd_layer* L, const float* qkv, int batch, int T, const int* starts,
                      const int* cache_rows, const uint8_t* mask, float* out) {
    const int64_t rows = (int64_t)batch * T;
    int max_start = 0;
    for (int b = 0; b < batch; b++) max_start = starts[b] > max_start ? starts[b] : max_start;
    const int max_chunks = (max_start + T + SD_KEY_CHUNK - 1) / SD_KEY_CHUNK;
    const int64_t per_row = (int64_t)M->kv_heads * max_chunks;
    int64_t group = M->partial_items / (per_row > 0 ? per_row : 1);
    if (group < 1) group = 1;
    for (int64_t row0 = 0; row0 < rows; row0 += group)
        attention_rows(M, L, qkv, batch, T, starts, cache_rows, max_start, mask, row0,
                       rows - row0 < group ? rows - row0 : group, out);
}

// ---------------------------------------------------------------------------------------
// entry points

// Attention for rows that see an explicit set of cache slots (an EAGLE head's tree passes):
// row t (at slot start + t) sees slots [0, prefix) and each slot prefix + j, j < start + T -
// prefix, with visible[t (start + T - prefix) + j] set. fp32 cache, batch row 0; one pass
// over the keys with a running maximum. Only drafts use it, so it need not match attention().
static void attention_listed(const sd_model* M, const sd_layer* L, const float* qkv, int T, int start, int prefix,
                             const uint8_t* visible, float* out) {
    const int D = M->head_dim, H = M->heads, G = M->kv_heads, per = H / G;
    const int width = (H + 2 * G) * D, extra = start + T - prefix;
    const float* keys = (const float*)L->k_cache;
    const float* values = (const float*)L->v_cache;
#pragma omp for schedule(static)
    for (int item = 0; item < T * H; item++) {
        const int t = item / H, h = item % H, g = h / per;
        const float* q = qkv + (int64_t)t * width + h * D;
        const float* kg = keys + (int64_t)g * M->capacity * D;
        const float* vg = values + (int64_t)g * M->capacity * D;
        float acc[SD_MAX_HEAD_DIM] = {0};
        float mx = -INFINITY, sum = 0.0f;
        for (int slot = 0; slot < prefix + extra; slot++) {
            if (slot >= prefix && !visible[(int64_t)t * extra + slot - prefix]) continue;
            const float x = dot_row(q, kg + (int64_t)slot * D, D) * M->attn_scale;
            if (x > mx) {
                const float rescale = exp1(mx - x);  // exp(-inf) = 0 the first time
                sum *= rescale;
                for (int i = 0; i < D; i++) acc[i] *= rescale;
                mx = x;
            }
            const float w = exp1(x - mx);
            sum += w;
            axpy(w, vg + (int64_t)slot * D, acc, D);
        }
        float* o = out + (int64_t)t * H * D + h * D;
        for (int i = 0; i < D; i++) o[i] = sum > 0.0f ? acc[i] / sum : 0.0f;
    }
}

// A decoder layer from its qkv projection (in M->qkv) on: RoPE and the cache, attention,
// o into the residual stream, the MLP into it. Inside a parallel region.
// `listed` (an EAGLE head's tree pass, batch 1): attention_listed's visible slots after
// `prefix`, in place of `mask`.
static inline void layer_after_qkv(const sd_model* M, const sd_layer* L, float* hidden, int batch, int T,
                                   const int* starts, const int* cache_rows, const int64_t* positions,
                                   const uint8_t* mask, int prefix = 0, const uint8_t* listed = nullptr) {
    const int64_t rows = (int64_t)batch * T;
    const int Hd = M->hidden, I = M->intermediate;
    const scratch_q q = {M->xq, M->xd, M->xs, false};
    rope_and_store(M, L, M->qkv, batch, T, starts, cache_rows, positions);
    if (listed)
        attention_listed(M, L, M->qkv, T, starts[0], prefix, listed, M->attn);
    else
        attention(M, L, M->qkv, batch, T, starts, cache_rows, mask, M->attn);
    linear(&L->o, M->attn, rows, (int64_t)M->heads * M->head_dim, hidden, Hd, 1, q);
    rms_norm(hidden, L->post_norm, rows, Hd, M->eps, M->normed, Hd);
    linear(&L->gate_up, M->normed, rows, Hd, M->gate_up, 2 * I, 0, q);
    silu_mul(M->gate_up, rows, I, M->normed);
    linear(&L->down, M->normed, rows, I, hidden, Hd, 1, q);
}

extern "C" {

// hidden[batch*T, hidden] through layers [first, last): the residual stream stays fp32.
// Batch entry b is the sequence in cache row cache_rows[b]: its new tokens go to slots
// starts[b] + t at positions[b * T + t] (the rows of a batch may hold sequences of
// different lengths, and any subset of the cache's rows may run); mask: [T, T] shared by
// every entry.
void sd_forward_layers(const sd_model* M, int first, int last, float* hidden, int batch, int T, const int* starts,
                       const int* cache_rows, const int64_t* positions, const uint8_t* mask) {
    const int64_t rows = (int64_t)batch * T;
    const int Hd = M->hidden;
    const int qkv_width = (M->heads + 2 * M->kv_heads) * M->head_dim;
    const scratch_q q = {M->xq, M->xd, M->xs, false};
#pragma omp parallel num_threads(M->num_threads)
    for (int l = first; l < last; l++) {
        const sd_layer* L = M->layers + l;
        rms_norm(hidden, L->input_norm, rows, Hd, M->eps, M->normed, Hd);
        linear(&L->qkv, M->normed, rows, Hd, M->qkv, qkv_width, 0, q);
        layer_after_qkv(M, L, hidden, batch, T, starts, cache_rows, positions, mask);
    }
}

// An EAGLE-3 head's decoder layer (proposers/eagle_head.py) over T new rows of one sequence
// (cache row 0, slots start..start+T-1 at `positions`; causal, or with `visible` the slots
// attention_listed describes): its attention reads
// [embed_norm(embeds); input_norm(hidden)] (2 hidden wide; L->qkv has 2 hidden columns)
// and its residual stream is the fused feature `hidden`, which becomes the layer's output.
// M is the head as a one-layer model with a cache of its own.
void sd_eagle_layer(const sd_model* M, const float* embeds, const float* embed_norm, float* hidden, int T, int start,
                    const int64_t* positions, int prefix, const uint8_t* visible) {
    const int Hd = M->hidden, qkv_width = (M->heads + 2 * M->kv_heads) * M->head_dim;
    const scratch_q q = {M->xq, M->xd, M->xs, false};
    const int starts[1] = {start}, cache_rows[1] = {0};
    const sd_layer* L = M->layers;
#pragma omp parallel num_threads(M->num_threads)
    {
        rms_norm(embeds, embed_norm, T, Hd, M->eps, M->normed, 2 * Hd);
        rms_norm(hidden, L->input_norm, T, Hd, M->eps, M->normed + Hd, 2 * Hd);
        linear(&L->qkv, M->normed, T, 2 * Hd, M->qkv, qkv_width, 0, q);
        layer_after_qkv(M, L, hidden, 1, T, starts, cache_rows, positions, nullptr, prefix, visible);
    }
}

// out[rows, L.rows] = x[rows, L.cols] . W^T (+ bias), with the model's scratch for quantized x
void sd_linear_forward(const sd_linear* L, const float* x, int64_t rows, float* out, int8_t* xq, float* xd, float* xs,
                       int num_threads) {
    const scratch_q q = {xq, xd, xs, false};
#pragma omp parallel num_threads(num_threads)
    linear(L, x, rows, L->cols, out, L->rows, 0, q);
}

void sd_rms_norm(const float* x, const float* weight, int64_t rows, int cols, float eps, float* out, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    rms_norm(x, weight, rows, cols, eps, out, cols);
}

// rows of an embedding table in any format, dequantized to fp32
void sd_embed(const sd_linear* E, const int64_t* ids, int64_t count, float* out) {
    const int cols = E->cols, blocks = cols / 32;
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = ids[i];
        float* o = out + i * cols;
        switch (E->fmt) {
            case SD_F32: memcpy(o, (const float*)E->w + row * cols, sizeof(float) * cols); break;
            case SD_BF16:
                for (int k = 0; k < cols; k++) o[k] = bf16_to_f32(((const uint16_t*)E->w)[row * cols + k]);
                break;
            case SD_Q8_0:
                for (int k = 0; k < cols; k++)
                    o[k] = fp16_to_f32(E->d[row * blocks + k / 32]) * (float)((const int8_t*)E->w)[row * cols + k];
                break;
            case SD_Q4_1:
                for (int k = 0; k < cols; k++) {
                    const uint8_t* q = (const uint8_t*)E->w + row * cols / 2 + 16 * (k / 32);
                    int i = k % 32, v = i < 16 ? (q[i] & 0x0F) : (q[i - 16] >> 4);
                    int64_t blk = row * blocks + k / 32;
                    o[k] = fp16_to_f32(E->d[blk]) * (float)v + fp16_to_f32(E->m[blk]);
                }
                break;
            case SD_Q4_1X8:  // row r of its group of 8: lane r of each block (see sd_linear)
                for (int k = 0; k < cols; k++) {
                    const int64_t blk = (row / 8) * blocks + k / 32;
                    const int r = (int)(row % 8), e = k % 32, i = e / 8, t = e % 8;
                    const uint8_t q = ((const uint8_t*)E->w)[128 * blk + 32 * i + 4 * r + t % 4];
                    const int v = t < 4 ? (q & 0x0F) : (q >> 4);
                    o[k] = fp16_to_f32(E->d[8 * blk + r]) * (float)v + fp16_to_f32(E->m[8 * blk + r]);
                }
                break;
            case SD_Q4_1X16:  // lane r of its group's half of the pair's blocks
                for (int k = 0; k < cols; k++) {
                    const int64_t group = row / 8, blk = (group / 2) * blocks + k / 32;
                    const int r = (int)(row % 8), half = (int)(group % 2), e = k % 32, i = e / 8, t = e % 8;
                    const uint8_t q = ((const uint8_t*)E->w)[256 * blk + 64 * i + 32 * half + 4 * r + t % 4];
                    const int v = t < 4 ? (q & 0x0F) : (q >> 4);
                    o[k] = fp16_to_f32(E->d[16 * blk + 8 * half + r]) * (float)v + fp16_to_f32(E->m[16 * blk + 8 * half + r]);
                }
                break;
            case SD_Q8_0X8:
                for (int k = 0; k < cols; k++) {
                    const int64_t blk = (row / 8) * blocks + k / 32;
                    const int r = (int)(row % 8), e = k % 32;
                    const int8_t v = ((const int8_t*)E->w)[256 * blk + 32 * (e / 4) + 4 * r + e % 4];
                    o[k] = fp16_to_f32(E->d[8 * blk + r]) * (float)v;
                }
                break;
        }
    }
}

// attention alone, for tests: q rows of the model's qkv layout, one layer's cache
void sd_attention(const sd_model* M, int layer, const float* qkv, int batch, int T, const int* starts,
                  const int* cache_rows, const uint8_t* mask, float* out) {
#pragma omp parallel num_threads(M->num_threads)
    attention(M, M->layers + layer, qkv, batch, T, starts, cache_rows, mask, out);
}

// how many threads a parallel region of the kernels gets when asked for `num_threads`
int sd_team_size(int num_threads) {
    int size = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp single
        size = omp_get_num_threads();
    }
    return size;
}

void sd_f32_to_fp16(const float* x, int64_t n, uint16_t* out) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_fp16(x[i]);
}

}  // extern "C"
