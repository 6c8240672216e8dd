//! # ds4-kv
//!
//! The KV cache as a first-class, paged, multi-tier store: pages of KV state keyed by a chained hash of the token
//! prefix, living on device, host or disk, shared between sessions, written to disk crash-safely and evicted by a
//! policy that keeps widely shared prefixes.
