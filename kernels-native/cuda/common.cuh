// ds4 CUDA kernels: definitions shared by every source file.
//
// The kernel sources are one program: the host (kernels-native/src/cuda_kernels.rs) concatenates common.cuh,
// iq2_grid.cuh, blocks.cuh and the .cu files in that order and hands the text to NVRTC, so no file includes
// another and nothing includes a CUDA header (NVRTC needs no include path). The same text also compiles as host
// C++ under host/shim.h (DS4_HOST_SHIM defined): one OS thread per CUDA thread, so every kernel here keeps to what
// the shim emulates (see host/shim.h): whole warps take part in every shuffle, and a kernel that calls
// __syncthreads never returns early from some of its threads.
//
// Numerics: products that the CPU backend computes as exact integer block sums are exact integer sums here too
// (dp4a, integer shuffles), and each block's float term is formed with __fmul_rn/__fsub_rn in the CPU's order, so
// a one-block dot product equals the CPU's to the bit. Sums over blocks, rows and threads run in other orders
// than on the CPU (documented tolerances in docs/cuda.md). No fast-math: plain '/' and sqrtf are IEEE on the
// device and in the shim; the shim is built with -ffp-contract=off so only the explicit fmaf fuse.

#ifndef DS4_COMMON_CUH
#define DS4_COMMON_CUH

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#ifdef DS4_HOST_SHIM
#define DS4_TABLE static
#else
#define DS4_TABLE __device__
// f16 bits -> f32 (exact) and f32 -> f16 bits (round to nearest even), without cuda_fp16.h.
__device__ __forceinline__ float ds4_h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 ds4_f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

#define DS4_WARP 32
#define DS4_FULL 0xffffffffu

// Values per block of the k-quants and of the Q8_K activation blocks.
#define DS4_QK_K 256
// Values per Q8_0 block.
#define DS4_QK8 32
// Bytes per weight block.
#define DS4_Q8_0_BYTES 34
#define DS4_Q2_K_BYTES 84
#define DS4_Q4_K_BYTES 144
#define DS4_IQ2_XXS_BYTES 66

// Loads of weight bytes: blocks are 2-byte aligned (Q8_0, IQ2_XXS) or 4-byte aligned (Q2_K, Q4_K) when the
// tensor starts 4-byte aligned, so 32-bit words are read as two 16-bit halves where needed.
__device__ __forceinline__ u16 ds4_ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ i32 ds4_ld32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (i32)((u32)q[0] | ((u32)q[1] << 16));
}
__device__ __forceinline__ i32 ds4_ld32_a4(const u8* p) { return *(const i32*)p; }

// round(y) clamped to [-127, 127] with ties away from zero, as the CPU's round_i8 computes it (the add is not
// fused with the product that made y: callers pass y from __fmul_rn).
__device__ __forceinline__ i32 ds4_round_i8(float y) {
    float t = __fadd_rn(y, copysignf(0.49999997f, y));
    t = fminf(fmaxf(t, -127.0f), 127.0f);
    return (i32)t;
}

__device__ __forceinline__ float ds4_warp_sum(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(DS4_FULL, v, m);
    return v;
}
__device__ __forceinline__ float ds4_warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(DS4_FULL, v, m));
    return v;
}
// Sum over groups of G consecutive lanes (G a power of two); every lane of a group gets the group's sum.
template <int G>
__device__ __forceinline__ i32 ds4_group_isum(i32 v) {
#pragma unroll
    for (int m = 1; m < G; m <<= 1) v += __shfl_xor_sync(DS4_FULL, v, m);
    return v;
}

__device__ __forceinline__ float ds4_silu(float x) { return x / (1.0f + expf(-x)); }

#endif
