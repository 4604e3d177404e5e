"""
Background warm-up: serve at once on eager steps, swap each compiled graph in between rounds, change nothing.

The engine serves while its compiled steps build on shadows of the models, and each graph takes over between rounds
without changing a greedy token or the sampled distribution.

The module's engine builds its graphs when a test says so (start_warmup=False), in file order: first nothing, then
the graph the served requests wanted most, then every graph of the target.
"""

import os
import signal
import subprocess
import sys
import threading
from collections import Counter

import pytest
from conftest import TEST_DEVICE, TEST_THREADS, chi_squared_p_value, missing_ros2_tools, target_distribution

from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest

pytestmark = pytest.mark.skipif(TEST_DEVICE != 'cpu', reason='graphs build in the background for CPU inductor')

DOMAIN_ID = 11 + (os.getpid() + 31) % 80
PROMPT = 'The robot picked up the red cube and'
SAMPLING_PROMPT = 'the the the cube the the'
SAMPLES = 1000
TOP_K = 3
OUTPUT_LENGTH = 4  # a sampled goal runs a few rounds of K = 1: room for a swap between them


@pytest.fixture(scope='module')
def messages():
    return []


@pytest.fixture(scope='module')
def warming(tiny_models, messages):
    engine = Engine.from_config(EngineConfig(
        target_path=tiny_models.target, drafter='draft', draft_model_path=tiny_models.draft,
        assistant_path=tiny_models.assistant, compile='inductor', warmup='background', device='cpu', dtype='float32',
        num_threads=TEST_THREADS), progress=messages.append, start_warmup=False)
    yield engine
    engine.close()


def _build_target_graphs(engine) -> None:
    for job in engine.warmup.pending:
        if job.name.startswith('target '):
            engine.warmup.build(job)


def _toggling(engine):
    """Return an on_delta that flips the target between its graphs and eager steps from one round to the next."""
    state = {'graphs': True}

    def flip(delta):
        state['graphs'] = not state['graphs']
        engine.warmup.use_graphs(state['graphs'])
    return flip


def test_an_engine_serves_on_eager_steps_before_any_graph_is_built(warming, reference):
    state = warming.status().warmup
    assert (state.policy, state.graphs_ready, state.done, state.serving) == ('background', 0, False, 'eager')
    names = [job.name for job in warming.warmup.jobs]
    assert state.graphs_total == len(names)
    # before any request: the target's one-token step, then the default drafter's graphs, then the rest
    assert names[0] == 'target q=1' and names[1].startswith('draft ') and names[-1] == 'mtp step'
    prompt_ids = warming.tokenizer(PROMPT).input_ids
    for drafter in ('draft', 'mtp', 'none'):
        result = warming.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=24, drafter=drafter,
                                                    num_draft_tokens=2))
        assert result.token_ids == reference(prompt_ids, 24)
        assert result.stats.decode_path == 'eager (warming up)'


def test_the_graph_served_requests_wanted_most_builds_first(warming, messages):
    jobs = warming.warmup.jobs
    wanted = max(jobs, key=lambda job: job.demand)
    assert wanted.demand > 0 and wanted is not jobs[0]  # the order before requests gave way to their demand
    assert warming.warmup.build_next()
    assert messages[-1].startswith('warm-up: {} ready'.format(wanted.name)), messages[-1]
    state = warming.status().warmup
    assert state.graphs_ready == 1 and not state.done and state.serving.startswith('partly compiled (1 of')


def test_target_graphs_take_over_between_rounds_and_greedy_output_stays_exact(warming, reference):
    _build_target_graphs(warming)
    prompt_ids = warming.tokenizer(PROMPT).input_ids
    expected = reference(prompt_ids, 60)
    plain = warming.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=60, drafter='none'))
    assert plain.token_ids == expected and plain.stats.decode_path == 'inductor'  # every target step compiled
    for drafter in ('none', 'ngram', 'draft', 'mtp'):
        result = warming.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=60, drafter=drafter),
                                  on_delta=_toggling(warming))
        assert result.token_ids == expected, drafter
        assert 'eager + inductor' in result.stats.decode_path, (drafter, result.stats.decode_path)
    warming.warmup.use_graphs(True)


