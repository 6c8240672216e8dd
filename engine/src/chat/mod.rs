//! Chat rendering (messages → prompt text, the official DeepSeek-V4 encoding) and output parsing (completion text →
//! reasoning, content, DSML tool calls).
