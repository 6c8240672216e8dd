// Embedding lookup / row dequantization: y[out_k * y_stride + c] = W[row_k, c] for each id pair k.
// Composed after bytes.wgsl and one quant_*.wgsl. `ids` holds (row_k, out_k) pairs; rows index the bound buffer.
// Dispatch: (ceil(cols / 64), n_ids, 1).
struct Params {
    n_ids: u32,
    cols: u32,
    row_bytes: u32,
    y_offset: u32,
    y_stride: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
// Unused by block_value; declared so the quant files (whose block_dot reads `x`) compile here too.
@group(0) @binding(4) var<storage, read> x: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let k = gid.y;
    if (c >= p.cols || k >= p.n_ids) {
        return;
    }
    let row = ids[2u * k];
    let out = ids[2u * k + 1u];
    let b = row * p.row_bytes + (c / BLOCK_VALUES) * BLOCK_BYTES;
    y[p.y_offset + out * p.y_stride + c] = block_value(b, c % BLOCK_VALUES);
}
