"""The node gives the C heap's freed pages back to the OS when it goes idle, at most once per IDLE_TRIM_INTERVAL."""

import os

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

from test_node import serving, tiny_params  # noqa: E402

from gemma_spec_ros.ros import goal_server  # noqa: E402
from gemma_spec_ros.tools.client import make_goal  # noqa: E402

DOMAIN_ID = 13 + (os.getpid() + 29) % 80


def _trims(client, name, at_least=0):
    key = name + ': memory'
    latest = client.diagnostics_sample(name, 20, lambda statuses: key in statuses and int(
        statuses[key][2].get('heap trims when idle', -1)) >= at_least)
    assert latest is not None, 'no memory status with at least {} idle trims'.format(at_least)
    return int(latest[key][2]['heap trims when idle'])


@pytest.mark.parametrize(('interval', 'expected'), [(0.0, 'trimmed'), (3600.0, 'none')])
def test_idle_trims_follow_the_interval(context, tiny_models, monkeypatch, interval, expected):
    monkeypatch.setattr(goal_server, 'IDLE_TRIM_INTERVAL', interval)
    name = 'gemma_spec_trim_{}'.format(expected)
    with serving(context, name, tiny_params(tiny_models)) as (node, client):
        for _ in range(3):   # one after another: the node is idle after each
            assert client.send(make_goal('The robot', max_new_tokens=4)).status == 'succeeded'
        if expected == 'trimmed':
            assert _trims(client, name, at_least=1) >= 1
        else:   # the first trim is due an interval after the node started
            assert _trims(client, name) == 0
