//! The converter: an official checkpoint folder (config.json + safetensors, f32/bf16/f16/FP8/FP4) → a DS4 GGUF file.
