//! Lossless compact encodings for row blocks of f32 values.
//!
//! The engine's live KV values are already rounded (FP8 e4m3 with a power-of-two scale per 64 values for the 448
//! non-rope dims, 16-bit rope dims, FP4 indexer rows), so most of them fit in far fewer than 32 bits. Every encoding
//! here is checked on encode by decoding it again and comparing bit patterns: a value is never stored in a format that
//! does not give it back exactly. The encoder picks the smallest of:
//!
//! * [`Encoding::F32`]: raw little-endian f32 (always possible).
//! * [`Encoding::F16`]: IEEE half, when every value round-trips bit-exactly.
//! * [`Encoding::Blocked`]: the values cut into chunks of [`CHUNK`] (the last may be short); each chunk is one tag byte
//!   then its payload. Tag `0..=253`: FP8 e4m3 codes (1 byte per value), value = `decode(code) * 2^(tag - 127)`;
//!   tag [`TAG_F16`]: f16 values; tag [`TAG_F32`]: f32 values. A KV row of 448 FP8 dims + 64 bf16-exact rope dims
//!   costs 448 + 128 + 8 bytes instead of 2048.
//!
//! Chunks run over the flattened values of the block (row-major), so a chunk lines up with the engine's 64-value FP8
//! blocks whenever the row width is a multiple of 64. Decoding validates lengths and tags and returns
//! [`KvError::Corrupt`] on malformed input; nothing here panics on bad bytes.

use half::f16;

use crate::error::{KvError, KvResult as Result};

/// Values per chunk of the [`Encoding::Blocked`] encoding (the engine's FP8 block size).
pub const CHUNK: usize = 64;
/// Chunk tag: the chunk holds f16 values.
pub const TAG_F16: u8 = 0xFE;
/// Chunk tag: the chunk holds f32 values.
pub const TAG_F32: u8 = 0xFF;
const SCALE_BIAS: i32 = 127;

/// How a row block's values are stored on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Encoding {
    /// Little-endian f32.
    F32,
    /// Little-endian IEEE f16.
    F16,
    /// Per-chunk tag byte + FP8 e4m3 / f16 / f32 payload (see module docs).
    Blocked,
}

impl Encoding {
    /// The id written in file headers.
    pub fn id(self) -> u8 {
        match self {
            Encoding::F32 => 0,
            Encoding::F16 => 1,
            Encoding::Blocked => 2,
        }
    }

    /// Parses a header id.
    pub fn from_id(id: u8) -> Option<Encoding> {
        match id {
            0 => Some(Encoding::F32),
            1 => Some(Encoding::F16),
            2 => Some(Encoding::Blocked),
            _ => None,
        }
    }

    /// A short name for listings.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::F32 => "f32",
            Encoding::F16 => "f16",
            Encoding::Blocked => "fp8-blocked",
        }
    }
}

/// The 256 e4m3 (OCP "FN" variant: no infinities, NaN = S.1111.111) code values as f32.
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [0f32; 256];
        for (code, slot) in t.iter_mut().enumerate() {
            let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
            let exp = ((code >> 3) & 0x0F) as i32;
            let man = (code & 0x07) as f32;
            *slot = if exp == 15 && code & 0x07 == 7 {
                f32::NAN
            } else if exp == 0 {
                sign * man * (2f32).powi(-9)
            } else {
                sign * (1.0 + man / 8.0) * (2f32).powi(exp - 7)
            };
        }
        t
    })
}

/// Decodes one e4m3 code.
pub fn e4m3_to_f32(code: u8) -> f32 {
    e4m3_table()[code as usize]
}

