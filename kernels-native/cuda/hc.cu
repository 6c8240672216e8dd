// mHC (manifold-constrained hyper-connections) per token, operation for operation the CPU backend's
// (engine/src/backend/cpu/hc.rs): every product and sum in its order, nothing fused (__fmul_rn / __fadd_rn).
// hc (streams per token) is at most DS4_MAX_HC.

#define DS4_MAX_HC 4

__device__ __forceinline__ float ds4_sigmoid(float x) { return 1.0f / __fadd_rn(1.0f, expf(-x)); }

// pre, post and comb of each of n rows from its mix (row stride `mix_stride`, (2 + hc)·hc values used): pre =
// σ(mix·s0 + b) + eps; post = 2σ(mix·s1 + b); comb = row softmax of (mix·s2 + b) + eps, then column-normalised, then
// iters − 1 rounds of row and column normalisation (each `/ (Σ + eps)`). postcomb rows are post (hc) then comb
// (hc·hc, [j][k]). One thread per row.
extern "C" __global__ void __launch_bounds__(256) ds4_hc_weights(const float* __restrict__ mix, int mix_stride,
                                                                 const float* __restrict__ base,
                                                                 const float* __restrict__ scale, int hc, float eps,
                                                                 int iters, float* __restrict__ pre,
                                                                 float* __restrict__ postcomb, int n) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n || hc <= 0 || hc > DS4_MAX_HC) return;
    const float* m = mix + (i64)r * mix_stride;
    float* pr = pre + (i64)r * hc;
    float* po = postcomb + (i64)r * (hc + hc * hc);
    float* cb = po + hc;
    for (int j = 0; j < hc; ++j) {
        pr[j] = __fadd_rn(ds4_sigmoid(__fadd_rn(__fmul_rn(m[j], scale[0]), base[j])), eps);
        po[j] = __fmul_rn(2.0f, ds4_sigmoid(__fadd_rn(__fmul_rn(m[hc + j], scale[1]), base[hc + j])));
    }
    float c[DS4_MAX_HC * DS4_MAX_HC];
    for (int j = 0; j < hc; ++j) {
        float mx = __int_as_float((int)0xff800000u);
        for (int k = 0; k < hc; ++k) {
            const int at = 2 * hc + j * hc + k;
            c[j * hc + k] = __fadd_rn(__fmul_rn(m[at], scale[2]), base[at]);
            mx = fmaxf(mx, c[j * hc + k]);
        }
        float s = 0.0f;
        for (int k = 0; k < hc; ++k) {
            c[j * hc + k] = expf(c[j * hc + k] - mx);
            s = __fadd_rn(s, c[j * hc + k]);
        }
        for (int k = 0; k < hc; ++k) c[j * hc + k] = __fadd_rn(c[j * hc + k] / s, eps);
    }
    for (int it = 0; it < (iters > 1 ? iters : 1); ++it) {
        if (it > 0) {
            for (int j = 0; j < hc; ++j) {
                float s = 0.0f;
                for (int k = 0; k < hc; ++k) s = __fadd_rn(s, c[j * hc + k]);
                for (int k = 0; k < hc; ++k) c[j * hc + k] = c[j * hc + k] / __fadd_rn(s, eps);
            }
        }
        for (int k = 0; k < hc; ++k) {
            float s = 0.0f;
            for (int j = 0; j < hc; ++j) s = __fadd_rn(s, c[j * hc + k]);
            for (int j = 0; j < hc; ++j) c[j * hc + k] = c[j * hc + k] / __fadd_rn(s, eps);
        }
    }
    for (int i = 0; i < hc * hc; ++i) cb[i] = c[i];
}

// The head's pre of each of n rows: σ(mix_j · scale + base_j) + eps (mix rows of hc). One thread per value.
extern "C" __global__ void __launch_bounds__(256) ds4_hc_head_weights(const float* __restrict__ mix,
                                                                      const float* __restrict__ base, float scale,
                                                                      int hc, float eps, float* __restrict__ pre,
                                                                      int n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n * hc) return;
    const int j = (int)(i % hc);
    pre[i] = __fadd_rn(ds4_sigmoid(__fadd_rn(__fmul_rn(mix[i], scale), base[j])), eps);
}

// u = Σ_j pre_j · X_j per row (X: hc streams of d). Grid (ceil(d / 256), n).
extern "C" __global__ void __launch_bounds__(256) ds4_hc_collapse(const float* __restrict__ x,
                                                                  const float* __restrict__ pre,
                                                                  float* __restrict__ u, int hc, int d) {
    const int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    const float* xr = x + (i64)r * hc * d;
    float s = 0.0f;
    for (int j = 0; j < hc; ++j) s = __fadd_rn(s, __fmul_rn(pre[(i64)r * hc + j], xr[(i64)j * d + i]));
    u[(i64)r * d + i] = s;
}

// Post-mix in place: X'_k = post_k · f + Σ_j comb[j][k] · X_j per row (f: the sublayer output, d values; postcomb
// rows as ds4_hc_weights writes them). Each thread owns one position i of all hc streams of a row, so reading the
// old streams and writing the new ones never races. Grid (ceil(d / 256), n).
extern "C" __global__ void __launch_bounds__(256) ds4_hc_post(float* __restrict__ x, const float* __restrict__ f,
                                                              const float* __restrict__ postcomb, int hc, int d) {
    const int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d || hc <= 0 || hc > DS4_MAX_HC) return;
    float* xr = x + (i64)r * hc * d;
    const float* po = postcomb + (i64)r * (hc + hc * hc);
    const float* cb = po + hc;
    float old[DS4_MAX_HC];
    for (int j = 0; j < hc; ++j) old[j] = xr[(i64)j * d + i];
    const float fi = f[(i64)r * d + i];
    for (int k = 0; k < hc; ++k) {
        float s = 0.0f;
        for (int j = 0; j < hc; ++j) s = __fadd_rn(s, __fmul_rn(cb[j * hc + k], old[j]));
        xr[(i64)k * d + i] = __fadd_rn(s, __fmul_rn(po[k], fi));
    }
}
