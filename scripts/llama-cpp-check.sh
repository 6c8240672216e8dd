#!/usr/bin/env bash
# Cross-checks ds4 against an independent implementation: llama.cpp (architecture `deepseek4`), as vendored by the
# PyPI sdist llama-cpp-python==0.3.36 (llama.cpp commit 0c1e570). Steps, each cached and skipped when done:
#   1. `pip download` the sdist into ${DS4_CACHE_DIR:-$HOME/.cache/ds4}/llama.cpp and unpack it;
#   2. build its `llama` library (CPU only, static; cmake from PyPI when the machine has none) and link our small
#      logits program (scripts/llama-cpp-check/logits.c) against it — ~10 min cold on 2 cores, seconds when cached;
#   3. copy the golden tiny checkpoint with its HCA ratio 8 changed to 128 (llama.cpp supports only 0, 4 and 128),
#      convert it with `ds4 convert --recipe f32` (no --tokenizer: the converter writes a synthetic tokenizer);
#   4. compute the logits of N_TOKENS fixed token ids (default 300, enough for compressed rows of both ratios) with
#      llama.cpp and with `ds4 logits --exact --f32-acts`, and require max |diff| <= 1e-4.
# `--flash` replaces steps 3-4 by the Flash-shaped 2-bit file the benchmarks use (issue 15): `ds4-bench --synthetic
# flash:layers=2:from=2 --write` (Flash sizes, one CSA ratio-4 layer with indexer and one HCA ratio-128 layer,
# IQ2_XXS/Q2_K routed experts, Q8_0 head, synthetic 129280-token tokenizer; 5.2 GiB, written once to a temp folder
# or taken from DS4_FLASH_GGUF), loaded by llama.cpp unpatched. Both engines quantize activations differently for
# 2-bit weights, so this is not an f32 check: it prints max and mean |diff| next to the logits' spread and requires
# argmax agreement on >= DS4_LLAMA_FLASH_ARGMAX (default 0.9) of the rows and max |diff| <= DS4_LLAMA_FLASH_TOL
# (default 0.5; measured 0.09 with ds4 --exact --f32-acts, logit spread 0.44). N_TOKENS defaults to 160 there (past
# one ratio-128 compressed row).
# No llama.cpp code or binary is committed; everything it fetches or builds stays in the cache folder.
# Usage: scripts/llama-cpp-check.sh [--flash] [N_TOKENS]. Env: DS4_CACHE_DIR, DS4_BIN (default target/release/ds4,
# built if missing), DS4_BENCH_BIN (--flash; default target/release/ds4-bench, built if missing), DS4_GOLDEN (default
# ../shared/golden/tiny-a), DS4_LLAMA_TOL (default 1e-4), DS4_FLASH_GGUF, DS4_LLAMA_FLASH_TOL, DS4_LLAMA_FLASH_ARGMAX.
set -euo pipefail

FLASH=0
if [ "${1:-}" = "--flash" ]; then
  FLASH=1
  shift
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
HERE=$ROOT/scripts/llama-cpp-check
VER=0.3.36
CACHE=${DS4_CACHE_DIR:-$HOME/.cache/ds4}/llama.cpp
SRC=$CACHE/llama_cpp_python-$VER/vendor/llama.cpp
BUILD=$CACHE/build
GOLDEN=${DS4_GOLDEN:-$ROOT/../shared/golden/tiny-a}
DS4=${DS4_BIN:-$ROOT/target/release/ds4}
TOL=${DS4_LLAMA_TOL:-1e-4}
if [ "$FLASH" = 1 ]; then N_TOKENS=${1:-160}; else N_TOKENS=${1:-300}; fi
JOBS=${CARGO_BUILD_JOBS:-2}

log() { echo "llama-cpp-check: $*" >&2; }

mkdir -p "$CACHE"
if [ ! -f "$SRC/include/llama.h" ]; then
  log "fetching llama-cpp-python==$VER (sdist)"
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VER" -d "$CACHE"
  tar -xzf "$CACHE/llama_cpp_python-$VER.tar.gz" -C "$CACHE"
fi