/// The e4m3 code whose value is exactly `x`, if there is one (NaN never matches).
pub fn f32_to_e4m3_exact(x: f32) -> Option<u8> {
    if !x.is_finite() {
        return None;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a == 0.0 {
        return Some(sign);
    }
    if a > 448.0 {
        return None;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32 - 127;
    let code = if exp >= -6 {
        if bits & ((1 << 20) - 1) != 0 {
            return None;
        }
        ((exp + 7) as u8) << 3 | ((bits >> 20) & 0x7) as u8
    } else {
        let m = a * 512.0; // exact: power-of-two multiply of a value >= 2^-149 * 2^9
        if m.fract() != 0.0 || !(1.0..8.0).contains(&m) {
            return None;
        }
        m as u8
    };
    let code = code | sign;
    (e4m3_to_f32(code).to_bits() == x.to_bits()).then_some(code)
}

fn pow2(e: i32) -> f32 {
    // e is in -127..=126 here; 2^-127 is subnormal but exact.
    (2f64).powi(e) as f32
}

/// FP8-encodes a chunk with a power-of-two scale if every value round-trips; returns the tag.
fn try_fp8_chunk(chunk: &[f32], out: &mut Vec<u8>) -> Option<u8> {
    let mut amax = 0f32;
    for &v in chunk {
        if !v.is_finite() {
            return None;
        }
        amax = amax.max(v.abs());
    }
    let candidates: [i32; 2] = if amax == 0.0 {
        [0, 0]
    } else {
        let e = ((amax.to_bits() >> 23) & 0xFF) as i32 - 127;
        [e - 8, e - 7]
    };
    let start = out.len();
    'scale: for s in candidates {
        if !(-SCALE_BIAS..=(TAG_F16 as i32 - 1 - SCALE_BIAS)).contains(&s) {
            continue;
        }
        out.truncate(start);
        let scale = pow2(s);
        let inv = pow2(-s);
        for &v in chunk {
            let x = v * inv;
            let Some(code) = f32_to_e4m3_exact(x) else { continue 'scale };
            if (e4m3_to_f32(code) * scale).to_bits() != v.to_bits() {
                continue 'scale;
            }
            out.push(code);
        }
        return Some((s + SCALE_BIAS) as u8);
    }
    out.truncate(start);
    None
}

fn f16_exact(v: f32) -> Option<f16> {
    let h = f16::from_f32(v);
    (h.to_f32().to_bits() == v.to_bits()).then_some(h)
}

/// Encodes `values` with the smallest lossless encoding; returns it and the bytes.
pub fn encode(values: &[f32]) -> (Encoding, Vec<u8>) {
    let mut blocked = Vec::with_capacity(values.len() + values.len().div_ceil(CHUNK));
    let mut any_fp8 = false;
    let mut all_f16 = true;
    let mut chunk_buf = Vec::with_capacity(CHUNK);
    for chunk in values.chunks(CHUNK) {
        chunk_buf.clear();
        if let Some(tag) = try_fp8_chunk(chunk, &mut chunk_buf) {
            any_fp8 = true;
            blocked.push(tag);
            blocked.extend_from_slice(&chunk_buf);
            continue;
        }
        blocked.push(TAG_F16);
        let at = blocked.len();
        let mut ok = true;
        for &v in chunk {
            match f16_exact(v) {
                Some(h) => blocked.extend_from_slice(&h.to_le_bytes()),
                None => {
                    ok = false;
                    break;
                }
            }
        }
        if !ok {
            all_f16 = false;
            blocked.truncate(at);
            *blocked.last_mut().expect("tag pushed above") = TAG_F32;
            for v in chunk {
                blocked.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
    let f16_len = values.len() * 2;
    if any_fp8 && (!all_f16 || blocked.len() < f16_len) && blocked.len() < values.len() * 4 {
        return (Encoding::Blocked, blocked);
    }
    if all_f16 {
        let mut out = Vec::with_capacity(f16_len);
        for &v in values {
            out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        return (Encoding::F16, out);
    }
    if cfg!(target_endian = "little") {
        return (Encoding::F32, bytemuck::cast_slice::<f32, u8>(values).to_vec());
    }
    (Encoding::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// Decodes `bytes` (encoded as `enc`) into exactly `out.len()` values.
pub fn decode(enc: Encoding, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let n = out.len();
    let bad = |what: &str| KvError::Corrupt(format!("{} payload: {what}", enc.name()));
    match enc {
        Encoding::F32 => {
            if bytes.len() != n * 4 {
                return Err(bad("length mismatch"));
            }
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Encoding::F16 => {
            if bytes.len() != n * 2 {
                return Err(bad("length mismatch"));
            }
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        Encoding::Blocked => {
            let table = e4m3_table();
            let mut pos = 0usize;
            for chunk in out.chunks_mut(CHUNK) {
                let tag = *bytes.get(pos).ok_or_else(|| bad("truncated"))?;
                pos += 1;
                let width = match tag {
                    TAG_F32 => 4,
                    TAG_F16 => 2,
                    _ => 1,
                };
                let body = bytes.get(pos..pos + chunk.len() * width).ok_or_else(|| bad("truncated"))?;
                pos += body.len();
                match tag {
                    TAG_F32 => {
                        for (o, b) in chunk.iter_mut().zip(body.chunks_exact(4)) {
                            *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        }
                    }
                    TAG_F16 => {
                        for (o, b) in chunk.iter_mut().zip(body.chunks_exact(2)) {
                            *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                        }
                    }
                    _ => {
                        let scale = pow2(tag as i32 - SCALE_BIAS);
                        for (o, &c) in chunk.iter_mut().zip(body) {
                            *o = table[c as usize] * scale;
                        }
                    }
                }
            }
            if pos != bytes.len() {
                return Err(bad("trailing bytes"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(values: &[f32]) -> Encoding {
        let (enc, bytes) = encode(values);
        let mut out = vec![0f32; values.len()];
        decode(enc, &bytes, &mut out).unwrap();
        for (a, b) in values.iter().zip(&out) {
            assert_eq!(a.to_bits(), b.to_bits(), "{a} vs {b} under {enc:?}");
        }
        enc
    }

    /// A tiny deterministic generator (no rand dependency in the crate).
    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Rounds like the engine does: e4m3 with scale 2^ceil(log2(amax/448)) per 64 values.
    fn fp8_round(values: &mut [f32]) {
        for chunk in values.chunks_mut(64) {
            let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = (amax / 448.0).log2().ceil() as i32;
            let scale = (2f32).powi(s);
            for v in chunk.iter_mut() {
                let x = *v / scale;
                // nearest e4m3 value by brute force over the table
                let best = (0u8..=255)
                    .filter(|&c| e4m3_to_f32(c).is_finite())
                    .min_by(|&a, &b| (e4m3_to_f32(a) - x).abs().total_cmp(&(e4m3_to_f32(b) - x).abs()))
                    .unwrap();
                *v = e4m3_to_f32(best) * scale;
            }
        }
    }

    #[test]
    fn e4m3_table_known_values() {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
        for c in 0u8..=255 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                assert_eq!(f32_to_e4m3_exact(v), None);
            } else {
                assert_eq!(f32_to_e4m3_exact(v), Some(c), "code {c:#x}");
            }
        }
        assert_eq!(f32_to_e4m3_exact(1.0625), None);
        assert_eq!(f32_to_e4m3_exact(480.0), None);
    }

    #[test]
    fn random_f32_falls_back_to_f32() {
        let mut seed = 1;
        let v: Vec<f32> = (0..1000).map(|_| lcg(&mut seed) * 3.3).collect();
        assert_eq!(roundtrip(&v), Encoding::F32);
    }

    #[test]
    fn f16_exact_values_use_f16() {
        let mut seed = 2;
        let v: Vec<f32> = (0..1000).map(|_| f16::from_f32(lcg(&mut seed) * 10.0).to_f32()).collect();
        assert_eq!(roundtrip(&v), Encoding::F16);
    }

    #[test]
    fn fp8_rows_with_rope_dims_use_blocked_and_are_small() {
        let mut seed = 3;
        let rows = 16;
        let mut v = Vec::new();
        for _ in 0..rows {
            let mut nope: Vec<f32> = (0..448).map(|_| lcg(&mut seed) * 5.0).collect();
            fp8_round(&mut nope);
            v.extend(nope);
            v.extend((0..64).map(|_| half::bf16::from_f32(lcg(&mut seed)).to_f32()));
        }
        let (enc, bytes) = encode(&v);
        assert_eq!(enc, Encoding::Blocked);
        assert_eq!(bytes.len(), rows * (448 + 128 + 8));
        roundtrip(&v);
    }

    #[test]
    fn special_values_round_trip() {
        let v = [0.0, -0.0, f32::NAN, f32::INFINITY, f32::MIN_POSITIVE / 8.0, 1e30, -448.0, 2f32.powi(-130)];
        roundtrip(&v);
        let zeros = vec![0f32; 200];
        assert_eq!(roundtrip(&zeros), Encoding::Blocked);
        let mut tiny = vec![2f32.powi(-140); 64];
        tiny[3] = -(2f32.powi(-138));
        roundtrip(&tiny);
        roundtrip(&[]);
    }

    #[test]
    fn corrupt_payloads_are_errors() {
        let v: Vec<f32> = vec![1.0; 100];
        let (enc, bytes) = encode(&v);
        assert_eq!(enc, Encoding::Blocked);
        let mut out = vec![0f32; 100];
        assert!(decode(enc, &bytes[..bytes.len() - 1], &mut out).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(enc, &longer, &mut out).is_err());
        assert!(decode(Encoding::F32, &bytes, &mut out).is_err());
        assert!(decode(Encoding::F16, &bytes, &mut out).is_err());
        let mut bad_tag = bytes.clone();
        bad_tag[0] = TAG_F32;
        assert!(decode(enc, &bad_tag, &mut out).is_err());
    }
}
