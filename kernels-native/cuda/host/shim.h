// Host shim: the ds4 CUDA kernel sources compiled as plain C++ and run on the CPU, for tests on machines without
// a GPU. Not a CUDA emulator: only what the kernels use.
//
// Model: a launch runs its CTAs one after another on blockDim.x·y·z fibers (one per CUDA thread, ucontext
// coroutines on the launching OS thread, taking turns: a fiber runs until it waits at a barrier); all of them pass
// a barrier between CTAs, so `__shared__` (a function-local `static`) is private to the running CTA.
// `__syncthreads` is a barrier over the CTA's threads; warp shuffles exchange values through a per-warp slot
// array and one barrier over the warp's 32 threads, so every lane of a warp must call each shuffle (the same rule
// as the device's full-mask shuffles). Launches are serialised by a global mutex (tests run in parallel threads).
// dp4a, vsub4, popc and the _rn float intrinsics are plain C with the same results; build with
// -ffp-contract=off so that no a·b + c is fused unless written as fmaf.
//
// A round of turns in which no thread reaches a barrier or finishes means a kernel broke the rules above (a lane
// skipped a shuffle, or some threads returned before a __syncthreads): the shim prints the barrier kind it waits
// at and aborts instead of hanging the test run.

#ifndef DS4_SHIM_H
#define DS4_SHIM_H

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define DS4_HOST_SHIM 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

namespace ds4shim {

struct dim3 {
    unsigned x, y, z;
};

// The calling CUDA thread's indices and the launch's dimensions.
extern thread_local dim3 tl_thread, tl_block;
extern dim3 g_block_dim, g_grid_dim;

void sync_block();
void sync_warp();
// The calling thread's exchange slots for its next shuffle: two arrays of 32 slots per warp, used in turn, so
// one barrier per shuffle suffices (a lane can only come back to an array after every lane has passed the next
// barrier, i.e. has read it).
uint64_t* warp_slots();

template <class T>
inline T shfl_xor(T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    const unsigned lane = (tl_thread.x + g_block_dim.x * (tl_thread.y + g_block_dim.y * tl_thread.z)) & 31;
    uint64_t* slots = warp_slots();
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    slots[lane] = bits;
    sync_warp();
    T r;
    const uint64_t other = slots[(lane ^ (unsigned)lane_mask) & 31];
    std::memcpy(&r, &other, sizeof(T));
    return r;
}

}  // namespace ds4shim

#define threadIdx (ds4shim::tl_thread)
#define blockIdx (ds4shim::tl_block)
#define blockDim (ds4shim::g_block_dim)
#define gridDim (ds4shim::g_grid_dim)

inline void __syncthreads() { ds4shim::sync_block(); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    return ds4shim::shfl_xor(v, lane_mask);
}

struct uint2 {
    unsigned x, y;
};
struct float4 {
    float x, y, z, w;
};

inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 255u) << (8 * i);
    return r;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
// expf, sqrtf, sincosf, fminf, fmaxf, fabsf, copysignf, fmaf: <math.h> (glibc, g++ defines _GNU_SOURCE).

// f16 bits -> f32, exact (subnormals, infinities and NaN included).
inline float ds4_h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            const float f = std::ldexp((float)man, -24);
            std::memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// f32 -> f16 bits, round to nearest even (as the device's cvt.rn.f16.f32 and the `half` crate).
inline uint16_t ds4_f2h(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to infinity
    if (ax < 0x38800000u) {                                     // f16 subnormal or zero
        const float a = std::fabs(f) * 16777216.0f;            // exact scaling by 2^24
        return (uint16_t)(sign | (uint32_t)std::nearbyint(a));  // default rounding mode: to nearest even
    }
    const uint32_t e = (ax >> 23) - 112, m = ax & 0x7fffffu;
    uint32_t h = (e << 10) | (m >> 13);
    const uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return (uint16_t)(sign | h);
}

namespace ds4shim {
// Runs `kernel()` as a launch of grid × block (see the header comment).
void launch(dim3 grid, dim3 block, void (*body)(void*), void* ctx);

template <class F>
inline void run(dim3 grid, dim3 block, F f) {
    launch(grid, block, [](void* c) { (*static_cast<F*>(c))(); }, &f);
}
}  // namespace ds4shim

#endif
