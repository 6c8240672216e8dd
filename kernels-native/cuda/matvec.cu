// Dense products y = W · x for a few activation rows at once (decode: one row per session of the tick).
//
// Quantized weights: one warp per output row, the row's blocks spread over the warp (blocks.cuh), each weight
// block decoded once for the NB activation rows of the launch; y is [ntok][rows]. Grid: (ceil(rows / warps per
// CTA), ceil(ntok / NB)). Activations come from quant.cu (Q8_0 rows for Q8_0 weights, Q8_K rows for the others).

template <class B, int NB>
__device__ __forceinline__ void ds4_matvec_q(const u8* __restrict__ W, const i8* __restrict__ aq,
                                             const float* __restrict__ ad, const i32* __restrict__ bs,
                                             float* __restrict__ y, int rows, int cols, int ntok) {
    const int row = blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP, lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int t0 = blockIdx.y * NB;
    const int nt = ntok - t0 < NB ? ntok - t0 : NB;
    const int nb = cols / B::VALUES;
    float r[NB];
    ds4_row_dot<B, NB>(W + (i64)row * nb * B::BYTES, nb, aq + (i64)t0 * cols, ad + (i64)t0 * cols / B::VALUES,
                       B::BSUMS ? bs + (i64)t0 * cols / 16 : (const i32*)0, cols, nt, r);
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < NB; ++t)
            if (t < nt) y[(i64)(t0 + t) * rows + row] = r[t];
    }
}

#define DS4_MATVEC(name, B, NB)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        name(const u8* __restrict__ W, const i8* __restrict__ aq, const float* __restrict__ ad,                   \
             const i32* __restrict__ bs, float* __restrict__ y, int rows, int cols, int ntok) {                   \
        ds4_matvec_q<B, NB>(W, aq, ad, bs, y, rows, cols, ntok);                                                  \
    }

DS4_MATVEC(ds4_matvec_q8_0_b1, Ds4BlkQ8_0, 1)
DS4_MATVEC(ds4_matvec_q8_0_b2, Ds4BlkQ8_0, 2)
DS4_MATVEC(ds4_matvec_q8_0_b4, Ds4BlkQ8_0, 4)
DS4_MATVEC(ds4_matvec_q8_0_b8, Ds4BlkQ8_0, 8)
DS4_MATVEC(ds4_matvec_iq2_xxs_b1, Ds4BlkIq2xxs, 1)
DS4_MATVEC(ds4_matvec_iq2_xxs_b4, Ds4BlkIq2xxs, 4)
DS4_MATVEC(ds4_matvec_q2_k_b1, Ds4BlkQ2K, 1)
DS4_MATVEC(ds4_matvec_q2_k_b4, Ds4BlkQ2K, 4)
DS4_MATVEC(ds4_matvec_q4_k_b1, Ds4BlkQ4K, 1)
DS4_MATVEC(ds4_matvec_q4_k_b4, Ds4BlkQ4K, 4)

// F16 weights · f32 activations: one warp per row, 4 weights (8 bytes) per lane per step, so a warp reads 256
// contiguous bytes per step. cols must be a multiple of 4 (the host checks).
template <int NB>
__device__ __forceinline__ void ds4_matvec_f16(const u16* __restrict__ W, const float* __restrict__ x,
                                               float* __restrict__ y, int rows, int cols, int ntok) {
    const int row = blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP, lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int t0 = blockIdx.y * NB;
    const int nt = ntok - t0 < NB ? ntok - t0 : NB;
    float acc[NB];
#pragma unroll
    for (int t = 0; t < NB; ++t) acc[t] = 0.0f;
    const u16* wr = W + (i64)row * cols;
    for (int i = 4 * lane; i < cols; i += 4 * DS4_WARP) {
        const uint2 wv = *(const uint2*)(wr + i);
        const float w0 = ds4_h2f((u16)(wv.x & 0xffffu)), w1 = ds4_h2f((u16)(wv.x >> 16));
        const float w2 = ds4_h2f((u16)(wv.y & 0xffffu)), w3 = ds4_h2f((u16)(wv.y >> 16));
#pragma unroll
        for (int t = 0; t < NB; ++t) {
            if (t >= nt) break;
            const float4 xv = *(const float4*)(x + (i64)(t0 + t) * cols + i);
            acc[t] = fmaf(w0, xv.x, fmaf(w1, xv.y, fmaf(w2, xv.z, fmaf(w3, xv.w, acc[t]))));
        }
    }
#pragma unroll
    for (int t = 0; t < NB; ++t) acc[t] = ds4_warp_sum(acc[t]);
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < NB; ++t)
            if (t < nt) y[(i64)(t0 + t) * rows + row] = acc[t];
    }
}

extern "C" __global__ void __launch_bounds__(256) ds4_matvec_f16_b1(const u16* __restrict__ W,
                                                                    const float* __restrict__ x,
                                                                    float* __restrict__ y, int rows, int cols,
                                                                    int ntok) {
    ds4_matvec_f16<1>(W, x, y, rows, cols, ntok);
}
extern "C" __global__ void __launch_bounds__(256) ds4_matvec_f16_b4(const u16* __restrict__ W,
                                                                    const float* __restrict__ x,
                                                                    float* __restrict__ y, int rows, int cols,
                                                                    int ntok) {
    ds4_matvec_f16<4>(W, x, y, rows, cols, ntok);
}

// Test hook: each block's float term of one weight row · one activation row (one warp; see blocks.cuh).
#define DS4_BLOCK_TERMS(name, B)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32)                                                              \
        name(const u8* __restrict__ w, int nb, const i8* __restrict__ aq, const float* __restrict__ ad,           \
             const i32* __restrict__ bs, float* __restrict__ out) {                                               \
        ds4_block_terms<B>(w, nb, aq, ad, bs, out);                                                               \
    }
DS4_BLOCK_TERMS(ds4_block_terms_q8_0, Ds4BlkQ8_0)
DS4_BLOCK_TERMS(ds4_block_terms_iq2_xxs, Ds4BlkIq2xxs)
DS4_BLOCK_TERMS(ds4_block_terms_q2_k, Ds4BlkQ2K)
DS4_BLOCK_TERMS(ds4_block_terms_q4_k, Ds4BlkQ4K)
