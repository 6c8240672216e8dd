// Logit candidates: the k best logits of each row, best first (`Op::LogitCandidates`, the definition is
// `ds4_engine::sampler::top_candidates`): larger value first, the lower id first among equal values (-0 equals +0),
// NaN and -inf never taken; a row with fewer such values ends its list with id 0xffffffff (value -inf).
//
// Bindings: 0 logits `[rows, vocab]` f32; 1 out `[rows, k, 2]` u32 (id, value bits); 2 `Params`.
// One workgroup per row. Round r finds the best entry ranked after round r-1's pick (one pass over the row and a
// workgroup reduction), so k rounds give the k best in order. Values are compared through an order-preserving u32
// key of their bits, so no float comparison (whose NaN handling WGSL leaves open) decides anything.

struct Params {
    vocab: u32,
    k: u32,
    rows: u32,
    _p: u32,
}

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
const NEG_INF: u32 = 0xff800000u;

var<workgroup> s_key: array<u32, WG>;
var<workgroup> s_id: array<u32, WG>;

fn eligible(bits: u32) -> bool {
    let nan = (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0u;
    return !nan && bits != NEG_INF;
}

// Monotone in the value for every eligible value; -0 and +0 get the same key. Eligible keys are > 0 and
// < 0xffffffff.
fn key_of(bits: u32) -> u32 {
    var b = bits;
    if (b == 0x80000000u) {
        b = 0u;
    }
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

// Whether (ka, ia) ranks before (kb, ib).
fn before(ka: u32, ia: u32, kb: u32, ib: u32) -> bool {
    return ka > kb || (ka == kb && ia < ib);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wg.x;
    let base = row * p.vocab;
    let t = lid.x;
    // Round 0 takes anything: no eligible entry ranks at or before (0xffffffff, 0).
    var pk = NONE;
    var pi = 0u;
    for (var r = 0u; r < p.k; r++) {
        var bk = 0u;
        var bi = NONE;
        for (var i = t; i < p.vocab; i += WG) {
            let bits = bitcast<u32>(logits[base + i]);
            if (!eligible(bits)) {
                continue;
            }
            let k = key_of(bits);
            if (before(pk, pi, k, i) && before(k, i, bk, bi)) {
                bk = k;
                bi = i;
            }
        }
        s_key[t] = bk;
        s_id[t] = bi;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (t < s && before(s_key[t + s], s_id[t + s], s_key[t], s_id[t])) {
                s_key[t] = s_key[t + s];
                s_id[t] = s_id[t + s];
            }
            workgroupBarrier();
        }
        pk = s_key[0];
        pi = s_id[0];
        workgroupBarrier();
        if (t == 0u) {
            let o = (row * p.k + r) * 2u;
            out[o] = pi;
            if (pi == NONE) {
                out[o + 1u] = NEG_INF;
            } else {
                out[o + 1u] = bitcast<u32>(logits[base + pi]);
            }
        }
    }
}
