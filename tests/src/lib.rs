//! Shared helpers for ds4's cross-crate integration tests (locating `../shared`, running the CLI binaries).
