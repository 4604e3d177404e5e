#!/usr/bin/env bash
# On-demand llama.cpp (the engine inside llama_ros) through llama-cpp-python, CPU build, in its own venv
# .venv-llamacpp. PyPI has llama-cpp-python 0.3.36 only as an sdist: pip compiles its vendored llama.cpp
# (15-30 minutes on 2 cores). The unpacked sdist stays under .venv-llamacpp/src so that its
# vendor/llama.cpp/convert_hf_to_gguf.py and gguf-py run from this venv (see docs/llamacpp.md).
# Idempotent: a stamp file records the pinned version. Not part of `make setup`.
# Run it niced on a shared machine: nice -n 19 scripts/setup_llamacpp.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LLAMACPP_VENV:-$root/.venv-llamacpp}"
version="0.3.36"
stamp="$venv/.gemma_spec_llamacpp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "llama-cpp-python==$version" ]]; then
  exit 0
fi

python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3
py="$venv/bin/python"
echo "setup_llamacpp: [1/5] virtual environment $venv"
[[ -x "$py" ]] || "$python_bin" -m venv "$venv"
mkdir -p "$venv/src"
log="$venv/pip.log"
: >"$log"
fail() { echo "setup_llamacpp: FAILED: $1 (last lines of $log follow)" >&2; tail -n 40 "$log" >&2; exit 1; }

sdist="$venv/src/llama_cpp_python-$version.tar.gz"
src="$venv/src/llama_cpp_python-$version"
echo "setup_llamacpp: [2/5] download and unpack the sdist llama-cpp-python==$version (log: $log)"
"$py" -m pip install -q --upgrade pip >>"$log" 2>&1 || fail "pip upgrade"
if [[ ! -f "$sdist" ]]; then
  "$py" -m pip download --no-binary llama-cpp-python --no-deps -d "$venv/src" "llama-cpp-python==$version" \
    >>"$log" 2>&1 || fail "pip download"
fi
[[ -f "$src/vendor/llama.cpp/convert_hf_to_gguf.py" ]] || tar -xzf "$sdist" -C "$venv/src" || fail "unpack $sdist"

# convert_hf_to_gguf.py imports numpy, torch, gguf (vendored gguf-py) and, for tokenizers, transformers
# (AutoTokenizer) and sentencepiece. torch comes from the CPU index (no CUDA wheels); transformers as in .venv.
echo "setup_llamacpp: [3/5] converter dependencies: torch (CPU), transformers 5.24, sentencepiece, vendored gguf-py"
# An unreachable CPU index is only a warning to pip (then a local +cpu wheel from find-links is used, if any).
"$py" -m pip install --retries 1 --timeout 20 --extra-index-url https://download.pytorch.org/whl/cpu \
  "torch==${LLAMACPP_TORCH:-2.13.0+cpu}" >>"$log" 2>&1 || fail "torch (CPU)"
"$py" -m pip install numpy sentencepiece safetensors protobuf "transformers==5.24.*" >>"$log" 2>&1 \
  || fail "converter dependencies"
"$py" -m pip install "$src/vendor/llama.cpp/gguf-py" >>"$log" 2>&1 || fail "gguf-py"

echo "setup_llamacpp: [4/5] build llama-cpp-python==$version from source, CPU only, GGML_NATIVE=ON (15-30 min on 2 cores)"
start=$(date +%s)
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF}" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$py" -m pip install -v --no-cache-dir "$sdist" >>"$log" 2>&1 || fail "build of llama-cpp-python"
echo "setup_llamacpp: build took $(( $(date +%s) - start )) s"

echo "setup_llamacpp: [5/5] check"
"$py" -c 'import llama_cpp, gguf, torch, transformers
print("setup_llamacpp: llama_cpp", llama_cpp.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' \
  || fail "import check"
"$py" "$src/vendor/llama.cpp/convert_hf_to_gguf.py" --help >/dev/null || fail "convert_hf_to_gguf.py --help"
echo "llama-cpp-python==$version" >"$stamp"
echo "setup_llamacpp: done (converter: $py $src/vendor/llama.cpp/convert_hf_to_gguf.py)"
