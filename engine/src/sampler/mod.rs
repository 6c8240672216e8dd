//! Token sampling: greedy, temperature, top-k, top-p, min-p, seeds, stop sequences.
