//! The per-step job graph: ops with declared reads and writes, as plain data.
