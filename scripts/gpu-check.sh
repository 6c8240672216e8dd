#!/usr/bin/env bash
# The prepared GPU check: runs carried ds4 binaries on a machine with one NVIDIA GPU and a CUDA 13 driver, with no
# Rust toolchain and no network, and writes one results file. See docs/cuda.md ("GPU check") for building and
# carrying the binaries.
#
#   scripts/gpu-check.sh [RESULTS_FILE]        (default: gpu-check-results.txt)
#
# Environment: DS4_BIN (folder with ds4-bench built with `--features cuda`; default: target/release beside this
# script), DS4_CUDA_WHEELS (the nvidia-cuda-nvrtc wheel's nvidia/cu13 folder; default: found through python3),
# DS4_GPU_CHECK_BUDGET_S (seconds for the whole check, default 450: under the 8 minutes a device call allows).
#
# Without a GPU it exits 1 within seconds with a message saying so.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT="${1:-gpu-check-results.txt}"
BIN="${DS4_BIN:-target/release}"
BUDGET="${DS4_GPU_CHECK_BUDGET_S:-450}"
START=$(date +%s)

say() { printf '%s\n' "$*" | tee -a "$OUT"; }
fail() {
  printf 'gpu-check: FAILED: %s\n' "$*" | tee -a "$OUT" >&2
  exit 1
}
left() { echo $((BUDGET - ($(date +%s) - START))); }

: >"$OUT" || { echo "gpu-check: cannot write $OUT" >&2; exit 1; }
say "# ds4 gpu-check, $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(hostname)"

# 1. A GPU and its driver, in seconds.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  fail "no NVIDIA GPU here: nvidia-smi not found (this check needs one NVIDIA GPU with a CUDA 13 driver)"
fi
if ! gpus=$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1) \
  || [ -z "$gpus" ]; then
  fail "no usable NVIDIA GPU: nvidia-smi says: ${gpus:-nothing}"
fi
say "# gpu: $gpus"
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' && [ ! -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 ]; then
  fail "the CUDA driver library (libcuda.so) is not installed"
fi

# 2. NVRTC: the wheel's library, given or found through python3.
NVRTC_DIR="${DS4_CUDA_WHEELS:-}"
if [ -z "$NVRTC_DIR" ] && command -v python3 >/dev/null 2>&1; then
  NVRTC_DIR=$(python3 - <<'EOF' 2>/dev/null
import glob, os, sys
try:
    import nvidia
except ImportError:
    sys.exit(0)
for base in list(nvidia.__path__):
    for lib in sorted(glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so.13"))):
        print(os.path.dirname(os.path.dirname(lib)))
        sys.exit(0)
EOF
  )
fi
if [ -z "$NVRTC_DIR" ] || [ ! -e "$NVRTC_DIR/lib/libnvrtc.so.13" ]; then
  fail "NVRTC 13 not found: set DS4_CUDA_WHEELS to the nvidia-cuda-nvrtc wheel's nvidia/cu13 folder"
fi
export DS4_CUDA_WHEELS="$NVRTC_DIR"
export LD_LIBRARY_PATH="$NVRTC_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "# nvrtc: $NVRTC_DIR"

# 3. The binaries.
BENCH="$BIN/ds4-bench"
[ -x "$BENCH" ] || fail "$BENCH not found: build it with 'cargo build --release -p ds4-bench --features cuda' and carry it"
if ! "$BENCH" cuda --help >/dev/null 2>&1; then
  fail "$BENCH has no 'cuda' subcommand: build it with --features cuda"
fi

# 4. The kernels against the CPU, copy bandwidth, GB/s and the fraction of it.
say ""
say "## ds4-bench cuda --check (cache: ${DS4_CUDA_CACHE:-$HOME/.cache/ds4/cuda})"
status=0
timeout "$(left)" "$BENCH" cuda --check --iters 20 >>"$OUT" 2>&1 || status=$?
say "# ds4-bench cuda exit status: $status"

# 5. The portable path: wgpu over Vulkan on this card (needs the Vulkan loader; the device machines have none:
#    carry it as docs/cuda.md says). Agreement with the CPU, CPU + GPU placement, and decode on Flash-shaped layers
#    with the device accounting, as a fraction of the copy bandwidth measured above.
wstatus=0
if ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so'; then
  say ""
  say "## wgpu over Vulkan"
  WGPU_BACKEND=vulkan timeout "$(left)" "$BENCH" correctness --backends cpu,wgpu,wgpu:experts=cpu \
    --synthetic tiny:layers=3:recipe=q4 --f32-acts --exact --tol 1e-3 --quiet >>"$OUT" 2>&1 || wstatus=$?
  say "# wgpu correctness exit status: $wstatus"
  if [ "$(left)" -gt 60 ]; then
    WGPU_BACKEND=vulkan timeout "$(left)" "$BENCH" --synthetic "flash:layers=${DS4_GPU_CHECK_LAYERS:-4}" \
      --backend wgpu --ctx-start 512 --ctx-max 512 --gen-tokens 16 --batch-tokens 512 --quiet >>"$OUT" 2>&1 \
      || wstatus=$?
    copy=$(sed -n 's/^# copy bandwidth: \([0-9.]*\) GB\/s.*/\1/p' "$OUT" | head -1)
    got=$(sed -n 's/^# ctx 512: decode .*(\([0-9.]*\) GB\/s of weights).*/\1/p' "$OUT" | head -1)
    if [ -n "$copy" ] && [ -n "$got" ]; then
      say "# wgpu decode: $got GB/s of weights = $(awk -v g="$got" -v c="$copy" 'BEGIN{printf "%.1f", 100*g/c}') % of the copy bandwidth ($copy GB/s)"
    fi
    grep -q '^# device: .*Cpu' "$OUT" && say "# note: wgpu ran on a CPU adapter (no NVIDIA Vulkan driver found)"
  fi
else
  say "# not run: wgpu over Vulkan (no libvulkan here: carry the loader, docs/cuda.md)"
fi

# 6. The engine's CUDA backend (docs/cuda.md: products, norms and ropes on the GPU, the rest on the CPU beside it):
#    agreement with the CPU on a tiny synthetic q4 model (the tolerance of tests/tests/cuda_backend.rs: a near-tie
#    may resolve the other way, so 2 leading greedy tokens and 90 % of the argmax must agree), then
#    decode and prefill on Flash-shaped layers with the placement report and the device counters.
cstatus=0
say ""
say "## cuda backend"
timeout "$(left)" "$BENCH" correctness --backends cpu,cuda --synthetic tiny:layers=3:recipe=q4 --exact \
  --tol 1 --min-agree 0.9 --min-greedy 2 --quiet >>"$OUT" 2>&1 || cstatus=$?
say "# cuda correctness exit status: $cstatus"
if [ "$(left)" -gt 60 ]; then
  timeout "$(left)" "$BENCH" --synthetic "flash:layers=${DS4_GPU_CHECK_LAYERS:-4}" --backend cuda \
    --ctx-start 512 --ctx-max 512 --gen-tokens 16 --batch-tokens 512 --placement-report --quiet >>"$OUT" 2>&1 \
    || cstatus=$?
  say "# cuda decode/prefill exit status: $cstatus"
fi
say "# total $(($(date +%s) - START)) s"
[ "$status" -eq 0 ] || fail "ds4-bench cuda failed (status $status); see $OUT"
[ "$wstatus" -eq 0 ] || fail "the wgpu checks failed (status $wstatus); see $OUT"
[ "$cstatus" -eq 0 ] || fail "the cuda backend checks failed (status $cstatus); see $OUT"
exit 0
