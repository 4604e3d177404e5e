# Source this file: activates .venv as the ROS 2 prefix and overlays the built gemma_spec_msgs.
_gs_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VIRTUAL_ENV="$_gs_root/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# shellcheck disable=SC1091
source "$_gs_root/build/msgs/install/setup.bash"
export AMENT_PREFIX_PATH="$_gs_root/build/msgs/install/gemma_spec_msgs:$VIRTUAL_ENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export RMW_IMPLEMENTATION="${RMW_IMPLEMENTATION:-rmw_fastrtps_cpp}"
unset _gs_root
