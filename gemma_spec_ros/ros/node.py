"""
ROS 2 node ``gemma_spec``: the action ``~/generate`` and /diagnostics around the speculative engine.

The node only adapts ROS to the engine: it loads the engine from parameters, runs one generation at a
time from a bounded FIFO on a worker thread, streams one feedback message per verify round, and maps
cancels, preemption and failures onto goal states with the reason in ``result.error``.
"""

import dataclasses
import signal
import sys
import threading
import time
import traceback
from collections import deque

import rclpy
from gemma_spec_msgs.action import Generate
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from gemma_spec_ros.engine.types import DRAFTERS, CancelToken, EngineConfig, GenerationRequest
from gemma_spec_ros.ros import diagnostics

NODE_NAME = 'gemma_spec'
QUEUE_MAX_LENGTH_LIMIT = 16
FEEDBACK_QUEUE_DEPTH = 1000  # KEEP_LAST depth for feedback: one message per round, never dropped
CANCEL_STATE_TIMEOUT = 2.0   # seconds to wait for rclpy to mark a cancelled goal CANCELING
_ENGINE_DEVICES = ('auto', 'cpu', 'cuda')
_ENGINE_DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
_QUEUE_POLICIES = ('fifo', 'preempt')
_BIG = 2 ** 31 - 1

# EngineConfig field -> (description, integer (min, max) or string choices)
ENGINE_PARAMETERS = {
    'target_path': ('Gemma 4 target directory: absolute, or relative to the working directory, the '
                    'repository, or the installed share/gemma_spec_ros', None),
    'drafter': ('default drafter: none|mtp|draft|ngram (changeable at run time)', DRAFTERS),
    'assistant_path': ('Gemma4AssistantForCausalLM directory for drafter mtp', None),
    'draft_model_path': ('smaller Gemma4ForCausalLM directory for drafter draft', None),
    'device': ('auto|cpu|cuda (auto: cuda when available)', _ENGINE_DEVICES),
    'dtype': ('auto|float32|bfloat16|float16 (auto: float32 on CPU, bfloat16 on CUDA)', _ENGINE_DTYPES),
    'num_draft_tokens': ('K, tokens drafted per round; 0 = adaptive (changeable at run time)', (0, 64)),
    'max_draft_tokens': ('upper bound for adaptive K', (1, 64)),
    'ngram_min': ('smallest n-gram the prompt-lookup drafter matches', (1, 64)),
    'ngram_max': ('largest n-gram the prompt-lookup drafter matches', (1, 64)),
    'profit_gate': ('pause speculation while no K >= 1 beats plain decoding', None),
    'probe_interval': ('verify rounds between probes while speculation is paused', (1, _BIG)),
    'max_new_tokens': ('tokens generated when a goal says 0', (1, _BIG)),
    'max_new_tokens_limit': ('largest max_new_tokens a goal may ask for', (1, _BIG)),
    'num_threads': ('torch CPU threads; 0 = torch default', (0, 1024)),
}
RUNTIME_ENGINE_PARAMETERS = ('engine.drafter', 'engine.num_draft_tokens')

