"""`make run` (scripts/run.sh): ros2 launch plus the demo client stream a goal, print figures, stop on Ctrl-C."""

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from conftest import NO_DIAGNOSTIC_UPDATER, missing_ros2_tools

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)
if missing_ros2_tools():
    pytest.skip(missing_ros2_tools(), allow_module_level=True)

import psutil

REPO = Path(__file__).resolve().parents[2]
DOMAIN_ID = 11 + (os.getpid() + 17) % 80


def test_make_run_launches_streams_reports_and_stops_cleanly_on_ctrl_c(tmp_path):
    config = yaml.safe_load((REPO / 'config' / 'orin.yaml').read_text())
    config['/**']['ros__parameters']['engine'].update(device='cpu', num_threads=1)
    params = tmp_path / 'params.yaml'
    params.write_text(yaml.safe_dump(config))
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
               PYTHONUNBUFFERED='1')
    # its own session, so that Ctrl-C can be sent to the whole process group as a terminal does
    run = subprocess.Popen(['bash', 'scripts/run.sh', str(params)], cwd=REPO, env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, serving = [], threading.Event()

    def read():
        for line in run.stdout:
            lines.append(line)
            if line.startswith('  python -m gemma_spec_ros diag'):  # the last line before it serves
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert serving.wait(300), ''.join(lines)
        processes = psutil.Process(run.pid).children(recursive=True)
        os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C sends
        run.wait(60)
        reader.join(10)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    output = ''.join(lines)
    assert run.returncode == 0, output
    for expected in ('$ ros2 launch gemma_spec_ros orin.launch.py', '[gemma_spec]: ready in', 'node ready',
                     '=== planner loop, speculative', 'plan (', 'the plan is', 'tau', 'ttft', 'peak RSS',
                     'speculative vs plain over the loop', 'identical tokens: True',
                     '=== image goal', 'right answer: ', 'image prefill p50 (ms)',
                     '/diagnostics', 'MemAvailable', 'ros2 action send_goal', 'Ctrl-C: stopping the client',
                     'process has finished cleanly'):
        assert expected in output, '{!r} missing; output ends:\n{}'.format(expected, output[-2000:])
    assert 'escalating to' not in output
    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
