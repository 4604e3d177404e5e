"""The ROS 2 side: the node as a thin adapter over the engine (goal queue, conversions, parameters, diagnostics)."""
