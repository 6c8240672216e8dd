// Weight blocks · quantized activations, one warp-cooperative form per weight type (layouts: shared/spec/gguf-ds4.md
// and engine/src/quant/*.rs).
//
// Activations on the device ("dq" layout, produced by quant.cu) keep the CPU's values in aligned arrays instead of
// its interleaved blocks: a row of n values is `i8 q[n]`, `float d[n / V]` (one scale per activation block:
// V = 32 for Q8_0, 256 for Q8_K) and, for Q8_K, `i32 bs[n / 16]` (sums of 16 quants). Each weight block pairs with
// exactly one activation block (Q8_0 with Q8_0, the k-quants and IQ2_XXS with Q8_K).
//
// A block is handled by LANES consecutive lanes of a warp (`sub` = lane % LANES): `load` decodes the lane's part
// of the weight block once (it is reused for every activation row of a product), `dot` forms the lane's integer
// partial sums with dp4a (`si`: Σ scale·q·a, `sm`: Σ min·bsum), the group sums them exactly with shuffles, and
// `term` makes the block's float contribution in the CPU's operation order. So a block term here is bit-identical
// to the CPU scalar kernel's term for the same block.

#ifndef DS4_BLOCKS_CUH
#define DS4_BLOCKS_CUH

// Q8_0 weights (34 bytes: f16 d, i8 q[32]) · Q8_0 activations. 4 lanes per block, 8 values each.
struct Ds4BlkQ8_0 {
    enum { BYTES = DS4_Q8_0_BYTES, VALUES = DS4_QK8, LANES = 4, BSUMS = 0 };
    i32 w0, w1;
    float d;
    __device__ __forceinline__ void load(const u8* b, int sub) {
        d = ds4_h2f(ds4_ld16(b));
        w0 = ds4_ld32_a2(b + 2 + 8 * sub);
        w1 = ds4_ld32_a2(b + 6 + 8 * sub);
    }
    __device__ __forceinline__ void dot(const i8* aq, const i32*, int sub, i32& si, i32& sm) const {
        const i32* a = (const i32*)(aq + 8 * sub);
        si = __dp4a(w1, a[1], __dp4a(w0, a[0], 0));
        sm = 0;
    }
    // CPU: f16(d_w) * f16(d_a) * s.
    __device__ __forceinline__ float term(float ad, i32 si, i32) const { return __fmul_rn(__fmul_rn(d, ad), (float)si); }
};

// IQ2_XXS weights (66 bytes: f16 d, 8 groups of 8 bytes) · Q8_K activations. 8 lanes per block, one 32-value group
// each: four grid points with their signs applied (even parity sign byte from the 7-bit index).
struct Ds4BlkIq2xxs {
    enum { BYTES = DS4_IQ2_XXS_BYTES, VALUES = DS4_QK_K, LANES = 8, BSUMS = 1 };
    u32 g[8];
    i32 mul;
    float d;
    __device__ __forceinline__ void load(const u8* b, int sub) {
        d = ds4_h2f(ds4_ld16(b));
        const u8* gp = b + 2 + 8 * sub;
        u32 idx = (u32)ds4_ld32_a2(gp);
        u32 aux = (u32)ds4_ld32_a2(gp + 4);
        mul = 2 * (i32)(aux >> 28) + 1;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            u64 gr = ds4_iq2xxs_grid[(idx >> (8 * l)) & 255];
            u32 k = (aux >> (7 * l)) & 127;
            u32 s8 = k | ((u32)(__popc(k) & 1) << 7);
            // Bit j of the sign byte -> 0xff in byte j (bits 0..3 for the low word, 4..7 for the high one).
            u32 mlo = (((s8 & 15) * 0x00204081u) & 0x01010101u) * 0xffu;
            u32 mhi = ((((s8 >> 4) & 15) * 0x00204081u) & 0x01010101u) * 0xffu;
            g[2 * l] = __vsub4((u32)gr ^ mlo, mlo);
            g[2 * l + 1] = __vsub4((u32)(gr >> 32) ^ mhi, mhi);
        }
    }
    __device__ __forceinline__ void dot(const i8* aq, const i32*, int sub, i32& si, i32& sm) const {
        const i32* a = (const i32*)(aq + 32 * sub);
        i32 s = 0;
#pragma unroll
        for (int m = 0; m < 8; ++m) s = __dp4a((i32)g[m], a[m], s);
        si = mul * s;
        sm = 0;
    }
    // CPU: d * d_a * 0.125 * Σ_g (2 s_g + 1) Σ grid·sign·a.
    __device__ __forceinline__ float term(float ad, i32 si, i32) const {
        return __fmul_rn(__fmul_rn(__fmul_rn(d, ad), 0.125f), (float)si);
    }
};

