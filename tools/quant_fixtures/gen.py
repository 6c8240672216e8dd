#!/usr/bin/env python3
"""Generate the IQ2_XXS format tables and the quant cross-check fixtures for ds4-engine.

Everything here comes from the PyPI `gguf` package (an independent numpy implementation of the ggml formats):

* `engine/src/quant/iq2_tables.rs`: the iq2xxs grid (256 x 8 magnitudes, packed one byte per magnitude into a u64,
  little-endian, exactly like ggml's `iq2xxs_grid`), `ksigns_iq2xs` (128 bytes) and the kmask. Taken from
  `gguf.quants.IQ2_XXS.grid_hex / grid_map / ksigns`.
* `engine/tests/fixtures/quant/<type>.q` + `<type>.f32`: random raw blocks of every type and the f32 values that
  `gguf.quants.dequantize` gives for them. For Q2_K, Q4_K and IQ2_XXS (which gguf only dequantizes) the blocks are
  random bytes with finite, moderate f16 scales.
* `q8_0_in.f32` + `q8_0_out.q`, `bf16_in.f32` + `bf16_out.q`, `f16_in.f32` + `f16_out.q`: gguf's quantizer output
  for random input, to compare our quantizers byte for byte.

Rerun from the repo root:  pip install gguf numpy && python3 tools/quant_fixtures/gen.py
The output is deterministic (fixed seed) for a given gguf/numpy version.
"""

import os
import subprocess
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIX = os.path.join(ROOT, "engine", "tests", "fixtures", "quant")
TABLES = os.path.join(ROOT, "engine", "src", "quant", "iq2_tables.rs")

rng = np.random.default_rng(20261130)