# name -> (default, description, integer/float (min, max) or string choices)
NODE_PARAMETERS = {
    'generation.temperature': (0.0, 'temperature for goals that send 0 (0 = greedy)', (0.0, 2.0)),
    'generation.top_p': (0.0, 'top-p for goals that send 0 (0 = off)', (0.0, 1.0)),
    'generation.top_k': (0, 'top-k for goals that send 0 (0 = off)', (0, _BIG)),
    'generation.seed': (-1, 'seed for goals that send -1 (-1 = random)', (-1, 2 ** 63 - 1)),
    'generation.max_prompt_chars': (32768, 'longest prompt (all messages together) a goal may send',
                                    (1, _BIG)),
    'generation.max_stop_strings': (16, 'most stop strings a goal may send', (0, 1024)),
    'queue.max_length': (4, 'goals that may wait behind the running one; more are rejected (busy)',
                         (0, QUEUE_MAX_LENGTH_LIMIT)),
    'queue.policy': ('fifo', 'fifo: goals wait their turn; preempt: a new goal aborts the running and '
                     'waiting ones (like nav2)', _QUEUE_POLICIES),
    'diagnostics.hardware_id': ('none', 'hardware_id of the /diagnostics statuses', None),
    'diagnostics.window': (32, 'goals in the rolling window of the /diagnostics figures', (1, 100000)),
    'diagnostics.ttft_budget': (2.0, 'WARN when the time-to-first-token p95 exceeds this (s, 0 = off)',
                                (0.0, 3600.0)),
    'diagnostics.inter_token_latency_budget': (
        0.25, 'WARN when the inter-token latency p95 exceeds this (s, 0 = off)', (0.0, 3600.0)),
    'diagnostics.rss_budget_mb': (0.0, 'WARN when the process RSS exceeds this (MiB, 0 = off)',
                                  (0.0, 1e9)),
    'diagnostics.min_mem_available_mb': (
        512.0, 'WARN when system MemAvailable (unified memory on Jetson) drops below this (MiB, 0 = off)',
        (0.0, 1e9)),
    'diagnostics.cuda_reserved_budget_mb': (
        0.0, 'WARN when CUDA memory reserved exceeds this (MiB, 0 = off)', (0.0, 1e9)),
}


def _descriptor(description, bounds, value, read_only=False):
    descriptor = ParameterDescriptor(description=description, read_only=read_only)
    if isinstance(bounds, tuple) and len(bounds) == 2 and not isinstance(value, (str, bool)):
        if isinstance(value, float):
            descriptor.floating_point_range = [FloatingPointRange(
                from_value=float(bounds[0]), to_value=float(bounds[1]))]
        else:
            descriptor.integer_range = [IntegerRange(from_value=bounds[0], to_value=bounds[1], step=1)]
    elif bounds is not None:
        descriptor.additional_constraints = 'one of: ' + ', '.join(bounds)
    return descriptor


def _choices(name):
    """Return the allowed string values of parameter ``name``, or None."""
    if name.startswith('engine.'):
        bounds = ENGINE_PARAMETERS.get(name[len('engine.'):], (None, None))[1]
    else:
        bounds = NODE_PARAMETERS.get(name, (None, None, None))[2]
    return bounds if isinstance(bounds, tuple) and bounds and isinstance(bounds[0], str) else None


def check_choice(name, value):
    """Raise ValueError when string parameter ``name`` is not one of its allowed values."""
    choices = _choices(name)
    if choices is not None and value not in choices:
        raise ValueError('parameter {} must be one of {}, got {!r}'.format(
            name, '|'.join(choices), value))


def stats_to_msg(stats, msg):
    """Copy engine GenerationStats fields into a gemma_spec_msgs/GenerationStats message."""
    for name, kind in msg.get_fields_and_field_types().items():
        value = getattr(stats, name, None)
        if value is None:
            continue
        if kind.startswith('sequence<float'):
            value = [float(v) for v in value]
        elif kind.startswith('float'):
            value = float(value)
        elif kind.startswith('uint') or kind.startswith('int'):
            value = max(0, int(value))
        setattr(msg, name, value)
    return msg


class _Job:
    """One accepted goal on its way through the queue."""

    def __init__(self, goal_handle):
        self.goal_handle = goal_handle
        self.cancel = CancelToken()
        self.done = threading.Event()
        self.request = None
        self.result = None          # engine GenerationResult
        self.error = ''             # why the goal failed
        self.client_cancelled = False
        self.preempted = False
        self.feedback_times = []    # (monotonic time, tokens) per feedback message

    def finish(self, error=''):
        self.error = self.error or error
        self.done.set()


