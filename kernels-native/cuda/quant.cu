// Activation quantizers: f32 rows into the dq layout of blocks.cuh, once per product (every weight row of the
// product then reads the same quantized row). Both reproduce the CPU's quantizers value for value
// (engine/src/quant/q8_0.rs quantize_block_rtn, q8_k.rs quantize).

// Q8_0: one warp per 32-value block, one value per lane. d = amax / 127 (stored rounded to f16, as the CPU's
// block does), q = round(x / d) with ties away from zero. Grid: ceil(nblocks / (blockDim.x / 32)).
extern "C" __global__ void __launch_bounds__(256)
    ds4_quantize_q8_0(const float* __restrict__ x, i8* __restrict__ q, float* __restrict__ d, int nblocks) {
    const int b = blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP, lane = threadIdx.x & 31;
    if (b >= nblocks) return;
    const float v = x[(i64)b * DS4_QK8 + lane];
    const float amax = ds4_warp_max(fabsf(v));
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    q[(i64)b * DS4_QK8 + lane] = (i8)ds4_round_i8(__fmul_rn(v, id));
    if (lane == 0) d[b] = ds4_h2f(ds4_f2h(dd));
}

// Q8_K: one warp per 256-value block, 8 consecutive values per lane. iscale = 127 / amax, d = 1 / iscale (f32),
// q = round(x · iscale); an all-zero block is all zeros. bs[16b + j] = Σ q[16j .. 16j + 16].
extern "C" __global__ void __launch_bounds__(256) ds4_quantize_q8_k(const float* __restrict__ x, i8* __restrict__ q,
                                                                    float* __restrict__ d, i32* __restrict__ bs,
                                                                    int nblocks) {
    const int b = blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP, lane = threadIdx.x & 31;
    if (b >= nblocks) return;
    const float* xs = x + (i64)b * DS4_QK_K + 8 * lane;
    float v[8];
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = xs[i];
        m = fmaxf(m, fabsf(v[i]));
    }
    const float amax = ds4_warp_max(m);
    const float iscale = amax != 0.0f ? 127.0f / amax : 0.0f;
    u32 packed[2] = {0u, 0u};
    i32 s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const i32 qi = amax != 0.0f ? ds4_round_i8(__fmul_rn(v[i], iscale)) : 0;
        s += qi;
        packed[i / 4] |= ((u32)qi & 255u) << (8 * (i % 4));
    }
    u32* qo = (u32*)(q + (i64)b * DS4_QK_K + 8 * lane);
    qo[0] = packed[0];
    qo[1] = packed[1];
    s += __shfl_xor_sync(DS4_FULL, s, 1);
    if ((lane & 1) == 0) bs[(i64)b * 16 + lane / 2] = s;
    if (lane == 0) d[b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
}
