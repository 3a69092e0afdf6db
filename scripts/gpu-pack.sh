#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs on a bare, offline GPU machine into gpu-carry/ (ignored
# by git; carry it with the working tree): llama-cpp-python 0.3.36's sources trimmed to what a
# CUDA or CPU build compiles, the wheels of the check's dependencies that such a machine lacks,
# and Qwen's tokenizer fields (from the cached qwen2.5-coder-1.5b; `edgespec pull` fetches it).
# Run here, where the package index is reachable; it says how big the carry is (at most 64 MiB
# may travel, the working tree included).
#
#   scripts/gpu-pack.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=gpu-carry
VERSION=0.3.36
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
tar xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src="$work/llama_cpp_python-$VERSION"
# the Python package's own docs, examples and tests; llama.cpp's models (vocabularies for its
# tests), docs, examples, tools (the llava/mtmd library is not built: LLAVA_BUILD=OFF), tests,
# conversion scripts, and the backends other than the CPU's and CUDA's
rm -rf "$src"/{.git,docs,examples,tests,docker}
llama="$src/vendor/llama.cpp"
rm -rf "$llama"/{.git,models,docs,examples,tools,tests,benches,media,gguf-py,conversion,scripts,skills,requirements,grammars,pocs,app,ci}
for backend in "$llama"/ggml/src/ggml-*/; do
  case "$(basename "$backend")" in ggml-cpu | ggml-cuda) ;; *) rm -rf "$backend" ;; esac
done
tar czf "$CARRY/llama-cpp-python.tar.gz" -C "$work" "llama_cpp_python-$VERSION"

# the GPU machine has numpy, jinja2 and huggingface-hub (so pyyaml, tqdm, typing-extensions);
# not gguf (the check writes its models with it) nor diskcache (llama_cpp imports it)
pip download --quiet --no-deps gguf diskcache typing-extensions -d "$CARRY/wheels"

qwen=$(python -c 'from edgespec.loader import resolve_model; print(resolve_model("qwen2.5-coder-1.5b"))')
python scripts/gpu_models.py tokenizer "$qwen" "$CARRY/qwen-tokenizer.gguf"
gzip -9 "$CARRY/qwen-tokenizer.gguf"

tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
carry=$(du -cb "$CARRY" | tail -1 | cut -f1)
echo "gpu-carry: $((carry / 1024)) KiB; working tree $((tree / 1024)) KiB; together $(((carry + tree) / 1048576)) MiB of 64"