def test_sampled_output_follows_the_target_distribution_across_swaps(warming):
    _build_target_graphs(warming)
    prompt_ids = warming.tokenizer(SAMPLING_PROMPT).input_ids
    expected = target_distribution(warming.target_lm.model, prompt_ids, 2.0, TOP_K, OUTPUT_LENGTH)
    observed, paths = Counter(), Counter()
    for seed in range(SAMPLES):
        result = warming.generate(GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=OUTPUT_LENGTH, temperature=2.0, top_k=TOP_K, seed=seed,
            drafter='draft', num_draft_tokens=1), on_delta=_toggling(warming))
        observed[tuple(result.token_ids)] += 1
        paths['both' if 'eager + inductor' in result.stats.decode_path else result.stats.decode_path] += 1
    warming.warmup.use_graphs(True)
    assert paths['both'] > SAMPLES / 2, paths  # most goals swapped between rounds
    assert chi_squared_p_value(observed, expected) > 1e-3


@pytest.mark.skipif(bool(missing_ros2_tools()), reason=missing_ros2_tools() or 'ros2 tools present')
def test_a_node_on_an_empty_compile_cache_answers_at_once_then_on_its_first_graph(context, tiny_models, tmp_path):
    from gemma_spec_ros.tools.client import GenerateClient, make_goal

    name = 'gemma_spec_cold'
    args = ['-p', 'engine.target_path:=' + tiny_models.target, '-p', 'engine.draft_model_path:=' + tiny_models.draft,
            '-p', 'engine.drafter:=draft', '-p', 'engine.device:=cpu', '-p', 'engine.num_threads:=1',
            '-p', 'engine.compile:=inductor', '-p', 'engine.warmup:=background',
            '-p', 'diagnostic_updater.period:=0.2', '-r', '__node:=' + name]
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
               PYTHONPATH=os.pathsep.join(sys.path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / 'empty_compile_cache'))
    node = subprocess.Popen([sys.executable, '-m', 'gemma_spec_ros', 'node', '--ros-args'] + args,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    stderr = []
    threading.Thread(target=lambda: stderr.extend(node.stderr), daemon=True).start()
    client = GenerateClient('/{}/generate'.format(name), 'cold_planner', context=context)
    try:
        client.wait_until_ready(name, timeout=120)
        goal = dict(prompt=PROMPT, max_new_tokens=24)
        speculative = client.send(make_goal(num_draft_tokens=2, **goal), timeout=60)
        plain = client.send(make_goal(drafter='none', **goal), timeout=60)
        _, _, values, _ = client.diagnostics_sample(name, timeout=10)[name + ': engine']
        assert values['warm-up done'] == 'false' and values['warm-up'] == 'background'
        assert speculative.status == plain.status == 'succeeded'
        assert list(speculative.result.token_ids) == list(plain.result.token_ids)
        assert speculative.result.stats.decode_path == 'eager (warming up)'
        assert speculative.result.stats.drafted_tokens > 0

        def graphs_ready(latest):
            engine_status = latest.get(name + ': engine')
            return engine_status is not None and not engine_status[2].get('graphs ready', '0').startswith('0')
        # the compile process compiles the graph these goals wanted most; the node builds it from the cache
        assert client.diagnostics_sample(name, timeout=240, predicate=graphs_ready), ''.join(stderr)
        again = client.send(make_goal(num_draft_tokens=2, **goal), timeout=60)
        assert list(again.result.token_ids) == list(plain.result.token_ids)
        assert 'inductor' in again.result.stats.decode_path, again.result.stats.decode_path
        node.send_signal(signal.SIGINT)  # while other graphs compile: the node still exits at once and cleanly
        assert node.wait(30) == 0, ''.join(stderr)
    finally:
        if node.poll() is None:
            node.kill()
        client.close()


EXIT_WHILE_WARMING_UP = '''
import sys, threading
from gemma_spec_ros.engine import Engine, EngineConfig
first_graph = threading.Event()

def say(message):
    print(message, flush=True)
    if ' ready (' in message:
        first_graph.set()

target, draft, threads = sys.argv[1:]
engine = Engine.from_config(EngineConfig(
    target_path=target, drafter='draft', draft_model_path=draft, compile='inductor', warmup='background',
    device='cpu', dtype='float32', num_threads=int(threads)), progress=say)
assert first_graph.wait(600), 'no graph built'
print('exiting while the warm-up builds the next graph', flush=True)
'''


def test_a_process_that_exits_while_warming_up_exits_cleanly(tiny_models):
    # The worker thread is joined before the interpreter finalizes: one still inside torch's C++ then aborts the
    # process ("terminate called without an active exception", exit status 134).
    done = subprocess.run([sys.executable, '-c', EXIT_WHILE_WARMING_UP, tiny_models.target, tiny_models.draft,
                           str(TEST_THREADS)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert 'exiting while the warm-up builds the next graph' in done.stdout
    assert 'warm-up: stopping before exit' in done.stdout, done.stdout[-3000:]
    assert 'terminate called' not in output