// Q2_K weights (84 bytes: scales[16], qs[64], f16 d, f16 dmin) · Q8_K activations. 8 lanes per block: lane
// (h, j) = (sub / 4, sub % 4) takes values 128h + 32j .. +32, i.e. sub-blocks 8h + 2j and 8h + 2j + 1.
struct Ds4BlkQ2K {
    enum { BYTES = DS4_Q2_K_BYTES, VALUES = DS4_QK_K, LANES = 8, BSUMS = 1 };
    u32 q[8];
    u32 sc0, sc1;
    float d, dmin;
    __device__ __forceinline__ void load(const u8* b, int sub) {
        int h = sub >> 2, j = sub & 3, s = 8 * h + 2 * j;
#pragma unroll
        for (int m = 0; m < 8; ++m) q[m] = ((u32)ds4_ld32_a4(b + 16 + 32 * h + 4 * m) >> (2 * j)) & 0x03030303u;
        sc0 = b[s];
        sc1 = b[s + 1];
        d = ds4_h2f(ds4_ld16(b + 80));
        dmin = ds4_h2f(ds4_ld16(b + 82));
    }
    __device__ __forceinline__ void dot(const i8* aq, const i32* bs, int sub, i32& si, i32& sm) const {
        int h = sub >> 2, j = sub & 3, s = 8 * h + 2 * j;
        const i32* a = (const i32*)(aq + 128 * h + 32 * j);
        i32 t0 = 0, t1 = 0;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            t0 = __dp4a((i32)q[m], a[m], t0);
            t1 = __dp4a((i32)q[m + 4], a[m + 4], t1);
        }
        si = (i32)(sc0 & 15) * t0 + (i32)(sc1 & 15) * t1;
        sm = (i32)(sc0 >> 4) * bs[s] + (i32)(sc1 >> 4) * bs[s + 1];
    }
    // CPU: d_a * (d * sumi - dmin * summ).
    __device__ __forceinline__ float term(float ad, i32 si, i32 sm) const {
        return __fmul_rn(ad, __fsub_rn(__fmul_rn(d, (float)si), __fmul_rn(dmin, (float)sm)));
    }
};

// Q4_K weights (144 bytes: f16 d, f16 dmin, scales[12], qs[128]) · Q8_K activations. 8 lanes per block: lane
// (c, hi) = (sub / 2, sub % 2) takes sub-block k = 2c + hi (values 64c + 32hi .. +32, nibble hi of qs[32c..]).
struct Ds4BlkQ4K {
    enum { BYTES = DS4_Q4_K_BYTES, VALUES = DS4_QK_K, LANES = 8, BSUMS = 1 };
    u32 q[8];
    i32 sc, mn;
    float d, dmin;
    __device__ __forceinline__ void load(const u8* b, int sub) {
        int c = sub >> 1, hi = sub & 1, k = 2 * c + hi;
#pragma unroll
        for (int m = 0; m < 8; ++m) q[m] = ((u32)ds4_ld32_a4(b + 16 + 32 * c + 4 * m) >> (4 * hi)) & 0x0f0f0f0fu;
        const u8* s = b + 4;
        if (k < 4) {
            sc = s[k] & 63;
            mn = s[k + 4] & 63;
        } else {
            sc = (s[k + 4] & 15) | ((s[k - 4] >> 6) << 4);
            mn = (s[k + 4] >> 4) | ((s[k] >> 6) << 4);
        }
        d = ds4_h2f(ds4_ld16(b));
        dmin = ds4_h2f(ds4_ld16(b + 2));
    }
    __device__ __forceinline__ void dot(const i8* aq, const i32* bs, int sub, i32& si, i32& sm) const {
        int c = sub >> 1, hi = sub & 1, k = 2 * c + hi;
        const i32* a = (const i32*)(aq + 64 * c + 32 * hi);
        i32 t = 0;
#pragma unroll
        for (int m = 0; m < 8; ++m) t = __dp4a((i32)q[m], a[m], t);
        si = sc * t;
        sm = mn * (bs[2 * k] + bs[2 * k + 1]);
    }
    // CPU: d_a * (d * sumi - dmin * summ).
    __device__ __forceinline__ float term(float ad, i32 si, i32 sm) const {
        return __fmul_rn(ad, __fsub_rn(__fmul_rn(d, (float)si), __fmul_rn(dmin, (float)sm)));
    }
};

