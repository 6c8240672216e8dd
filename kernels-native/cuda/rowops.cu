// Row-wise ops, each the CPU backend's (engine/src/backend/cpu/{norm,rowops,moe}.rs).

// RMSNorm of one row per CTA: y = w · (x · s) (w null: y = x · s), s = 1 / sqrt(mean(x²) + eps), the sum of
// squares in f64 like the CPU's. All threads reach both barriers (no early return).
extern "C" __global__ void __launch_bounds__(256) ds4_rms_norm(const float* __restrict__ x,
                                                               const float* __restrict__ w, float* __restrict__ y,
                                                               int width, float eps) {
    __shared__ double part[32];
    __shared__ float scale;
    const float* xr = x + (i64)blockIdx.x * width;
    float* yr = y + (i64)blockIdx.x * width;
    double s = 0.0;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const double v = (double)xr[i];
        s += v * v;
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(DS4_FULL, s, m);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int i = 0; i < (int)(blockDim.x / 32); ++i) t += part[i];
        const float mean = (float)(t / (double)(width > 0 ? width : 1));
        scale = 1.0f / sqrtf(__fadd_rn(mean, eps));
    }
    __syncthreads();
    const float sc = scale;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = __fmul_rn(xr[i], sc);
        yr[i] = w ? __fmul_rn(w[i], v) : v;
    }
}

// RoPE on the last 2·half values of each of nvec vectors of `width` values (vector v belongs to batch row
// v / heads, at position pos[v / heads]): pair i rotated by pos · inv_freq[i] (the sine negated when inverse),
// interleaved pairs (2i, 2i+1). One thread per pair.
extern "C" __global__ void __launch_bounds__(256) ds4_rope(float* __restrict__ x, const float* __restrict__ inv_freq,
                                                           const i32* __restrict__ pos, int width, int heads,
                                                           int half, int inverse, int nvec) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)nvec * half) return;
    const i64 v = idx / half;
    const int i = (int)(idx % half);
    const float ang = __fmul_rn((float)pos[v / heads], inv_freq[i]);
    float sn, cs;
    sincosf(ang, &sn, &cs);
    if (inverse) sn = -sn;
    float* p = x + v * width + (width - 2 * half) + 2 * i;
    const float a = p[0], b = p[1];
    p[0] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    p[1] = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
}

// The clamped SwiGLU: g ← silu(min(g, L)) · clamp(u, −L, L), n values.
extern "C" __global__ void __launch_bounds__(256) ds4_swiglu(float* __restrict__ g, const float* __restrict__ u,
                                                             i64 n, float limit) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    g[i] = __fmul_rn(ds4_silu(fminf(g[i], limit)), fminf(fmaxf(u[i], -limit), limit));
}

// y += x over n values (the MoE combine's shared expert added to the routed sum).
extern "C" __global__ void __launch_bounds__(256) ds4_add(float* __restrict__ y, const float* __restrict__ x, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = __fadd_rn(y[i], x[i]);
}
