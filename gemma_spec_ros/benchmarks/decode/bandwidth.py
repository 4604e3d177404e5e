"""
This machine's memory bandwidth, STREAM-style, for the decode roofline.

Plain decoding reads every weight a token touches once per token, so its ceiling is the bandwidth at which one
thread (or two) can read memory: tokens/s <= read bandwidth / bytes read per token. Three kernels over arrays
far larger than the last-level cache, each the best of --repeats (as STREAM reports):

- read:  s = sum(a)         bytes counted: 1 array  (what decoding does to its weights)
- copy:  b = a              2 arrays
- triad: a = b + 3 c        3 arrays

Counted as STREAM counts (the write-allocate read of the destination is not counted). torch's kernels at
torch.set_num_threads(N), float32.

    python -m gemma_spec_ros bench bandwidth --threads 1,2
"""

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Bandwidth:
    threads: int
    array_mib: int
    read_gb_s: float
    copy_gb_s: float
    triad_gb_s: float


def _best_seconds(kernel, repeats: int) -> float:
    kernel()  # first touch: page faults out of the timing
    best = float('inf')
    for _ in range(repeats):
        started = time.perf_counter()
        kernel()
        best = min(best, time.perf_counter() - started)
    return best


def measure(threads: int, array_mib: int = 256, repeats: int = 5) -> Bandwidth:
    """STREAM-like read, copy and triad at this many torch threads, in GB/s (10^9 bytes)."""
    import torch

    if threads < 1 or array_mib < 1 or repeats < 1:
        raise ValueError('bandwidth: threads, array_mib and repeats must be at least 1')
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        elements = array_mib * 2 ** 20 // 4
        a, b, c = (torch.full((elements,), value, dtype=torch.float32) for value in (1.0, 2.0, 0.5))
        size = elements * 4
        read = _best_seconds(lambda: a.sum(), repeats)
        copy = _best_seconds(lambda: b.copy_(a), repeats)
        triad = _best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    finally:
        torch.set_num_threads(previous)
    return Bandwidth(threads, array_mib, round(size / read / 1e9, 2), round(2 * size / copy / 1e9, 2),
                     round(3 * size / triad / 1e9, 2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench bandwidth', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--threads', default='1,2', help='comma-separated thread counts')
    parser.add_argument('--array-mib', type=int, default=256, help='size of each array (far above the L3)')
    parser.add_argument('--repeats', type=int, default=5)
    args = parser.parse_args(argv)
    rows = [asdict(measure(int(threads), args.array_mib, args.repeats)) for threads in args.threads.split(',')]
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == '__main__':
    sys.exit(main())
