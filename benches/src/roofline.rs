//! The decode roofline: weight bytes one decoded token must read, and the tokens per second that the measured
//! memory bandwidth allows for it.
//!
//! Per token, single session: every tensor is read once, except the embedding (one row), the hash-routing table
//! `tid2eid` (one row) and the stacked routed experts `ffn_{gate,up,down}_exps` (only `used` of `n_experts`).
//! KV reads are not counted (small next to the weights at short context); so the roofline is an upper bound and
//! `gen_tps / roofline_tps` the fraction of it reached. With several sessions decoding in one batch the weights
//! are shared, so an aggregate fraction above 1 is possible and not an error.

use ds4_engine::gguf::GgufFile;

/// Weight bytes one decoded token reads (see the module docs), from the file's tensor names.
pub fn weight_bytes_per_token(f: &GgufFile, n_experts: usize, n_used: usize) -> u64 {
    f.tensors()
        .iter()
        .map(|t| {
            if t.name.ends_with("_exps.weight") && n_experts > 0 {
                t.n_bytes / n_experts as u64 * n_used as u64
            } else if t.name == "token_embd.weight" || t.name.ends_with("ffn_gate_tid2eid.weight") {
                t.n_bytes / t.n_rows().max(1)
            } else {
                t.n_bytes
            }
        })
        .sum()
}

/// Tokens per second that `gbs` GB/s allows when each token reads `bytes_per_token` bytes.
pub fn roofline_tps(gbs: f64, bytes_per_token: u64) -> f64 {
    if bytes_per_token == 0 {
        return f64::INFINITY;
    }
    gbs * 1e9 / bytes_per_token as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{build, footprint, Spec};

    #[test]
    fn roofline_divides_bandwidth_by_bytes() {
        assert_eq!(roofline_tps(10.0, 1_000_000_000), 10.0);
        assert_eq!(roofline_tps(5.0, 500_000_000), 10.0);
        assert!(roofline_tps(1.0, 0).is_infinite());
    }

    /// The name-based count (used for `-m FILE`) agrees with the converter-plan-based count of the synthetic
    /// builder, which knows each tensor's class.
    #[test]
    fn name_based_count_matches_the_plan() {
        let spec = Spec::parse("tiny:layers=3").unwrap();
        let s = build(&spec, 2, &indicatif::ProgressBar::hidden()).unwrap();
        let by_names = weight_bytes_per_token(&s.file, 8, 2);
        assert_eq!(by_names, s.bytes_per_token);
        assert_eq!(footprint(&spec).unwrap(), (s.bytes_per_token, s.tensor_bytes));
        assert!(by_names < s.tensor_bytes);
    }
}
