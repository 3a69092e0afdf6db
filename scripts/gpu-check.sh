#!/usr/bin/env bash
# The GPU check, in one command on a bare, offline machine with CUDA's nvcc, CMake, ninja,
# scikit-build-core, numpy and Python 3.10+ (scripts/gpu-pack.sh made gpu-carry/ beforehand):
# builds llama-cpp-python 0.3.36 with CUDA for one architecture into a virtual environment,
# writes random-weight models of the default pair's shapes, and measures (scripts/gpu_check.py).
# The report lands in OUT/report.md and OUT/report.json, the build's log in OUT/build.log.
#
#   scripts/gpu-check.sh [--out DIR] [--cuda-arch 90] [--cpu] [--no-build] [--small] [--tokenizer GGUF]
#
# --cpu: build (or run) without CUDA, models on the CPU; --no-build: use the llama-cpp-python
# already installed (CI); --small: small models instead of the real shapes; --tokenizer: the
# GGUF whose tokenizer the models get (default: the carried Qwen one). PYTHON: the interpreter
# (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
ARCH=90
CPU=0
BUILD=1
SMALL=()
TOKENIZER=gpu-carry/qwen-tokenizer.gguf.gz
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift ;;
    --cuda-arch) ARCH=$2; shift ;;
    --cpu) CPU=1 ;;
    --no-build) BUILD=0 ;;
    --small) SMALL=(--small) ;;
    --tokenizer) TOKENIZER=$2; shift ;;
    *) echo "gpu-check: unknown option $1; see the comment at the top of $0" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
started=$(date +%s)
python=${PYTHON:-python3}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a failed build does not leave the models' writer running
tokenizer=$TOKENIZER
if [ "${TOKENIZER%.gz}" != "$TOKENIZER" ]; then
  tokenizer="$OUT/$(basename "${TOKENIZER%.gz}")"
  gunzip -c "$TOKENIZER" >"$tokenizer"
fi

if [ "$BUILD" = 1 ]; then
  [ -f gpu-carry/llama-cpp-python.tar.gz ] || { echo "gpu-check: no gpu-carry/; run scripts/gpu-pack.sh first and carry gpu-carry" >&2; exit 2; }
  $python -c "import scikit_build_core" 2>/dev/null || { echo "gpu-check: the build needs scikit-build-core (pip install scikit-build-core)" >&2; exit 2; }
  venv="$OUT/venv"
  # the machine's own packages (numpy, jinja2, scikit-build-core) stay visible; ours go beside them
  $python -m venv --system-site-packages "$venv"
  python="$venv/bin/python"
  $python -m pip install --quiet --no-index --find-links gpu-carry/wheels gguf diskcache typing-extensions
  # the models are written (numpy, gguf) while llama.cpp builds
  $python scripts/gpu_models.py write --out "$OUT/models" --tokenizer "$tokenizer" "${SMALL[@]}" &
  writing=$!
  src=$(mktemp -d)
  tar xzf gpu-carry/llama-cpp-python.tar.gz -C "$src"
  flags="-DLLAVA_BUILD=OFF"
  if [ "$CPU" = 1 ]; then flags="$flags -DGGML_CUDA=OFF"; else flags="$flags -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH"; fi
  echo "gpu-check: building llama-cpp-python ($flags), log in $OUT/build.log" >&2
  build_start=$(date +%s)
  CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    $python -m pip install --no-index --no-build-isolation --no-deps -v "$src"/llama_cpp_python-* >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log" >&2; echo "gpu-check: the build failed; the log is $OUT/build.log" >&2; exit 1; }
  echo "$(($(date +%s) - build_start))" >"$OUT/build_s"
  echo "gpu-check: built in $(cat "$OUT/build_s") s" >&2
  rm -rf "$src"
  wait "$writing"
else
  $python scripts/gpu_models.py write --out "$OUT/models" --tokenizer "$tokenizer" "${SMALL[@]}"
fi

layers=99
[ "$CPU" = 1 ] && layers=0
PYTHONPATH=$PWD:$PWD/scripts $python scripts/gpu_check.py --out "$OUT" --models "$OUT/models" --gpu-layers "$layers"
echo "gpu-check: done in $(($(date +%s) - started)) s; report in $OUT/report.md" >&2
