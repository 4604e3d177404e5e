"""
The card's command and the ros2 CLI against it: `ros2 launch gemma_spec_ros orin.launch.py` as a real process.

One launch for the module, with the launch file's defaults except device:=cpu and a params file with one torch
thread; then `ros2 action send_goal --feedback` (a prompt, and chat messages with the bundled robot tools),
`ros2 topic echo --once /diagnostics`, `ros2 param get` and `ros2 interface show`; last, SIGINT (Ctrl-C) to
`ros2 launch` ends it and its node cleanly. The ros2 daemon this starts is stopped at the end. Everything runs on
this module's own ROS domain, on localhost.
"""

import json
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

import jsonschema
import psutil
from ament_index_python.packages import get_package_share_directory

DOMAIN_ID = 11 + (os.getpid() + 61) % 80
READY_TIMEOUT = 300.0
ENV = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
           PYTHONUNBUFFERED='1')
SEND_GOAL_ATTEMPTS = 3  # a CLI call that has not discovered the node or its action server yet is tried again
NOT_DISCOVERED = ('Node not found', 'Action server not available', 'Goal was rejected')


def ros2(*args, timeout=120):
    return run_ros2(ENV, *args, timeout=timeout)


def send_goal(goal: str, *options) -> tuple[int, str]:
    """Run `ros2 action send_goal` on the node's action; tried again while the CLI has not discovered the server."""
    for _ in range(SEND_GOAL_ATTEMPTS):
        code, output = ros2('action', 'send_goal', '/gemma_spec/generate', 'gemma_spec_msgs/action/Generate', goal,
                            *options)
        if 'Goal accepted' in output or not any(reason in output for reason in NOT_DISCOVERED):
            break
        time.sleep(2)
    return code, output


def printed_result(output: str) -> dict:
    """Return the result `ros2 action send_goal` printed (the YAML between 'Result:' and the status line)."""
    block = output.split('\nResult:\n', 1)[1].split('\nGoal finished with status', 1)[0]
    return yaml.safe_load(block.lstrip())   # ros2 indents the first line only


def robot_tools() -> list:
    """Return the bundled robot tools as installed (share/gemma_spec_ros/config/robot_tools.json)."""
    path = Path(get_package_share_directory('gemma_spec_ros'), 'config', 'robot_tools.json')
    return json.loads(path.read_text())


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
        if launch.process.poll() is None:   # Ctrl-C stops the node with it; a SIGKILL would leave the node running
            try:
                launch.interrupt(60)
            except subprocess.TimeoutExpired:
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


def test_send_goal_with_robot_tools_asks_for_a_tool_call(launched):
    tools = robot_tools()
    for tool in tools:   # bounded strings: a call closes within max_new_tokens whatever the weights
        for schema in tool['function']['parameters']['properties'].values():
            schema['maxLength'] = 16
    declared = {tool['function']['name']: tool['function']['parameters'] for tool in tools}
    goal = ("{{messages: [{{role: system, content: 'You are the task planner of a mobile robot.'}}, "
            "{{role: user, content: 'Bring me the red cup from the kitchen.'}}], tools: '{}', tool_choice: required, "
            'parallel_tool_calls: false, max_new_tokens: 96}}').format(
                json.dumps(tools, separators=(',', ':')).replace("'", "''"))   # YAML single quotes: '' is '
    code, output = send_goal(goal, '--feedback')
    assert code == 0, output
    assert 'Goal finished with status: SUCCEEDED' in output and 'finish_reason: tool_calls' in output, output[-3000:]
    assert 'tool_calls_delta:' in output
    result = printed_result(output)
    assert result['finish_reason'] == 'tool_calls' and len(result['tool_calls']) == 1, result
    for call in result['tool_calls']:
        assert call['name'] in declared, call
        jsonschema.validate(json.loads(call['arguments']), declared[call['name']])


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
    assert 'string tools' in goal and 'string tool_choice' in goal and 'bool thinking' in goal
    assert 'bool parallel_tool_calls true' in goal
    assert 'ToolCall[] tool_calls' in goal and 'string name' in goal   # ChatMessage's calls and tool name
    assert 'string text' in result and 'GenerationStats stats' in result
    assert 'string reasoning' in result and 'gemma_spec_msgs/ToolCall[] tool_calls' in result
    assert 'string text_delta' in feedback and 'float32 tau' in feedback
    assert 'string reasoning_delta' in feedback and 'gemma_spec_msgs/ToolCall[] tool_calls_delta' in feedback


def test_info_log_level_by_default(launched):
    # the launch file's default log_level info (test_launch.py checks warn)
    assert '[gemma_spec]: ready in' in launched.text and '[DEBUG]' not in launched.text


def test_sigint_stops_launch_and_node_cleanly(launched):
    node_pids = [child.pid for child in psutil.Process(launched.process.pid).children(recursive=True)]
    assert node_pids, 'ros2 launch started no process'
    assert launched.interrupt() == 0, launched.text[-3000:]
    assert 'process has finished cleanly' in launched.text and 'escalating to' not in launched.text
    assert not [pid for pid in node_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != 'zombie']
