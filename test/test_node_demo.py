"""`make run`: the demo starts the node from config/orin.yaml, streams a goal, prints figures, stops on Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOMAIN_ID = 11 + (os.getpid() + 17) % 80


def test_demo_streams_reports_and_stops_cleanly_on_ctrl_c():
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
               PYTHONUNBUFFERED='1')
    demo = subprocess.Popen([sys.executable, '-m', 'gemma_spec_ros', 'demo', '--params-file', 'config/orin.yaml',
                             '-p', 'engine.device:=cpu', '-p', 'engine.num_threads:=1', '--max-new-tokens', '24'],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 300
    try:
        for line in demo.stdout:
            lines.append(line)
            if line.startswith('serving /gemma_spec/generate until Ctrl-C') or time.monotonic() > deadline:
                break
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    output = ''.join(lines) + rest
    assert demo.returncode == 0, output
    for expected in ('--params-file', 'node ready', '=== speculative', 'tau', 'ttft', 'peak RSS', 'action plan',
                     'identical tokens: True', '/diagnostics', 'MemAvailable', 'Ctrl-C: stopping the node'):
        assert expected in output, expected
