//! Token sampling: greedy, temperature, top-k, top-p, min-p, seeds, penalties, stop sequences.
//!
//! Guide:
//! * [`Sampler`] picks the next id from a logits row. Order of operations: penalties (repetition / presence /
//!   frequency over the ids passed to [`Sampler::accept`]) → if the best id is a *structural* token (see
//!   [`Sampler::set_structural_tokens`]) or temperature is 0 → argmax → otherwise logits / temperature → softmax →
//!   top-k → top-p (smallest set of most likely ids whose mass reaches `top_p`) → min-p (drop ids below
//!   `min_p × p_max`) → renormalise → draw with the seeded [`Rng`]. [`filtered_distribution`] exposes the final
//!   distribution for tests and diagnostics.
//! * Same seed and same logits sequence → same ids, on every platform (the PRNG is xoshiro256** seeded by
//!   splitmix64, all arithmetic in f64 in a fixed order).
//! * [`top_candidates`]: a row's few best logits, all a greedy or top-k sampler without penalties reads
//!   ([`SamplerConfig::candidates`]); a device backend reads back only those ([`expand_candidates`] rebuilds a row
//!   that draws the same id).
//! * [`StopChecker`]: text-level stop sequences across token boundaries (text that could start a stop sequence is
//!   held back) and a max-token limit. [`partial_suffix_len`] is the holdback rule itself (the DSML stream parser
//!   and the server's stop strings use it too).
//!
//! Errors: invalid settings (negative temperature, top_p outside (0, 1], …) or a logits row with no finite value.
//! Nothing panics.

mod candidates;
mod rng;
mod sample;
mod stop;

pub use candidates::{expand_candidates, top_candidates};
pub use rng::Rng;
pub use sample::{argmax, filtered_distribution, Sampler, SamplerConfig, Verdict};
pub use stop::{partial_suffix_len, StopChecker, StopReason, StopStatus};
