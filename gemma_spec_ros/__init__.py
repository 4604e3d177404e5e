"""gemma_spec_ros: lossless speculative decoding of Gemma 4 for ROS 2 robot planners."""

import os

# OpenMP reads its wait policy once, when torch loads: idle worker threads then sleep instead of spinning, so more
# than one torch thread on a shared CPU slows down instead of collapsing (docs/decode-path.md#threads)
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

__version__ = '0.1.0'
