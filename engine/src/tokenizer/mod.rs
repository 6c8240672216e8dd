//! The DeepSeek-V4 byte-level BPE tokenizer, from `tokenizer.json` or GGUF `tokenizer.ggml.*` metadata, and an
//! incremental detokenizer for streaming.