if ! command -v cmake >/dev/null 2>&1; then
  if [ ! -x "$CACHE/venv/bin/cmake" ]; then
    log "installing cmake from PyPI into $CACHE/venv"
    python3 -m venv "$CACHE/venv"
    "$CACHE/venv/bin/pip" install --quiet cmake
  fi
  export PATH="$CACHE/venv/bin:$PATH"
fi

LOGITS_BIN=$BUILD/llama-logits
if [ ! -x "$LOGITS_BIN" ] || [ "$HERE/logits.c" -nt "$LOGITS_BIN" ]; then
  log "building llama.cpp $VER (CPU, static) in $BUILD"
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=OFF \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF >"$BUILD.cmake.log" 2>&1 \
    || { tail -20 "$BUILD.cmake.log" >&2; exit 1; }
  nice -n 10 cmake --build "$BUILD" --target llama -j "$JOBS" >"$BUILD.build.log" 2>&1 \
    || { tail -20 "$BUILD.build.log" >&2; exit 1; }
  libs=$(find "$BUILD" -name 'libllama.a' -o -name 'libggml*.a' | sort -r | tr '\n' ' ')
  # shellcheck disable=SC2086
  g++ -O2 -x c "$HERE/logits.c" -x none -I"$SRC/include" -I"$SRC/ggml/include" \
    -Wl,--start-group $libs -Wl,--end-group -lpthread -lm -ldl -o "$LOGITS_BIN"
fi

if [ ! -x "$DS4" ]; then
  log "building ds4"
  (cd "$ROOT" && cargo build --release -p ds4-cli --bin ds4 -j "$JOBS")
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Fixed, spread-out token ids (BOS first), all inside a vocabulary of $1.
tokens() {
  python3 -c 'import sys; n,v=int(sys.argv[1]),int(sys.argv[2]); print(" ".join(["0"]+[str((i*7919+13)%(v-2)+2) for i in range(1,n)]))' "$N_TOKENS" "$1"
}
compare_logits() { # MODEL VOCAB DS4_FLAGS TOL [MIN_ARGMAX]
  local tokens
  tokens=$(tokens "$2")
  log "llama.cpp logits ($N_TOKENS tokens)"
  # shellcheck disable=SC2086
  timeout 900 "$LOGITS_BIN" "$1" "$WORK/llama.f32" $tokens 2>"$WORK/llama.log" \
    || { tail -30 "$WORK/llama.log" >&2; exit 1; }
  log "ds4 logits ($3)"
  # shellcheck disable=SC2086
  timeout 900 "$DS4" logits -m "$1" --tokens "$(echo "$tokens" | tr ' ' ',')" --out "$WORK/ds4.f32" $3 >&2
  python3 "$HERE/compare.py" "$WORK/llama.f32" "$WORK/ds4.f32" "$2" "$4" "${5:-0}"
}

if [ "$FLASH" = 1 ]; then
  MODEL=${DS4_FLASH_GGUF:-}
  if [ -z "$MODEL" ]; then
    BENCH=${DS4_BENCH_BIN:-$ROOT/target/release/ds4-bench}
    if [ ! -x "$BENCH" ]; then
      log "building ds4-bench"
      (cd "$ROOT" && cargo build --release -p ds4-bench -j "$JOBS")
    fi
    MODEL=$WORK/flash.gguf
    log "writing the Flash-shaped file (5.2 GiB) to $MODEL"
    "$BENCH" --synthetic flash:layers=2:from=2 --write "$MODEL" --quiet >&2
  fi
  compare_logits "$MODEL" 129280 "--exact --f32-acts" "${DS4_LLAMA_FLASH_TOL:-0.5}" "${DS4_LLAMA_FLASH_ARGMAX:-0.9}"
  exit 0
fi

[ -f "$GOLDEN/config.json" ] || { log "golden checkpoint $GOLDEN is missing"; exit 1; }
python3 "$HERE/retarget_ratio.py" "$GOLDEN" "$WORK/ckpt" 8 128 >&2
"$DS4" convert --input "$WORK/ckpt" --output "$WORK/model.gguf" --recipe f32 --quiet >&2
VOCAB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$WORK/ckpt/config.json")
compare_logits "$WORK/model.gguf" "$VOCAB" "--exact --f32-acts" "$TOL"