class GemmaSpecNode(Node):
    """Generate action server over the speculative-decoding engine, with /diagnostics."""

    def __init__(self, node_name=NODE_NAME, engine_factory=None, **kwargs):
        super().__init__(node_name, **kwargs)
        self._engine_factory = engine_factory
        self._declare_parameters()
        self._lock = threading.Condition()
        self._state = 'loading'          # loading|ready|failed|shutdown
        self._load_error = ''
        self._engine = None
        self._admitted = 0               # accepted goals whose execute callback has not returned
        self._queue = deque()
        self._running = None
        self._jobs = {}                  # goal id bytes -> _Job
        self._early_cancels = set()
        self._metrics = diagnostics.GenerationMetrics(self._param('diagnostics.window'))
        self._load_started = time.monotonic()

        self._updater = diagnostics.Updater(self)
        self._updater.setHardwareID(self._param('diagnostics.hardware_id'))
        self._updater.add('engine', self._engine_task)
        self._updater.add('generation', self._generation_task)
        self._updater.add('memory', self._memory_task)
        self._updater.add(diagnostics.PeriodStatus(self._updater.period))
        self.add_on_set_parameters_callback(self._on_set_parameters)

        self._action_server = ActionServer(
            self, Generate, '~/generate',
            execute_callback=self.execute_callback,
            goal_callback=self.goal_callback,
            cancel_callback=self.cancel_callback,
            handle_accepted_callback=self.handle_accepted_callback,
            callback_group=ReentrantCallbackGroup(),
            feedback_pub_qos_profile=QoSProfile(depth=FEEDBACK_QUEUE_DEPTH))
        self._worker = threading.Thread(target=self._work, name='gemma_spec_worker', daemon=True)
        self._worker.start()
        self._loader = threading.Thread(target=self._load_engine, name='gemma_spec_loader', daemon=True)
        self._loader.start()

    # ---- parameters --------------------------------------------------------------------------

    def _declare_parameters(self):
        for field in dataclasses.fields(EngineConfig):
            description, bounds = ENGINE_PARAMETERS.get(field.name, ('EngineConfig.' + field.name, None))
            default = '' if field.default is dataclasses.MISSING else field.default
            name = 'engine.' + field.name
            self.declare_parameter(name, default, _descriptor(
                description, bounds, default, read_only=name not in RUNTIME_ENGINE_PARAMETERS))
        for name, (default, description, bounds) in NODE_PARAMETERS.items():
            self.declare_parameter(name, default, _descriptor(description, bounds, default))
        for name in list(NODE_PARAMETERS) + ['engine.' + f.name for f in dataclasses.fields(EngineConfig)]:
            check_choice(name, self._param(name))
        if not self._param('engine.target_path'):
            raise ValueError('parameter engine.target_path is required (a Gemma 4 target directory)')
        if self._param('engine.ngram_min') > self._param('engine.ngram_max'):
            raise ValueError('parameter engine.ngram_min must be <= engine.ngram_max')

    def _param(self, name):
        return self.get_parameter(name).value

    def _on_set_parameters(self, parameters):
        try:
            for parameter in parameters:
                check_choice(parameter.name, parameter.value)
            engine_changes = [p for p in parameters if p.name in RUNTIME_ENGINE_PARAMETERS]
            if engine_changes:
                with self._lock:
                    engine = self._engine
                if engine is None:
                    raise ValueError('engine is not loaded ({}); cannot change {}'.format(
                        self._state, ', '.join(p.name for p in engine_changes)))
                for parameter in engine_changes:
                    if parameter.name == 'engine.drafter':
                        engine.set_default_drafter(parameter.value)
                    else:
                        engine.set_default_num_draft_tokens(parameter.value)
                    self.get_logger().info('{} set to {!r}'.format(parameter.name, parameter.value))
        except ValueError as error:
            return SetParametersResult(successful=False, reason=str(error))
        for parameter in parameters:
            if parameter.name == 'diagnostics.hardware_id':
                self._updater.setHardwareID(parameter.value)
            elif parameter.name == 'diagnostics.window':
                self._metrics.resize(parameter.value)
        return SetParametersResult(successful=True)

    def engine_config(self) -> EngineConfig:
        """EngineConfig from the engine.* parameters, model paths resolved."""
        from gemma_spec_ros.engine.config_file import resolve_model_path
        values = {f.name: self._param('engine.' + f.name) for f in dataclasses.fields(EngineConfig)}
        for key in ('target_path', 'assistant_path', 'draft_model_path'):
            if values[key]:
                values[key] = str(resolve_model_path(values[key]))
        return EngineConfig(**values)

    # ---- engine loading ----------------------------------------------------------------------

    def _load_engine(self):
        logger = self.get_logger()
        try:
            config = self.engine_config()
            logger.info('loading engine: target {} drafter {} device {}'.format(
                config.target_path, config.drafter, config.device))
            if self._engine_factory is not None:
                engine = self._engine_factory(config)
            else:
                from gemma_spec_ros.engine import Engine
                engine = Engine.from_config(config, progress=lambda message: logger.info(str(message)))
        except Exception as error:  # noqa: BLE001 (any load failure is reported, the node stays up)
            reason = 'engine failed to load: {}'.format(error)
            logger.error(reason)
            with self._lock:
                if self._state == 'loading':
                    self._state, self._load_error = 'failed', reason
                waiting = list(self._queue)
                self._queue.clear()
            for job in waiting:
                job.finish(reason)
            return
        with self._lock:
            if self._state != 'loading':
                return
            self._engine, self._state = engine, 'ready'
            self._lock.notify_all()
        logger.info('ready in {:.1f} s: action {}'.format(
            time.monotonic() - self._load_started, self.resolve_action_name()))

    def resolve_action_name(self):
        namespace = self.get_namespace().rstrip('/')
        return '{}/{}/generate'.format(namespace, self.get_name())

    @property
    def state(self):
        return self._state

    @property
    def engine(self):
        return self._engine

    # ---- action callbacks --------------------------------------------------------------------

    def goal_callback(self, goal_request):
        """Accept unless busy: the running goal plus queue.max_length waiting ones (fifo)."""
        with self._lock:
            if self._state == 'shutdown':
                return GoalResponse.REJECT
            limit = self._param('queue.max_length') if self._param('queue.policy') == 'fifo' else (
                QUEUE_MAX_LENGTH_LIMIT)  # preempt: bounded only so that executor threads never run out
            if self._admitted >= 1 + limit:
                self._metrics.count('rejected')
                self.get_logger().warning('goal rejected: busy ({} goals running or waiting)'.format(
                    self._admitted))
                return GoalResponse.REJECT
            self._admitted += 1
        return GoalResponse.ACCEPT

    def handle_accepted_callback(self, goal_handle):
        job = _Job(goal_handle)
        key = bytes(goal_handle.goal_id.uuid)
        with self._lock:
            self._jobs[key] = job
            if key in self._early_cancels:
                self._early_cancels.discard(key)
                job.client_cancelled = True
                job.cancel.cancel()
        goal_handle.execute()

    def cancel_callback(self, goal_handle):
        """Accept every cancel: a waiting goal leaves the queue, the running one stops within a round."""
        key = bytes(goal_handle.goal_id.uuid)
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                self._early_cancels.add(key)
                return CancelResponse.ACCEPT
            job.client_cancelled = True
            job.cancel.cancel()
            if job in self._queue:
                self._queue.remove(job)
                job.finish()
        return CancelResponse.ACCEPT

    def execute_callback(self, goal_handle):
        key = bytes(goal_handle.goal_id.uuid)
        with self._lock:
            job = self._jobs[key]
        try:
            self._enqueue(job)
            job.done.wait()
            return self._complete(job)
        finally:
            with self._lock:
                self._jobs.pop(key, None)
                self._admitted -= 1

    def _enqueue(self, job):
        if job.client_cancelled:
            job.finish()
            return
        try:
            job.request = self.to_request(job.goal_handle.request)
        except ValueError as error:
            job.finish(str(error))
            return
        with self._lock:
            if self._state == 'ready':
                try:  # the engine's own checks now, so that a bad goal never waits in the queue
                    self._engine.validate(job.request)
                except ValueError as error:
                    job.finish(str(error))
                    return
            if self._state in ('failed', 'shutdown'):
                job.finish(self._load_error or 'node is shutting down')
                return
            if self._param('queue.policy') == 'preempt':
                self._preempt_all()
            self._queue.append(job)
            self._lock.notify_all()

    def _preempt_all(self):
        """Abort the running and waiting goals in favour of a newer one (called with the lock held)."""
        for other in list(self._queue) + ([self._running] if self._running else []):
            other.preempted = True
            other.cancel.cancel()
        while self._queue:
            self._queue.popleft().finish('preempted by a newer goal (queue.policy preempt)')
        if self._running is not None:
            self._running.error = 'preempted by a newer goal (queue.policy preempt)'

    def _complete(self, job):
        """Set the goal's terminal state and build its result."""
        goal_handle = job.goal_handle
        result = Generate.Result()
        if job.result is not None:
            result.text = job.result.text
            result.token_ids = [int(t) for t in job.result.token_ids]
            result.finish_reason = job.result.finish_reason
            stats_to_msg(job.result.stats, result.stats)
            result.warnings = list(job.result.warnings)
            for warning in job.result.warnings:
                self.get_logger().warning('goal {}: {}'.format(_short_id(goal_handle), warning))
        finish_reason = job.result.finish_reason if job.result is not None else ''
        if job.client_cancelled and finish_reason in ('cancelled', ''):
            result.finish_reason = 'cancelled'
            deadline = time.monotonic() + CANCEL_STATE_TIMEOUT
            while not goal_handle.is_cancel_requested and time.monotonic() < deadline:
                time.sleep(0.001)
            goal_handle.canceled()
            outcome = 'cancelled'
        elif job.error:
            result.error = job.error
            result.finish_reason = 'cancelled' if job.preempted or finish_reason == 'cancelled' else 'error'
            goal_handle.abort()
            outcome = 'aborted'
            self.get_logger().warning('goal {} aborted: {}'.format(_short_id(goal_handle), job.error))
        else:
            goal_handle.succeed()
            outcome = 'succeeded'
        self._metrics.record(outcome, job.result, job.feedback_times)
        return result

    def to_request(self, goal) -> GenerationRequest:
        """Build a GenerationRequest from a Generate goal and the generation.* defaults; ValueError if bad."""
        messages = [{'role': m.role, 'content': m.content} for m in goal.messages]
        prompt_chars = sum(len(m['content']) for m in messages) if messages else len(goal.prompt)
        limit = self._param('generation.max_prompt_chars')
        if prompt_chars > limit:
            raise ValueError('prompt has {} characters, more than generation.max_prompt_chars = {}'.format(
                prompt_chars, limit))
        if len(goal.stop) > self._param('generation.max_stop_strings'):
            raise ValueError('goal has {} stop strings, more than generation.max_stop_strings = {}'.format(
                len(goal.stop), self._param('generation.max_stop_strings')))
        return GenerationRequest(
            prompt='' if messages else goal.prompt,
            messages=messages or None,
            max_new_tokens=int(goal.max_new_tokens),
            temperature=float(goal.temperature) if goal.temperature != 0 else self._param(
                'generation.temperature'),
            top_p=float(goal.top_p) if goal.top_p != 0 else self._param('generation.top_p'),
            top_k=int(goal.top_k) if goal.top_k != 0 else self._param('generation.top_k'),
            stop=list(goal.stop),
            seed=int(goal.seed) if goal.seed != -1 else self._param('generation.seed'),
            drafter=goal.drafter,
            num_draft_tokens=int(goal.num_draft_tokens))

    # ---- worker ------------------------------------------------------------------------------

    def _work(self):
        while True:
            with self._lock:
                while self._state != 'shutdown' and not (self._state == 'ready' and self._queue):
                    self._lock.wait()
                if self._state == 'shutdown':
                    return
                job = self._running = self._queue.popleft()
            try:
                self._generate(job)
            finally:
                with self._lock:
                    self._running = None
                job.finish()

    def _generate(self, job):
        def on_delta(delta):
            job.feedback_times.append((time.monotonic(), len(delta.token_ids)))
            job.goal_handle.publish_feedback(Generate.Feedback(
                text_delta=delta.text, token_ids_delta=[int(t) for t in delta.token_ids],
                tokens_generated=int(delta.tokens_generated), tau=float(delta.tau)))

        job.feedback_times.append((time.monotonic(), 0))
        try:
            job.result = self._engine.generate(job.request, on_delta=on_delta, cancel=job.cancel)
        except ValueError as error:
            job.error = str(error)
        except Exception as error:  # noqa: BLE001 (the goal is aborted, the node keeps serving)
            job.error = 'engine error: {}: {}'.format(type(error).__name__, error)
            self.get_logger().error('goal {}: {}\n{}'.format(
                _short_id(job.goal_handle), job.error, traceback.format_exc()))

    # ---- diagnostics -------------------------------------------------------------------------

    def _engine_task(self, stat):
        engine = self._engine
        status = engine.status() if engine is not None else None
        return diagnostics.fill_engine_status(
            stat, self._state, self._load_error, status, self._metrics,
            loading_seconds=time.monotonic() - self._load_started)

    def _generation_task(self, stat):
        with self._lock:
            queued, running = len(self._queue), self._running is not None
        return diagnostics.fill_generation_status(
            stat, self._metrics, queued, running,
            ttft_budget=self._param('diagnostics.ttft_budget'),
            inter_token_latency_budget=self._param('diagnostics.inter_token_latency_budget'))

    def _memory_task(self, stat):
        engine = self._engine
        device = engine.status().device if engine is not None else 'cpu'
        return diagnostics.fill_memory_status(
            stat, diagnostics.read_memory(device),
            rss_budget_mb=self._param('diagnostics.rss_budget_mb'),
            min_mem_available_mb=self._param('diagnostics.min_mem_available_mb'),
            cuda_reserved_budget_mb=self._param('diagnostics.cuda_reserved_budget_mb'))

    # ---- shutdown ----------------------------------------------------------------------------

    def shutdown(self, reason='node is shutting down', timeout=5.0):
        """Stop serving: abort waiting goals, cancel the running one, wait for their results."""
        with self._lock:
            if self._state == 'shutdown':
                return
            self._state, self._load_error = 'shutdown', reason
            waiting = list(self._queue)
            self._queue.clear()
            if self._running is not None:
                self._running.error = reason
                self._running.cancel.cancel()
            self._lock.notify_all()
        for job in waiting:
            job.finish(reason)
        deadline = time.monotonic() + timeout
        while self._admitted > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self._worker.join(max(0.0, deadline - time.monotonic()))

    def destroy_node(self):
        self.shutdown()
        self._action_server.destroy()
        return super().destroy_node()


