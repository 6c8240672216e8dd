//! The CPU backend: reference implementations of every op, run on a worker pool.
