// Interleaved RoPE on the last `rope_dim` values of each head: pairs (2i, 2i+1) of the rope slice rotate by the
// angle whose (cos, sin) the CPU precomputed (YaRN frequencies included) into cs[(t * rope_dim / 2 + i) * 2 + {0,1}].
// `inverse` != 0 rotates by the negative angle (sin -> -sin). Head h of token t starts at
// offset + t * tok_stride + h * head_stride; the head is `head_dim` values, the rope slice its last `rope_dim`.
// In place. Dispatch (ceil(rope_dim / 2 * heads / 64), n_tok, 1).
struct Params {
    n_tok: u32,
    heads: u32,
    head_dim: u32,
    rope_dim: u32,
    offset: u32,
    tok_stride: u32,
    head_stride: u32,
    inverse: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> cs: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let half = p.rope_dim / 2u;
    let t = gid.y;
    if (gid.x >= half * p.heads || t >= p.n_tok) {
        return;
    }
    let h = gid.x / half;
    let i = gid.x % half;
    let c = cs[(t * half + i) * 2u];
    var s = cs[(t * half + i) * 2u + 1u];
    if (p.inverse != 0u) {
        s = -s;
    }
    let b = p.offset + t * p.tok_stride + h * p.head_stride + p.head_dim - p.rope_dim + 2u * i;
    let a0 = x[b];
    let a1 = x[b + 1u];
    x[b] = a0 * c - a1 * s;
    x[b + 1u] = a1 * c + a0 * s;
}
