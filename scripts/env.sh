# Source this file: activates .venv as the ROS 2 prefix and overlays the built interface packages (build/msgs) and,
# when setup found the ROS 2 Python tools, the colcon workspace of gemma_spec_ros (build/ws) for `ros2 launch`.
_gs_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VIRTUAL_ENV="$_gs_root/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# shellcheck disable=SC1091
source "$_gs_root/build/msgs/install/setup.bash"
export AMENT_PREFIX_PATH="$_gs_root/build/msgs/install/gemma_spec_msgs:$VIRTUAL_ENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
if [[ -f "$_gs_root/build/ws/install/local_setup.bash" ]]; then
  # shellcheck disable=SC1091
  source "$_gs_root/build/ws/install/local_setup.bash"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export RMW_IMPLEMENTATION="${RMW_IMPLEMENTATION:-rmw_fastrtps_cpp}"
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"  # DDS stays on this machine
unset _gs_root
