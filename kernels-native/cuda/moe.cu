// Decode MoE over the routed experts, expert ids read on the device (no host round trip between the router and
// the experts). Expert e's matrix of a stacked [n_experts][rows][cols] weight starts at e · expert_bytes.
//
// ds4_moe_gate_up_*: for token t (grid z), selected slot j (grid y) and output row r (one warp each):
//   h[t][j][r] = silu(min(gate_e[r]·x_t, L)) · clamp(up_e[r]·x_t, −L, L) (· rw[t][j] when rw is not null)
// with e = ids[t][j]. x is the token's Q8_K row (quant.cu). An id outside [0, n_experts) writes NaN (the host
// validates ids; a NaN makes a bad id visible instead of reading out of bounds).
//
// ds4_moe_down_sum_*: for token t (grid y) and output row r (one warp each), the sum over the token's slots in
// slot order of (rw[t][j] ·) down_e[r]·h_q[t][j], with h_q the Q8_K rows of h (quant.cu): every output value is
// owned by one warp, so no atomics and a fixed order. Whether the route weight is applied in gate_up or in
// down_sum (or neither) is the caller's choice; the CPU backend applies it at the sum.

template <class B>
__device__ __forceinline__ void ds4_moe_gate_up(const u8* __restrict__ gate, const u8* __restrict__ up,
                                                i64 expert_bytes, int n_experts, const i8* __restrict__ aq,
                                                const float* __restrict__ ad, const i32* __restrict__ bs,
                                                const i32* __restrict__ ids, const float* __restrict__ rw,
                                                float* __restrict__ h, int ffn, int cols, int n_used, float limit) {
    const int row = blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP, lane = threadIdx.x & 31;
    if (row >= ffn) return;
    const int slot = blockIdx.y, tok = blockIdx.z;
    const i64 ts = (i64)tok * n_used + slot;
    const i32 e = ids[ts];
    float* out = h + ts * ffn + row;
    if ((u32)e >= (u32)n_experts) {
        if (lane == 0) *out = __int_as_float(0x7fc00000);
        return;
    }
    const int nb = cols / B::VALUES;
    const i64 off = (i64)e * expert_bytes + (i64)row * nb * B::BYTES;
    const i8* xq = aq + (i64)tok * cols;
    const float* xd = ad + (i64)tok * cols / B::VALUES;
    const i32* xb = bs + (i64)tok * cols / 16;
    float g[1], u[1];
    ds4_row_dot<B, 1>(gate + off, nb, xq, xd, xb, cols, 1, g);
    ds4_row_dot<B, 1>(up + off, nb, xq, xd, xb, cols, 1, u);
    if (lane == 0) {
        float v = __fmul_rn(ds4_silu(fminf(g[0], limit)), fminf(fmaxf(u[0], -limit), limit));
        if (rw) v = __fmul_rn(v, rw[ts]);
        *out = v;
    }
}

template <class B>
__device__ __forceinline__ void ds4_moe_down_sum(const u8* __restrict__ down, i64 expert_bytes, int n_experts,
                                                 const i8* __restrict__ hq, const float* __restrict__ hd,
                                                 const i32* __restrict__ hbs, const i32* __restrict__ ids,
                                                 const float* __restrict__ rw, float* __restrict__ out,
                                                 int d_model, int ffn, int n_used) {
    const int row = blockIdx.x * (blockDim.x / DS4_WARP) + threadIdx.x / DS4_WARP, lane = threadIdx.x & 31;
    if (row >= d_model) return;
    const int tok = blockIdx.y;
    const int nb = ffn / B::VALUES;
    float total = 0.0f;
    for (int j = 0; j < n_used; ++j) {
        const i64 ts = (i64)tok * n_used + j;
        const i32 e = ids[ts];
        if ((u32)e >= (u32)n_experts) {
            total = __int_as_float(0x7fc00000);
            continue;
        }
        float r[1];
        ds4_row_dot<B, 1>(down + (i64)e * expert_bytes + (i64)row * nb * B::BYTES, nb, hq + ts * ffn,
                          hd + ts * ffn / B::VALUES, hbs + ts * ffn / 16, ffn, 1, r);
        total = __fadd_rn(total, rw ? __fmul_rn(rw[ts], r[0]) : r[0]);
    }
    if (lane == 0) out[(i64)tok * d_model + row] = total;
}

