#!/usr/bin/env python3
"""usage: compare.py A.f32 B.f32 N_VOCAB TOLERANCE — max |a - b| over two little-endian f32 [rows, vocab] files
(stdlib only); exits 1 when the files differ in size, hold a non-finite value, or differ by more than TOLERANCE."""
import math
import sys
from array import array


def load(p):
    a = array("f")
    with open(p, "rb") as f:
        a.frombytes(f.read())
    if sys.byteorder != "little":
        a.byteswap()
    return a


a, b, vocab, tol = load(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
if len(a) != len(b) or len(a) % vocab:
    sys.exit(f"size mismatch: {len(a)} vs {len(b)} values (vocab {vocab})")
worst, at = 0.0, 0
for i, (x, y) in enumerate(zip(a, b)):
    if not (math.isfinite(x) and math.isfinite(y)):
        sys.exit(f"non-finite logit at row {i // vocab}, token {i % vocab}: {x} vs {y}")
    d = abs(x - y)
    if d > worst:
        worst, at = d, i
rows = len(a) // vocab
argmax_same = sum(
    max(range(vocab), key=lambda j: a[r * vocab + j]) == max(range(vocab), key=lambda j: b[r * vocab + j])
    for r in range(rows)
)
print(f"{rows} rows x {vocab}: max |diff| = {worst:.3g} (row {at // vocab}, token {at % vocab}); "
      f"argmax equal on {argmax_same}/{rows} rows; tolerance {tol:g}")
sys.exit(0 if worst <= tol else 1)
