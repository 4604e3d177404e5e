"""
Faults under launch_pytest: the node killed or stopped mid-goal, with respawn:=true.

Killed: launch starts the node again and it comes back serving (/diagnostics ready); a client's goal whose server
died ends 'lost' within the DDS lease instead of waiting for its timeout, and send(retries=1) resends it to the new
node. Stopped for 10 s (SIGSTOP, then SIGCONT): the goal finishes, nothing lost.
"""

import os
import signal
import threading
import time

import pytest
from conftest import LaunchOutput, missing_ros2_tools, orin_launch_description, ready_client

if missing_ros2_tools():
    pytest.skip(missing_ros2_tools(), allow_module_level=True)

import launch_pytest

from gemma_spec_ros.tools.client import make_goal

DOMAIN_ID = 91 + (os.getpid() + 11) % 80
ACTION = '/gemma_spec/generate'
READY_TIMEOUT = 300.0
LOST_WITHIN = 40.0    # seconds from the kill to the 'lost' outcome: a DDS participant lease and a margin
STALL_S = 10.0        # seconds the node is stopped (SIGSTOP), below Fast DDS's default 20 s participant lease
LONG_GOAL = make_goal('def parse(text):', max_new_tokens=1000)   # runs for seconds, long enough to be killed in

OUTPUT = LaunchOutput()


@launch_pytest.fixture(scope='module')
def respawning_launch():
    return orin_launch_description(DOMAIN_ID, OUTPUT, {
        'respawn': 'true', 'respawn_delay': '1.0', 'drafter': 'none', 'device': 'cpu', 'compile': 'eager',
        'warmup': 'off', 'log_level': 'warn'})


@pytest.fixture(scope='module')
def ready(context):
    with ready_client(context, ACTION, 'fault_test_client', READY_TIMEOUT) as client:
        yield client


def send_and_kill(client, **send_options):
    """Send LONG_GOAL, kill -9 the node at its first feedback; return (outcome, seconds from the kill, old pid)."""
    pids = OUTPUT.wait_for_start(1, 30)
    killed = {}

    def on_feedback(_):
        if not killed:
            killed['at'] = time.monotonic()
            os.kill(pids[-1], signal.SIGKILL)

    outcome = client.send(LONG_GOAL, on_feedback=on_feedback, timeout=300, **send_options)
    assert killed, 'the goal ended before any feedback: {}'.format(outcome.status)
    return outcome, time.monotonic() - killed['at'], pids[-1]


@pytest.mark.launch(fixture=respawning_launch)
def test_a_goal_whose_node_is_killed_ends_lost_and_the_node_comes_back(ready):
    outcome, waited, pid = send_and_kill(ready)
    assert outcome.status == 'lost' and outcome.result is None and outcome.feedback
    assert waited < LOST_WITHIN
    print('the goal ended lost {:.1f} s after the kill'.format(waited))
    started = OUTPUT.wait_for_start(2, 60)
    assert len(started) >= 2 and started[-1] != pid, 'launch did not start the node again'
    ready.wait_until_ready('gemma_spec', READY_TIMEOUT)
    assert ready.wait_for_server(30)
    again = ready.send(make_goal('def add(a, b):', max_new_tokens=8))
    assert again.status == 'succeeded' and again.result.stats.new_tokens == 8


@pytest.mark.launch(fixture=respawning_launch)
def test_send_with_a_retry_resends_a_lost_goal_to_the_respawned_node(ready):
    ready.wait_until_ready('gemma_spec', READY_TIMEOUT)
    assert ready.wait_for_server(30)
    outcome, _, pid = send_and_kill(ready, retries=1, server_timeout=READY_TIMEOUT)
    assert outcome.attempts == 2 and outcome.status == 'succeeded', outcome.status
    assert outcome.result.finish_reason == 'length' and outcome.result.stats.new_tokens == 1000
    assert OUTPUT.pids[-1] != pid


@pytest.mark.launch(fixture=respawning_launch)
def test_a_node_stopped_for_ten_seconds_mid_goal_finishes_it_and_loses_nothing(ready):
    # SIGSTOP as a stalled process (swapping, a debugger, a frozen container): shorter than the DDS lease, the
    # client keeps waiting and the goal resumes where it stopped
    ready.wait_until_ready('gemma_spec', READY_TIMEOUT)
    assert ready.wait_for_server(30)
    pid = OUTPUT.wait_for_start(1, 30)[-1]
    stopped = {}

    def on_feedback(_):
        if not stopped:
            stopped['at'] = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            timer = threading.Timer(STALL_S, os.kill, (pid, signal.SIGCONT))
            timer.start()

    outcome = ready.send(LONG_GOAL, on_feedback=on_feedback, timeout=300)
    assert stopped and outcome.status == 'succeeded' and outcome.attempts == 1, outcome.status
    assert time.monotonic() - stopped['at'] >= STALL_S
    assert outcome.result.stats.new_tokens == 1000 and outcome.fully_streamed
    assert OUTPUT.pids[-1] == pid   # the same process: launch saw no death
