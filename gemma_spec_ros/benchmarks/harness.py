"""
Load the systems and measure them interleaved.

Per repeat and prompt, every system runs once, in a shuffled order, so machine drift (shared cores,
thermal) spreads over all systems instead of biasing one.
"""

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gemma_spec_ros.benchmarks.decode.probe import CostSampler
from gemma_spec_ros.benchmarks.prompts import Prompt
from gemma_spec_ros.benchmarks.systems import (
    EngineRunner,
    ForwardCounter,
    Outcome,
    Runner,
    System,
    TransformersRunner,
)
from gemma_spec_ros.engine.stats import is_known, read_process_memory, tokens_per_second
from gemma_spec_ros.engine.types import COMPILE_MODES, DRAFTERS

WARM_UP_TOKENS = 8


@dataclass
class Settings:
    target: str
    draft: str
    assistant: str
    max_new_tokens: int
    repeats: int
    ks: list[int]                  # fixed K values for our engine and the transformers K sweep
    drafters: list[str]            # speculative drafters to measure (subset of ngram, draft, mtp)
    threads: int
    probe_repeats: int             # cost-probe rounds before and after the run (plus one after each prompt)
    seed: int
    compile_modes: list[str] = field(default_factory=lambda: ['auto'])  # one engine per mode; the first is "ours"
    eagle3: str = ''               # EAGLE-3 head (drafter eagle3: bench --planner only; transformers has none)

    def check(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError('max_new_tokens must be >= 2 (decode speed needs two tokens), got {}'.format(
                self.max_new_tokens))
        if self.repeats < 1:
            raise ValueError('repeats must be >= 1, got {}'.format(self.repeats))
        if not self.ks or min(self.ks) < 1:
            raise ValueError('K values must be >= 1, got {}'.format(self.ks))
        unknown = [d for d in self.drafters if d not in DRAFTERS or d in ('none', 'auto')]
        if unknown:
            raise ValueError('unknown drafters {}; choose from ngram, draft, mtp (auto, which transformers lacks: '
                             'bench drafters)'.format(unknown))
        if self.threads < 1:
            raise ValueError('threads must be >= 1, got {}'.format(self.threads))
        check_compile_modes(self.compile_modes)


def check_compile_modes(modes: list[str]) -> None:
    unknown = [mode for mode in modes if mode not in COMPILE_MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise ValueError('--compile must list distinct modes of {}, got {}'.format(', '.join(COMPILE_MODES),
                                                                                   ','.join(modes) or 'none'))


@dataclass
class Measurement:
    """One timed generation (warm-up and calibration runs are not recorded)."""

    system: str
    prompt_id: str
    category: str
    repeat: int
    new_tokens: int
    ttft_s: float
    decode_s: float
    wall_s: float
    target_passes: int
    drafted_tokens: int
    accepted_tokens: int
    per_position_acceptance: list[float]
    mean_num_draft_tokens: float
    draft_cost_ratio: float
    paused_rounds: int
    drafter_used: str
    warnings: list[str]
    peak_rss_bytes: int            # process high-water mark during this generation
    rss_growth_bytes: int          # peak minus RSS before the call
    parity: bool                   # token-identical to transformers' plain greedy generate
    first_mismatch: int            # first differing position, -1 when identical
    token_ids: list[int] = field(repr=False, default_factory=list)
    structure_complete: bool = False  # the output completed the request's json_schema (constrained runs)
    decode_cpu_s: float = 0.0      # our engine: CPU seconds of the generating thread over decode_s
    rounds_by_draft_length: list[int] = field(default_factory=list)  # [K + 1] decode rounds that drafted k (ours)


@dataclass
class Startup:
    """What a family costs before its first measured token."""

    name: str                      # system prefix: ours, ours-transformers, hf, hf-static, or a vllm server's system
    load_s: float                  # engine load / model loading / server start until it answers
    first_call_s: float            # first full-length generation (compile, capture, one-time initialization)
    note: str = ''


@dataclass
class Skipped:
    """A system that could not be measured, and why."""

    system: str
    reason: str


@dataclass
class Calibration:
    """transformers' tok/s per K on the calibration prompts, and the K picked for each drafter."""

    tokens_per_s: dict[str, dict[int, float]]
    chosen_k: dict[str, int]


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0); without it, peaks are process-lifetime peaks."""
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')
    except OSError:
        pass


def first_mismatch(tokens: list[int], reference: list[int]) -> int:
    """First position where the sequences differ (a length difference counts), -1 when identical."""
    for index, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return index
    return -1 if len(tokens) == len(reference) else min(len(tokens), len(reference))


def load_engine(settings: Settings, progress: Callable[[str], None], compile_mode: str = 'auto'):
    """Check the settings and load our engine with the drafters they name (CPU, float32, their threads)."""
    import torch
    from transformers.utils import logging as hf_logging

    from gemma_spec_ros.engine import Engine
    from gemma_spec_ros.engine.types import EngineConfig

    settings.check()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(settings.threads)
    progress('loading our engine (compile {})'.format(compile_mode))
    return Engine.from_config(EngineConfig(
        target_path=settings.target, drafter='none',
        assistant_path=settings.assistant if 'mtp' in settings.drafters else '',
        draft_model_path=settings.draft if 'draft' in settings.drafters else '',
        eagle3_path=settings.eagle3 if 'eagle3' in settings.drafters else '',
        device='cpu', dtype='float32', max_draft_tokens=max(settings.ks),
        max_new_tokens_limit=max(2048, settings.max_new_tokens), num_threads=settings.threads,
        compile=compile_mode, warmup='blocking'), progress=progress)  # measured at full speed


class Bench:
    """Loaded models, our engines (one per compile mode) and the runners of every system."""

    def __init__(self, settings: Settings, progress: Callable[[str], None]):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings = settings
        self.engines = {}
        self.load_s: dict[str, float] = {}  # system prefix -> seconds to load
        for mode in settings.compile_modes:
            started = time.perf_counter()
            self.engines[mode] = load_engine(settings, progress, mode)
            self.load_s[System('ours', 'none', compile=mode).prefix] = time.perf_counter() - started
        progress('loading transformers models')
        started = time.perf_counter()

        def load(path):
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()

        self.tokenizer = AutoTokenizer.from_pretrained(settings.target, local_files_only=True)
        self.target = load(settings.target)
        self.draft_model = load(settings.draft) if 'draft' in settings.drafters else None
        self.assistant = load(settings.assistant) if 'mtp' in settings.drafters else None
        self.counter = ForwardCounter(self.target)
        self.load_s['hf'] = self.load_s['hf-static'] = time.perf_counter() - started
        self.static_cache_len = 0  # hf-static's cache: longest prompt + max_new_tokens (set once prompts are known)

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer(prompt.text).input_ids

    def our_systems(self) -> list[System]:
        systems = []
        for mode in self.settings.compile_modes:
            systems.append(System('ours', 'none', compile=mode))
            for drafter in self.settings.drafters:
                systems += [System('ours', drafter, k, mode) for k in self.settings.ks] + [
                    System('ours', drafter, 0, mode)]
        return systems

    def runner(self, system: System) -> Runner:
        if system.family == 'ours':
            return EngineRunner(self.engines[system.compile or 'auto'], system.drafter, system.k or 0)
        if system.family == 'hf-static' and not self.static_cache_len:
            raise ValueError('hf-static needs Bench.static_cache_len')
        return TransformersRunner(self.target, self.counter, system.drafter, system.k, self.draft_model,
                                  self.assistant, self.static_cache_len if system.family == 'hf-static' else 0)

    def first_calls(self, systems: list[System], prompt: Prompt) -> list[Startup]:
        """Time each plain system's first full-length generation: compile, capture and one-time set-up."""
        startups = []
        for system in systems:
            started = time.perf_counter()
            self.runner(system)(self.encode(prompt), self.settings.max_new_tokens)
            note = {'hf-static': 'the models of hf; first call = torch.compile of the decode forward'}.get(
                system.prefix, '')
            startups.append(Startup(system.prefix, self.load_s[system.prefix], time.perf_counter() - started, note))
        return startups

    def refusal(self, system: System, prompt: Prompt) -> str:
        """One short generation; the ValueError text if transformers refuses the configuration, else ''."""
        try:
            self.runner(system)(self.encode(prompt), 2)
        except ValueError as error:
            window = getattr(self.target.config.get_text_config(), 'sliding_window', None)
            return 'transformers refuses it: {} (static cache of {} tokens; sliding window {})'.format(
                error, self.static_cache_len, window)
        return ''

    def calibrate(self, prompts: list[Prompt], on_step: Callable[[str], None], family: str = 'hf',
                  drafters: list[str] | None = None) -> Calibration:
        """Pick transformers' best K per drafter by decode tok/s on the calibration prompts (also a warm-up)."""
        rates: dict[str, dict[int, float]] = {}
        for drafter in self.settings.drafters if drafters is None else drafters:
            rates[drafter] = {}
            for k in self.settings.ks:
                system = System(family, drafter, k)
                runner = self.runner(system)
                tokens = seconds = 0.0
                for prompt in prompts:
                    outcome = runner(self.encode(prompt), self.settings.max_new_tokens)
                    tokens += max(0, len(outcome.token_ids) - 1)   # decode tokens: after the first
                    seconds += outcome.decode_s
                    on_step(system.name)
                rates[drafter][k] = tokens_per_second(tokens, seconds)
        chosen = {drafter: max(by_k, key=lambda k, by_k=by_k: by_k[k] if is_known(by_k[k]) else -1.0)
                  for drafter, by_k in rates.items()}
        return Calibration(rates, chosen)

    def cost_sampler(self, prompt: Prompt) -> CostSampler:
        sizes = [1] + [k + 1 for k in self.settings.ks]
        return CostSampler(self.target, self.encode(prompt), sizes, self.draft_model, self.assistant, self.engines)


def measure_once(runner: Runner, prompt_ids: list[int], max_new_tokens: int) -> tuple[Outcome, int, int]:
    """One generation with its peak RSS and RSS growth."""
    _reset_peak_rss()
    before = read_process_memory().get('VmRSS', 0)
    outcome = runner(prompt_ids, max_new_tokens)
    peak = read_process_memory().get('VmHWM', 0)
    return outcome, peak, max(0, peak - before)


def to_measurement(system: str, prompt: Prompt, repeat: int, outcome: Outcome, peak: int, growth: int,
                   reference: list[int]) -> Measurement:
    """Record a generation, compared with the parity reference."""
    mismatch = first_mismatch(outcome.token_ids, reference)
    fields = {f.name: getattr(outcome, f.name) for f in dataclasses.fields(Outcome)}
    return Measurement(system=system, prompt_id=prompt.id, category=prompt.category, repeat=repeat,
                       new_tokens=len(outcome.token_ids), peak_rss_bytes=peak, rss_growth_bytes=growth,
                       parity=mismatch < 0, first_mismatch=mismatch, **fields)


def parity_references(measurements: list[Measurement]) -> dict[str, list[int]]:
    """Per prompt, the tokens of transformers' plain greedy generate in the first repeat."""
    return {m.prompt_id: m.token_ids for m in measurements if m.system == 'hf/none' and m.repeat == 0}


def run_interleaved(bench: Bench, systems: list[System], prompts: list[Prompt], probe: CostSampler,
                    on_step: Callable[[str], None]) -> tuple[list[Measurement], dict[str, float]]:
    """
    Measure every system on every prompt ``repeats`` times after one warm-up run per system.

    The order is shuffled per (repeat, prompt) with a fixed seed; one cost-probe round follows each prompt.
    Returns the measurements and each system's warm-up seconds.
    """
    settings = bench.settings
    runners = {system.name: bench.runner(system) for system in systems}
    if 'hf/none' not in runners:
        raise ValueError('the interleaved run needs hf/none as the parity reference')
    order = random.Random(settings.seed)
    encoded = {prompt.id: bench.encode(prompt) for prompt in prompts}
    warm_up_s = {}
    for system in systems:  # warm-up (one-time initialization), not recorded
        # A static cache compiles one graph per cache state (sliding window full or not): hf-static warms up on
        # every prompt at full length, so that no recompile falls into a measured run.
        started = time.perf_counter()
        for prompt in prompts if system.family == 'hf-static' else prompts[:1]:
            runners[system.name](encoded[prompt.id], settings.max_new_tokens if system.family == 'hf-static' else
                                 min(WARM_UP_TOKENS, settings.max_new_tokens))
        warm_up_s[system.name] = time.perf_counter() - started
        on_step(system.name)
    references: dict[str, list[int]] = {}
    measurements = []
    for repeat in range(settings.repeats):
        for prompt in prompts:
            names = list(runners)
            order.shuffle(names)
            outcomes = {}
            for name in names:
                outcomes[name] = measure_once(runners[name], encoded[prompt.id], settings.max_new_tokens)
                on_step(name)
            probe.sample()
            reference = references.setdefault(prompt.id, outcomes['hf/none'][0].token_ids)
            measurements += [to_measurement(name, prompt, repeat, *outcomes[name], reference) for name in runners]
    return measurements, warm_up_s
