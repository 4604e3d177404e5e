#!/usr/bin/env bash
# make run: `ros2 launch gemma_spec_ros orin.launch.py` and the planner demo as a separate client process, as on a
# robot; both serve until Ctrl-C, which stops them cleanly (exit 0). Without ros2 launch here, the demo starts the
# node itself and this says why. Usage: scripts/run.sh [params file] (default config/orin.yaml).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck disable=SC1091
source scripts/env.sh  # before set -u: colcon's setup scripts read unset variables
set -uo pipefail
params="$(realpath "${1:-config/orin.yaml}")"

if ! command -v ros2 >/dev/null; then
  why="no ros2 command (the ROS 2 Python tools wheelhouse was not installed by scripts/setup.sh)"
elif ! ros2 pkg prefix gemma_spec_ros >/dev/null 2>&1; then
  why="gemma_spec_ros is not in the ament index (no colcon overlay build/ws)"
else
  why=""
fi
if [[ -n "$why" ]]; then
  echo "run: $why; starting the node directly instead of ros2 launch"
  exec python -m gemma_spec_ros demo --params-file "$params"
fi

# Background jobs of a script start with SIGINT ignored; env --default-signal gives them Ctrl-C back, so that
# ros2 launch stops its node on SIGINT as it does in a terminal.
echo "$ ros2 launch gemma_spec_ros orin.launch.py params_file:=$params"
env --default-signal=INT ros2 launch gemma_spec_ros orin.launch.py params_file:="$params" &
launch=$!
env --default-signal=INT python -m gemma_spec_ros demo --client &
client=$!
interrupted=0
trap 'interrupted=1' INT TERM
wait -n "$launch" "$client"
if [[ $interrupted == 0 ]]; then  # one of them ended by itself: stop the other one as Ctrl-C would
  kill -INT "$launch" "$client" 2>/dev/null
fi
wait "$client"
client_code=$?
wait "$launch"
launch_code=$?
if [[ $launch_code != 0 ]]; then
  echo "run: ros2 launch exited with code $launch_code" >&2
  exit "$launch_code"
fi
[[ $client_code != 0 ]] && exit "$client_code"
[[ $interrupted == 1 ]]  # exit 0 after Ctrl-C; 1 when the node or the client ended by itself
