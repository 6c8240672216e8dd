#!/usr/bin/env python3
"""usage: compare.py A.f32 B.f32 N_VOCAB TOLERANCE [MIN_ARGMAX] — max |a - b| over two little-endian f32
[rows, vocab] files (stdlib only); also prints the mean |a - b|, the spread (standard deviation) of A's logits and on
how many rows the argmax agrees. Exits 1 when the files differ in size, hold a non-finite value, differ by more than
TOLERANCE, or (with MIN_ARGMAX, a fraction) agree on the argmax of fewer rows than that."""
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
min_argmax = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
worst, at, total, sum_a, sum_a2 = 0.0, 0, 0.0, 0.0, 0.0
for i, (x, y) in enumerate(zip(a, b)):
    if not (math.isfinite(x) and math.isfinite(y)):
        sys.exit(f"non-finite logit at row {i // vocab}, token {i % vocab}: {x} vs {y}")
    d = abs(x - y)
    total += d
    sum_a += x
    sum_a2 += x * x
    if d > worst:
        worst, at = d, i
rows = len(a) // vocab
argmax_same = sum(
    max(range(vocab), key=lambda j: a[r * vocab + j]) == max(range(vocab), key=lambda j: b[r * vocab + j])
    for r in range(rows)
)
n = max(len(a), 1)
spread = math.sqrt(max(sum_a2 / n - (sum_a / n) ** 2, 0.0))
print(f"{rows} rows x {vocab}: max |diff| = {worst:.3g} (row {at // vocab}, token {at % vocab}), "
      f"mean |diff| = {total / n:.3g}, logit spread (std) {spread:.3g}; argmax equal on {argmax_same}/{rows} rows; "
      f"tolerance {tol:g}" + (f", argmax >= {min_argmax:g}" if min_argmax else ""))
sys.exit(0 if worst <= tol and argmax_same >= min_argmax * rows else 1)
