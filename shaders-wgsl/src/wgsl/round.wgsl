// Rounding to the small float formats of the activation simulation (FP8 e4m3, FP4 e2m1), shared by `act.wgsl` and
// `norm.wgsl` (composed before them): every kernel that simulates a format rounds with the same operations.

fn round_even(v: f32) -> f32 {
    let f = floor(v);
    let d = v - f;
    if (d > 0.5) {
        return f + 1.0;
    }
    if (d < 0.5) {
        return f;
    }
    return select(f + 1.0, f, (f * 0.5) == floor(f * 0.5));
}

// Round |v| (already scaled) to a float with `mbits` mantissa bits and minimum normal exponent `emin`, saturate at mx.
fn round_mini(v: f32, mbits: f32, emin: f32, mx: f32) -> f32 {
    let a = abs(v);
    if (a == 0.0) {
        return v;
    }
    let e = max(floor(log2(a)), emin);
    let q = exp2(e - mbits);
    let r = min(round_even(a / q) * q, mx);
    return select(r, -r, v < 0.0);
}
