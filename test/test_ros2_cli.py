"""
The card's command and the ros2 CLI against it: `ros2 launch gemma_spec_ros orin.launch.py` as a real process.

One launch for the module, with the launch file's defaults except device:=cpu and a params file with one torch
thread; then `ros2 action send_goal --feedback`, `ros2 topic echo --once /diagnostics`, `ros2 param get` and
`ros2 interface show`; last, SIGINT (Ctrl-C) to `ros2 launch` ends it and its node cleanly. The ros2 daemon this
starts is stopped at the end. Everything runs on this module's own ROS domain, on localhost.
"""

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import TEST_COMPILE, missing_ros2_tools, run_ros2

if missing_ros2_tools():
    pytest.skip(missing_ros2_tools(), allow_module_level=True)

import psutil
from ament_index_python.packages import get_package_share_directory

DOMAIN_ID = 11 + (os.getpid() + 61) % 80
READY_TIMEOUT = 300.0
ENV = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
           PYTHONUNBUFFERED='1')


def ros2(*args, timeout=120):
    return run_ros2(ENV, *args, timeout=timeout)


class Launch:
    """`ros2 launch` as a subprocess; its output is collected by a reader thread."""

    def __init__(self, *arguments):
        self.process = subprocess.Popen(('ros2', 'launch', 'gemma_spec_ros', 'orin.launch.py') + arguments,
                                        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._lock = threading.Condition()
        self.text = ''
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            with self._lock:
                self.text += line
                self._lock.notify_all()

    def wait_for(self, needle, timeout):
        deadline = time.monotonic() + timeout
        with self._lock:
            while needle not in self.text and self.process.poll() is None and time.monotonic() < deadline:
                self._lock.wait(0.5)
            return needle in self.text

    def interrupt(self, timeout=60):
        """Send SIGINT (what Ctrl-C sends) and wait; return the exit code."""
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout)
        self._reader.join(10)
        return code


@pytest.fixture(scope='module')
def launched(tmp_path_factory):
    config = yaml.safe_load(Path(get_package_share_directory('gemma_spec_ros'), 'config', 'orin.yaml').read_text())
    config['/**']['ros__parameters']['engine']['num_threads'] = 1
    config['/**']['ros__parameters']['engine']['compile'] = TEST_COMPILE
    params = tmp_path_factory.mktemp('ros2_cli') / 'params.yaml'
    params.write_text(yaml.safe_dump(config))
    launch = Launch('device:=cpu', 'params_file:={}'.format(params))
    try:
        assert launch.wait_for('ready in', READY_TIMEOUT), launch.text[-3000:]
        yield launch
    finally:
        if launch.process.poll() is None:
            launch.process.kill()
            launch.process.wait(30)
        ros2('daemon', 'stop', timeout=60)


def test_send_goal_with_feedback_succeeds(launched):
    code, output = ros2('action', 'send_goal', '/gemma_spec/generate', 'gemma_spec_msgs/action/Generate',
                        "{prompt: 'def add(a, b):', max_new_tokens: 16}", '--feedback')
    assert code == 0, output
    assert 'Goal accepted' in output and output.count('Feedback:') >= 1 and 'text_delta:' in output
    assert 'Goal finished with status: SUCCEEDED' in output
    assert 'finish_reason: length' in output and 'tau:' in output


def test_topic_echo_shows_the_engine_status_with_tau(launched):
    for _ in range(3):  # the daemon may not know the topic's type yet
        code, output = ros2('topic', 'echo', '--once', '/diagnostics', '--timeout', '30')
        if 'gemma_spec: engine' in output:
            break
        time.sleep(2)
    assert code == 0, output
    assert "name: 'gemma_spec: engine'" in output and re.search(r"message: '?ready", output), output
    # speculating or paused by the profit gate (normal operation: how the first goals went decides it), drafter mtp
    assert 'speculating with mtp' in output or 'drafter mtp does not beat plain decoding' in output, output
    assert 'key: tau (window)' in output and 'key: tau (lifetime)' in output and 'key: break-even tau' in output
    assert "name: 'gemma_spec: diagnostics period'" in output and 'hardware_id: gemma-spec-dev' in output


def test_param_get_reads_engine_parameters(launched):
    code, output = ros2('param', 'get', '/gemma_spec', 'engine.drafter', '--timeout', '30')
    assert code == 0 and output.strip() == 'String value is: mtp', output
    code, output = ros2('param', 'get', '/gemma_spec', 'engine.device', '--timeout', '30')
    assert code == 0 and output.strip() == 'String value is: cpu', output  # device:=cpu over the file's auto


def test_interface_show_prints_the_contract():
    code, output = ros2('interface', 'show', 'gemma_spec_msgs/action/Generate')
    assert code == 0, output
    goal, result, feedback = output.split('\n---\n')
    assert 'string prompt' in goal and 'gemma_spec_msgs/ChatMessage[] messages' in goal and 'max_new_tokens' in goal
    assert 'string text' in result and 'GenerationStats stats' in result
    assert 'string text_delta' in feedback and 'float32 tau' in feedback


def test_info_log_level_by_default(launched):
    # the launch file's default log_level info (test_launch.py checks warn)
    assert '[gemma_spec]: ready in' in launched.text and '[DEBUG]' not in launched.text


def test_sigint_stops_launch_and_node_cleanly(launched):
    node_pids = [child.pid for child in psutil.Process(launched.process.pid).children(recursive=True)]
    assert node_pids, 'ros2 launch started no process'
    assert launched.interrupt() == 0, launched.text[-3000:]
    assert 'process has finished cleanly' in launched.text and 'escalating to' not in launched.text
    assert not [pid for pid in node_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != 'zombie']
