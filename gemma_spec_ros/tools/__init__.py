"""Tools a planner team runs against the node: client, diagnostics monitor, bag record/replay, demo (no torch)."""