def f16_bytes(vals):
    return np.asarray(vals, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def scales_f16(n, lo=1e-3, hi=0.2, signed=False):
    v = rng.uniform(lo, hi, size=n)
    if signed:
        v *= rng.choice([-1.0, 1.0], size=n)
    return f16_bytes(v)


def write(name, raw: np.ndarray, vals: np.ndarray):
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    vals = np.ascontiguousarray(vals, dtype="<f4")
    with open(os.path.join(FIX, name + ".q"), "wb") as f:
        f.write(raw.tobytes())
    with open(os.path.join(FIX, name + ".f32"), "wb") as f:
        f.write(vals.tobytes())


def gen_tables():
    q = quants.IQ2_XXS
    q.init_grid()
    grid = np.asarray(q.grid, dtype=np.float32).reshape(256, 8).astype(np.uint8)
    assert set(np.unique(grid).tolist()) <= {0x08, 0x19, 0x2B}
    packed = [int.from_bytes(bytes(row.tolist()), "little") for row in grid]
    ksigns = list(q.ksigns)
    assert len(ksigns) == 128
    lines = [
        "//! IQ2_XXS format constants (generated; do not edit).",
        "//!",
        "//! Written by `tools/quant_fixtures/gen.py` from the PyPI `gguf` package (`gguf.quants.IQ2_XXS.grid_hex`,",
        "//! `grid_map`, `ksigns`), which mirrors ggml's `iq2xxs_grid`, `ksigns_iq2xs` and `kmask_iq2xs`.",
        "//! `IQ2XXS_GRID[i]` packs the 8 magnitudes of grid point `i` one per byte, little-endian (byte `j` = value `j`),",
        "//! each one of 0x08, 0x19, 0x2b. `KSIGNS_IQ2XS[k]` is the 8-bit sign mask for the 7-bit sign index `k` (bit 7 =",
        "//! parity of bits 0..6, so every pattern has an even number of minus signs); bit `j` set means value `j` is",
        "//! negative (`KMASK_IQ2XS[j] == 1 << j`).",
        "",
        "/// The 256 IQ2_XXS grid points, 8 magnitudes each, packed one byte per magnitude (little-endian).",
        "pub(crate) const IQ2XXS_GRID: [u64; 256] = [",
    ]
    for i in range(0, 256, 4):
        lines.append("    " + " ".join(f"0x{v:016x}," for v in packed[i : i + 4]))
    lines.append("];")
    lines.append("")
    lines.append("/// Sign masks for the 7-bit sign indices; bit 7 makes the count of minus signs even.")
    lines.append("pub(crate) const KSIGNS_IQ2XS: [u8; 128] = [")
    for i in range(0, 128, 16):
        lines.append("    " + " ".join(f"{v}," for v in ksigns[i : i + 16]))
    lines.append("];")
    lines.append("")
    lines.append("/// `KMASK_IQ2XS[j]` selects the sign bit of value `j` in a sign mask.")
    lines.append("pub(crate) const KMASK_IQ2XS: [u8; 8] = [1, 2, 4, 8, 16, 32, 64, 128];")
    lines.append("")
    with open(TABLES, "w") as f:
        f.write("\n".join(lines))
    # Match the committed file's formatting (the repo runs rustfmt on every source file).
    subprocess.run(["rustfmt", "--edition", "2021", TABLES], check=False)


def deq(raw, ty):
    return quants.dequantize(raw.reshape(-1), ty).reshape(-1)


def gen_fixtures():
    os.makedirs(FIX, exist_ok=True)
    nb = 16  # blocks per k-quant fixture

    # F16: random finite values (incl. subnormals and signed zero) -> gguf's f32.
    h = rng.integers(0, 1 << 16, size=1024, dtype=np.uint16)
    h = np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h).astype(np.uint16)  # no inf/nan
    raw = h.view(np.uint8)
    write("f16", raw, deq(raw, T.F16))

    # BF16: random finite bit patterns.
    b = rng.integers(0, 1 << 16, size=1024, dtype=np.uint16)
    b = np.where((b & 0x7F80) == 0x7F80, b & 0x807F, b).astype(np.uint16)
    raw = b.view(np.uint8)
    write("bf16", raw, deq(raw, T.BF16))

    # Q8_0: f16 d (signed), random i8 quants.
    d = scales_f16(64, signed=True)
    qs = rng.integers(0, 256, size=(64, 32), dtype=np.uint8)
    raw = np.concatenate([d, qs], axis=1)
    write("q8_0", raw, deq(raw, T.Q8_0))

    # Q2_K: scales[16], qs[64], d, dmin.
    sc = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    qs = rng.integers(0, 256, size=(nb, 64), dtype=np.uint8)
    raw = np.concatenate([sc, qs, scales_f16(nb), scales_f16(nb, hi=0.05)], axis=1)
    assert raw.shape[1] == 84
    write("q2_k", raw, deq(raw, T.Q2_K))

    # Q4_K: d, dmin, scales[12], qs[128].
    sc = rng.integers(0, 256, size=(nb, 12), dtype=np.uint8)
    qs = rng.integers(0, 256, size=(nb, 128), dtype=np.uint8)
    raw = np.concatenate([scales_f16(nb, hi=0.05), scales_f16(nb, hi=0.05), sc, qs], axis=1)
    assert raw.shape[1] == 144
    write("q4_k", raw, deq(raw, T.Q4_K))

    # IQ2_XXS: d, qs[64 bytes] (any byte pattern is a valid block).
    qs = rng.integers(0, 256, size=(nb, 64), dtype=np.uint8)
    raw = np.concatenate([scales_f16(nb, hi=0.02, signed=True), qs], axis=1)
    assert raw.shape[1] == 66
    write("iq2_xxs", raw, deq(raw, T.IQ2_XXS))

    # Quantizer outputs: Q8_0 (with an all-zero block and a block with exact .5 ties), BF16, F16.
    x = rng.standard_normal(32 * 64).astype(np.float32) * rng.uniform(0.01, 3.0, size=32 * 64).astype(np.float32)
    x[:32] = 0.0
    x[32:64] = np.arange(-16, 16, dtype=np.float32) * 0.5
    x[64] = 127.0 * 0.25
    out = quants.quantize(x.reshape(-1, 32), T.Q8_0)
    write("q8_0_quant", np.asarray(out).view(np.uint8), x)

    x = (rng.standard_normal(1024) * 10.0 ** rng.uniform(-6, 6, size=1024)).astype(np.float32)
    out = quants.quantize(x, T.BF16)
    write("bf16_quant", np.asarray(out).view(np.uint8), x)
    out = quants.quantize(x, T.F16)
    write("f16_quant", np.asarray(out).view(np.uint8), x)


if __name__ == "__main__":
    what = sys.argv[1:] or ["tables", "fixtures"]
    if "tables" in what:
        gen_tables()
    if "fixtures" in what:
        gen_fixtures()
    print("ok")