// Dot products of one weight row (nb blocks at w) with NB activation rows (row t at value offset t * stride, all
// rows valid when t < nt) by one warp. Every lane returns the NB sums. All 32 lanes must call it.
template <class B, int NB>
__device__ __forceinline__ void ds4_row_dot(const u8* __restrict__ w, int nb, const i8* __restrict__ aq,
                                            const float* __restrict__ ad, const i32* __restrict__ bs, i64 stride,
                                            int nt, float out[NB]) {
    const int lane = threadIdx.x & 31, sub = lane % B::LANES, bl = lane / B::LANES;
    const int per = DS4_WARP / B::LANES;
    float acc[NB];
#pragma unroll
    for (int t = 0; t < NB; ++t) acc[t] = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += per) {
        const int b = b0 + bl;
        const bool ok = b < nb;
        B blk{};
        if (ok) blk.load(w + (i64)b * B::BYTES, sub);
#pragma unroll
        for (int t = 0; t < NB; ++t) {
            if (t >= nt) break;  // uniform across the warp
            i32 si = 0, sm = 0;
            if (ok) {
                const i64 v0 = (i64)t * stride + (i64)b * B::VALUES;
                blk.dot(aq + v0, B::BSUMS ? bs + v0 / 16 : (const i32*)0, sub, si, sm);
            }
            si = ds4_group_isum<B::LANES>(si);
            if (B::BSUMS) sm = ds4_group_isum<B::LANES>(sm);
            if (ok && sub == 0) acc[t] += blk.term(ad[(i64)t * stride / B::VALUES + b], si, sm);
        }
    }
#pragma unroll
    for (int t = 0; t < NB; ++t) out[t] = ds4_warp_sum(acc[t]);
}

// Each block's float term of w · a for nb blocks (one weight row, one activation row): the test hook for the
// bit-exact comparison with the CPU's one-block dot products. One warp.
template <class B>
__device__ __forceinline__ void ds4_block_terms(const u8* __restrict__ w, int nb, const i8* __restrict__ aq,
                                                const float* __restrict__ ad, const i32* __restrict__ bs,
                                                float* __restrict__ out) {
    const int lane = threadIdx.x & 31, sub = lane % B::LANES, bl = lane / B::LANES;
    const int per = DS4_WARP / B::LANES;
    for (int b0 = 0; b0 < nb; b0 += per) {
        const int b = b0 + bl;
        const bool ok = b < nb;
        B blk{};
        i32 si = 0, sm = 0;
        if (ok) {
            blk.load(w + (i64)b * B::BYTES, sub);
            blk.dot(aq + (i64)b * B::VALUES, B::BSUMS ? bs + (i64)b * B::VALUES / 16 : (const i32*)0, sub, si, sm);
        }
        si = ds4_group_isum<B::LANES>(si);
        sm = ds4_group_isum<B::LANES>(sm);
        if (ok && sub == 0) out[b] = blk.term(ad[b], si, sm);
    }
}

#endif
