// Embedding lookup / row dequantization: y[out_k * y_stride + c] = W[row_k, c] for each id pair k.
// Composed after bytes.wgsl and one quant_*.wgsl. `ids` holds (row_k, out_k) pairs; rows index the bound buffer.
// Dispatch: (ceil(cols / 64), n_ids, 1).
// Entry `embed_norm` (the embedding of a tick's rows into the mHC streams and the streams' unweighted RMSNorm, in
// one dispatch; one workgroup of 64 per id pair k = (row, r), dispatch (n_ids, 1, 1)): with n = copies · cols,
//   y[r * n + j * cols + c] = W[row, c] for j < copies (the streams),
//   y2[r * n + i] = y[r * n + i] * rsqrt(mean(y[r * n ..][..n]^2) + eps) (norm.wgsl's `main` without weight: the
//   same sums in the same order, bit for bit).
struct Params {
    n_ids: u32,
    cols: u32,
    row_bytes: u32,
    y_offset: u32,
    y_stride: u32,
    copies: u32,
    eps: f32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
// Unused by block_value; declared so the quant files (whose block_dot reads `x`) compile here too.
@group(0) @binding(4) var<storage, read> x: array<f32>;
@group(0) @binding(5) var<storage, read_write> y2: array<f32>;

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let k = gid.y;
    if (c >= p.cols || k >= p.n_ids) {
        return;
    }
    let row = ids[2u * k];
    let out = ids[2u * k + 1u];
    let nb = p.cols / BLOCK_VALUES;
    y[p.y_offset + out * p.y_stride + c] = block_value(row * p.row_bytes, c / BLOCK_VALUES, nb, c % BLOCK_VALUES);
}

@compute @workgroup_size(64)
fn embed_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let k = wg.x;
    if (k >= p.n_ids) {
        return;
    }
    let r = ids[2u * k + 1u];
    let n = p.copies * p.cols;
    let rb = ids[2u * k] * p.row_bytes;
    var ss = 0.0;
    for (var i = li; i < n; i += 64u) {
        let c = i % p.cols;
        let v = block_value(rb, c / BLOCK_VALUES, p.cols / BLOCK_VALUES, c % BLOCK_VALUES);
        y[r * n + i] = v;
        ss += v * v;
    }
    partial[li] = ss;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (li < s) {
            partial[li] += partial[li + s];
        }
        workgroupBarrier();
    }
    let scale = inverseSqrt(partial[0] / f32(n) + p.eps);
    for (var i = li; i < n; i += 64u) {
        let c = i % p.cols;
        y2[r * n + i] = block_value(rb, c / BLOCK_VALUES, p.cols / BLOCK_VALUES, c % BLOCK_VALUES) * scale;
    }
}
