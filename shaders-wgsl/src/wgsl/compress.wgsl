// Compressor pooling: each compressed row w is a per-feature softmax-weighted sum over `slots` source slots.
// slot (w, s) = sl[3 * (w * slots + s) + {0, 1, 2}] = (token row, feature offset, ape row); token row 0xffffffff
// marks an empty slot (weight 0, like a -inf gate). For feature f < dim:
//   z_s = gate[row * src_stride + off + f] + ape[ape_row * ape_stride + off + f],  c_s = kv[row * src_stride + off + f]
//   out[out_offset + w * out_stride + f] = sum_s softmax_s(z)_s c_s      (0 when every slot is empty).
// RMSNorm and RoPE of the pooled row are separate kernels. Dispatch (ceil(dim / 64), n_windows, 1).
struct Params {
    n_windows: u32,
    slots: u32,
    dim: u32,
    src_stride: u32,
    ape_stride: u32,
    out_offset: u32,
    out_stride: u32,
    _p0: u32,
}

@group(0) @binding(0) var<storage, read_write> kv: array<f32>;
@group(0) @binding(1) var<storage, read_write> gate: array<f32>;
@group(0) @binding(2) var<storage, read> ape: array<f32>;
@group(0) @binding(3) var<storage, read> sl: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;

const EMPTY: u32 = 0xffffffffu;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let f = gid.x;
    let w = gid.y;
    if (f >= p.dim || w >= p.n_windows) {
        return;
    }
    var mx = -3.4e38;
    var any = false;
    for (var s = 0u; s < p.slots; s++) {
        let e = 3u * (w * p.slots + s);
        let row = sl[e];
        if (row == EMPTY) {
            continue;
        }
        let off = sl[e + 1u];
        let z = gate[row * p.src_stride + off + f] + ape[sl[e + 2u] * p.ape_stride + off + f];
        mx = max(mx, z);
        any = true;
    }
    var num = 0.0;
    var den = 0.0;
    if (any) {
        for (var s = 0u; s < p.slots; s++) {
            let e = 3u * (w * p.slots + s);
            let row = sl[e];
            if (row == EMPTY) {
                continue;
            }
            let off = sl[e + 1u];
            let z = gate[row * p.src_stride + off + f] + ape[sl[e + 2u] * p.ape_stride + off + f];
            let a = exp(z - mx);
            num += a * kv[row * p.src_stride + off + f];
            den += a;
        }
    }
    out[p.out_offset + w * p.out_stride + f] = select(0.0, num / den, any);
}
