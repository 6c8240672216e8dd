//! Flat component tables (struct-of-arrays; ids are indices): sessions and their KV state.