#define DS4_MOE(sfx, B)                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) ds4_moe_gate_up_##sfx(                                      \
        const u8* __restrict__ gate, const u8* __restrict__ up, i64 expert_bytes, int n_experts,                  \
        const i8* __restrict__ aq, const float* __restrict__ ad, const i32* __restrict__ bs,                      \
        const i32* __restrict__ ids, const float* __restrict__ rw, float* __restrict__ h, int ffn, int cols,      \
        int n_used, float limit) {                                                                                 \
        ds4_moe_gate_up<B>(gate, up, expert_bytes, n_experts, aq, ad, bs, ids, rw, h, ffn, cols, n_used, limit);  \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) ds4_moe_down_sum_##sfx(                                     \
        const u8* __restrict__ down, i64 expert_bytes, int n_experts, const i8* __restrict__ hq,                  \
        const float* __restrict__ hd, const i32* __restrict__ hbs, const i32* __restrict__ ids,                   \
        const float* __restrict__ rw, float* __restrict__ out, int d_model, int ffn, int n_used) {                \
        ds4_moe_down_sum<B>(down, expert_bytes, n_experts, hq, hd, hbs, ids, rw, out, d_model, ffn, n_used);      \
    }

DS4_MOE(iq2_xxs, Ds4BlkIq2xxs)
DS4_MOE(q2_k, Ds4BlkQ2K)
DS4_MOE(q4_k, Ds4BlkQ4K)

// Routing of n rows over ne experts, one thread per row (the CPU backend's moe.rs, step for step): scores
// s = sqrt(softplus(logit)); the row's k experts are the token's fixed ones from `table` (hash routing: table
// non-null, row r's token tokens[r]) or the top k of s + bias (bias may be null), best first, ties to the lower
// id; weights w_j = s[e_j], divided by (Σ w + 1e-20) when `norm`, times `scale`. ids and rw are n × k.
#define DS4_ROUTE_MAX_K 16
__device__ __forceinline__ float ds4_route_score(float x) {
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    return sqrtf(sp);
}

extern "C" __global__ void __launch_bounds__(256) ds4_moe_route(const float* __restrict__ logits,
                                                                const float* __restrict__ bias,
                                                                const i32* __restrict__ table,
                                                                const i32* __restrict__ tokens, i32* __restrict__ ids,
                                                                float* __restrict__ rw, int n, int ne, int k, int norm,
                                                                float scale) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n || k <= 0 || k > DS4_ROUTE_MAX_K) return;
    const float* lr = logits + (i64)r * ne;
    int sel[DS4_ROUTE_MAX_K];
    float key[DS4_ROUTE_MAX_K];
    if (table) {
        for (int j = 0; j < k; ++j) sel[j] = table[(i64)tokens[r] * k + j];
    } else {
        int n_in = 0;
        for (int e = 0; e < ne; ++e) {
            const float v = __fadd_rn(ds4_route_score(lr[e]), bias ? bias[e] : 0.0f);
            int at = n_in;
            while (at > 0 && key[at - 1] < v) --at;
            if (at < k) {
                const int end = n_in < k - 1 ? n_in : k - 1;
                for (int i = end - 1; i >= at; --i) {
                    sel[i + 1] = sel[i];
                    key[i + 1] = key[i];
                }
                sel[at] = e;
                key[at] = v;
                n_in = n_in + 1 < k ? n_in + 1 : k;
            }
        }
    }
    // The weights: the chosen experts' scores (recomputed rather than kept: fewer live registers), their sum
    // first, in selection order.
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
        const int e = sel[j];
        sum = __fadd_rn(sum, (e >= 0 && e < ne) ? ds4_route_score(lr[e]) : __int_as_float(0x7fc00000));
    }
    for (int j = 0; j < k; ++j) {
        const int e = sel[j];
        float v = (e >= 0 && e < ne) ? ds4_route_score(lr[e]) : __int_as_float(0x7fc00000);
        if (norm) v = v / __fadd_rn(sum, 1e-20f);
        ids[(i64)r * k + j] = e;
        rw[(i64)r * k + j] = __fmul_rn(v, scale);
    }
}
