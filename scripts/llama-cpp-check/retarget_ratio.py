#!/usr/bin/env python3
"""Copies a tiny DeepSeek-V4 checkpoint folder, changing one compress ratio to another (stdlib only).

usage: retarget_ratio.py SRC_DIR DST_DIR FROM_RATIO TO_RATIO

llama.cpp supports only compression ratios 0, 4 and 128; the golden tiny checkpoints use 8 for their HCA layers.
Every layer whose ratio is FROM_RATIO gets TO_RATIO in config.json, and its compressor position embedding
`layers.N.attn.compressor.ape` (shape [ratio, width]) is rebuilt with TO_RATIO rows by repeating the old rows in
order. All other tensors are copied byte for byte. The result is a different (but equally valid) model: compare two
engines on it, not against the golden logits.
"""
import json
import struct
import sys
from pathlib import Path


def read_safetensors(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        tensors[name] = (info["dtype"], info["shape"], body[a:b])
    return header.get("__metadata__"), tensors


def write_safetensors(path, meta, tensors):
    header, offset, chunks = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        chunks.append(raw)
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(chunks))


def main():
    src, dst, old, new = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = json.loads((src / "config.json").read_text())
    ratios = cfg["compress_ratios"]
    layers = [i for i, r in enumerate(ratios[: cfg["num_hidden_layers"]]) if r == old]
    if not layers:
        sys.exit(f"no layer has compress ratio {old}")
    cfg["compress_ratios"] = [new if r == old else r for r in ratios]
    meta, tensors = read_safetensors(src / "model.safetensors")
    for il in layers:
        name = f"layers.{il}.attn.compressor.ape"
        dtype, shape, raw = tensors[name]
        if shape[0] != old:
            sys.exit(f"{name}: shape {shape}, expected [{old}, width]")
        row = len(raw) // old
        rows = [raw[i * row : (i + 1) * row] for i in range(old)]
        tensors[name] = (dtype, [new] + shape[1:], b"".join(rows[i % old] for i in range(new)))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    write_safetensors(dst / "model.safetensors", meta, tensors)
    print(f"layers {layers}: compress ratio {old} -> {new}")


if __name__ == "__main__":
    main()
