"""gemma_spec_ros: lossless speculative decoding of Gemma 4 for ROS 2 robot planners."""

__version__ = '0.1.0'