def _short_id(goal_handle):
    return bytes(goal_handle.goal_id.uuid).hex()[:8]


def main(argv=None) -> int:
    """Run the node until SIGINT/SIGTERM: ``python -m gemma_spec_ros node --ros-args ...``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ('-h', '--help') for arg in remove_ros_args(['gemma_spec_node'] + argv)[1:]):
        print('usage: python -m gemma_spec_ros node [--ros-args --params-file config/orin.yaml '
              '-p engine.device:=cpu ...]\n\nParameters (engine.* are EngineConfig fields):')
        for field in dataclasses.fields(EngineConfig):
            print('  engine.{:<34} {}'.format(field.name, ENGINE_PARAMETERS.get(field.name, ('',))[0]))
        for name, (default, description, _) in NODE_PARAMETERS.items():
            print('  {:<41} {} (default {!r})'.format(name, description, default))
        print('  {:<41} {}'.format(diagnostics.PERIOD_PARAMETER, 'seconds between /diagnostics updates'))
        return 0
    rclpy.init(args=['gemma_spec_node'] + argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        node = GemmaSpecNode()
    except Exception as error:  # noqa: BLE001 (bad parameters: a clear message, exit code 2)
        print('gemma_spec_node: invalid parameters: {}'.format(error), file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = MultiThreadedExecutor(num_threads=QUEUE_MAX_LENGTH_LIMIT + 6)
    executor.add_node(node)
    stopper, stopped_at = None, None
    while rclpy.ok():
        executor.spin_once(timeout_sec=0.1)
        if stop.is_set() and stopper is None:
            node.get_logger().info('shutting down')
            stopper = threading.Thread(target=node.shutdown)  # keeps spinning so the last results go out
            stopper.start()
        if stopper is not None and not stopper.is_alive():
            stopped_at = stopped_at or time.monotonic()
            if time.monotonic() - stopped_at > 0.3:
                break
    executor.shutdown(timeout_sec=1.0)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0

if __name__ == '__main__':
    sys.exit(main())
