#!/usr/bin/env bash
# The prepared check for a lent CUDA machine (one run, under 10 minutes): bench gpu-check on the bundled
# models and on a random model of Gemma-4-E2B's shape, then the engine's tests on CUDA with captured steps, and the
# quantized targets' (int8 and int4 on CUDA: never run yet).
#
#   bash scripts/device_check.sh OUT_DIR
#   DEVICE_CHECK_STAGES="tests bundled" DEVICE_CHECK_MODES=cudagraph,eager bash scripts/device_check.sh OUT_DIR
#
# The machine's python3 must hold torch with CUDA. Wheels in .whl/ are installed into a private site first: what
# the machine lacks, for its Python (on the H200 image, Python 3.12: transformers 5.24.0, regex, jsonschema,
# jsonschema-specifications, referencing, rpds-py, xgrammar 0.2.8, apache-tvm-ffi, pydantic, pydantic-core,
# annotated-types, typing-inspection; `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION`). Each stage has its own time limit, and a failing stage
# does not stop the next; the exit status counts the stages that failed.
set -uo pipefail
out="$(mkdir -p "${1:?usage: scripts/device_check.sh OUT_DIR}" && cd "$1" && pwd)" || exit 1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if compgen -G '.whl/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/device_site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/device_site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
stages=" ${DEVICE_CHECK_STAGES:-environment bundled e2b tests quantization} "
modes="${DEVICE_CHECK_MODES:-cudagraph,eager,off}"
failed=0
stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to OUT/check.log, count a failure
  local name="$1" seconds="$2"
  shift 2
  [[ $stages == *" $name "* ]] || return 0
  echo "=== $name ($(date -u +%T), limit ${seconds} s)" | tee -a "$out/check.log"
  timeout --signal=INT --kill-after=15 "$seconds" "$@" 2>&1 | tee -a "$out/check.log"
  local status=${PIPESTATUS[0]}
  echo "=== $name: exit $status ($(date -u +%T))" | tee -a "$out/check.log"
  [[ $status == 0 ]] || failed=$((failed + 1))
}
stage environment 30 python3 -c 'import sys, torch, transformers
from importlib.metadata import version
print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "xgrammar", version("xgrammar"), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM'
stage bundled 130 python3 -m gemma_spec_ros bench gpu-check --models bundled --modes "$modes" \
  --out "$out/bundled"
stage e2b 200 python3 -m gemma_spec_ros bench gpu-check --models e2b --modes "$modes" --repeats 2 \
  --out "$out/e2b"
stage tests 220 env GEMMA_SPEC_TEST_DEVICE=cuda GEMMA_SPEC_TEST_COMPILE=cudagraph python3 -m pytest -q \
  -p no:cacheprovider --durations=15 --junitxml="$out/tests.xml" test/engine/test_engine_fast.py test/engine/test_engine.py \
  test/engine/test_engine_grammar.py test/test_grammar_json.py
stage quantization 90 env GEMMA_SPEC_TEST_DEVICE=cuda GEMMA_SPEC_TEST_COMPILE=cudagraph python3 -m pytest -q \
  -p no:cacheprovider --durations=10 --junitxml="$out/quantization.xml" test/engine/test_quantization.py
echo "stages failed: $failed" | tee -a "$out/check.log"
exit "$failed"
