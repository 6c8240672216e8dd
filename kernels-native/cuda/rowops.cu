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

// y[r] = x[rows[r]] for n rows of `width` values (the logit rows of a tick gathered for the head product).
// Grid (ceil(width / 256), n).
extern "C" __global__ void __launch_bounds__(256) ds4_gather_rows(const float* __restrict__ x,
                                                                  const i32* __restrict__ rows, float* __restrict__ y,
                                                                  int width, int n) {
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n || c >= width) return;
    y[(i64)r * width + c] = x[(i64)rows[r] * width + c];
}

// The k best values of each row of `vocab` logits (one CTA of 256 per row), best first: larger value first, lower
// id among equal values (-0 equals +0), NaN and -inf never taken; when fewer qualify the list ends with id
// 0xffffffff and value -inf (the CPU's sampler::top_candidates). Round j takes the best entry after round j-1's in
// that order, so nothing but the previous pick is kept. All threads take part in every barrier and shuffle.
__device__ __forceinline__ bool ds4_cand_better(float av, u32 ai, float bv, u32 bi) {
    return ai != 0xffffffffu && (bi == 0xffffffffu || av > bv || (av == bv && ai < bi));
}

extern "C" __global__ void __launch_bounds__(256) ds4_top_candidates(const float* __restrict__ x, int vocab, int k,
                                                                     u32* __restrict__ ids,
                                                                     float* __restrict__ vals) {
    __shared__ float wv[32];
    __shared__ u32 wi[32];
    __shared__ float pick_v;
    __shared__ u32 pick_i;
    const float neg_inf = __int_as_float((int)0xff800000u);
    const float* row = x + (i64)blockIdx.x * vocab;
    u32* out_i = ids + (i64)blockIdx.x * k;
    float* out_v = vals + (i64)blockIdx.x * k;
    float prev_v = 0.0f;
    u32 prev_i = 0xffffffffu;
    bool first = true;
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    for (int j = 0; j < k; ++j) {
        float bv = neg_inf;
        u32 bi = 0xffffffffu;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            if (v != v || v == neg_inf) continue;
            if (!first && !(v < prev_v || (v == prev_v && (u32)i > prev_i))) continue;
            if (ds4_cand_better(v, (u32)i, bv, bi)) {
                bv = v;
                bi = (u32)i;
            }
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) {
            const float ov = __shfl_xor_sync(DS4_FULL, bv, m);
            const u32 oi = __shfl_xor_sync(DS4_FULL, bi, m);
            if (ds4_cand_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            wv[warp] = bv;
            wi[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = wv[0];
            u32 i = wi[0];
            for (int w = 1; w < nwarps; ++w) {
                if (ds4_cand_better(wv[w], wi[w], v, i)) {
                    v = wv[w];
                    i = wi[w];
                }
            }
            pick_v = v;
            pick_i = i;
            out_i[j] = i;
            out_v[j] = i == 0xffffffffu ? neg_inf : v;
        }
        __syncthreads();
        prev_v = pick_v;
        prev_i = pick_i;
        first = false;
        if (prev_i == 0xffffffffu) {
            // Nothing qualifies any more: the rest of the list is empty (every thread leaves together).
            for (int r = j + 1 + threadIdx.x; r < k; r += blockDim.x) {
                out_i[r] = 0xffffffffu;
                out_v[r] = neg_inf;
            }
            break;
        }
    }
}

// The embedding rows of n tokens into every one of the hc streams of their rows: streams[r][j][c] = E[tokens[r]][c]
// for a table of f32 (ty 0), f16 (ty 1) or Q8_0 (ty 2: 34-byte blocks of an f16 scale and 32 quants, d · q) rows of
// `row_bytes` bytes, dequantized as the CPU does. Grid (ceil(d / 256), n).
extern "C" __global__ void __launch_bounds__(256) ds4_embed(const u8* __restrict__ table, int ty, i64 row_bytes,
                                                            const i32* __restrict__ tokens, float* __restrict__ streams,
                                                            int d, int hc, int n) {
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n || c >= d) return;
    const u8* row = table + (i64)tokens[r] * row_bytes;
    float v;
    if (ty == 0) {
        v = ((const float*)row)[c];
    } else if (ty == 1) {
        v = ds4_h2f(((const u16*)row)[c]);
    } else {
        const u8* blk = row + (c / 32) * 34;
        const float scale = ds4_h2f((u16)(blk[0] | (blk[1] << 8)));
        v = __fmul_rn(scale, (float)(i8)blk[2 + c % 32]);
    }
    float* out = streams + (i64)r * hc * d + c;
    for (int j = 0; j < hc; ++j) out[(i64)j * d] = v;
}
