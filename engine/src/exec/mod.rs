//! Executors: run a [`crate::graph`] job graph on a backend.
