"""
The constrained category: what a JSON Schema costs our engine, per drafter and K, against the same goals without it.

``python -m gemma_spec_ros bench --constrained [FILE]`` runs the prompts of FILE (default bench/constrained.json: a
JSON Schema and a few planner prompts) on our plain decoding and on each drafter at each fixed K, every system with
and without the schema, greedy, interleaved in a shuffled order per prompt and repeat; without the schema it
generates as many tokens as with it. The schema's output is compact JSON, or with --json-free-whitespace JSON with
whitespace between elements. Per prompt: tokens used and whether the output completed the schema. Per system
(medians over repeats of sums over the prompts):

- tau: decode tokens per decode target pass (engine.stats.tau), without and with the schema;
- tok/s: decode tokens per second (wall clock; engine.stats.tokens_per_second);
- round ms: decode CPU seconds of the generating thread per target pass (the engine runs on that one thread with
  one torch thread; preemption by other processes does not count, unlike in wall time);
- grammar us/token: CPU time of the constraint per decode token: the matcher's calls (masks, draft lookahead,
  accept) and applying the masks to the logits, timed around those calls (the first token's mask included);
- overhead at the same tau: that grammar time over the rest of the same runs' decode time (goal <= 10%). Measured
  inside each run, it is what the constraint adds at the tau the run had, free of run-to-run noise;
- end-to-end: round ms with / round ms without - 1, the same figure from separate runs. On shared cores their
  cache and memory-bandwidth contention moves it by 10-30% between repeats, so it only bounds the direct figure.
"""

import functools
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from gemma_spec_ros.benchmarks.harness import WARM_UP_TOKENS, Settings, load_engine
from gemma_spec_ros.benchmarks.prompts import Prompt, take_per_category
from gemma_spec_ros.benchmarks.report import machine_description, write_json
from gemma_spec_ros.benchmarks.systems import EngineRunner, System
from gemma_spec_ros.engine.decoding import rounds as round_steps
from gemma_spec_ros.engine.drafters import base as drafter_base
from gemma_spec_ros.engine.logits.grammar import MAX_JSON_WHITESPACE, GrammarConstraint, Lookahead
from gemma_spec_ros.engine.stats import tau, tokens_per_second
from gemma_spec_ros.engine.types import GenerationRequest

SCHEMA = 'gemma_spec_ros.bench.constrained/1'  # the results' format name (kept when the package was renamed)
DEFAULT_SPEC = 'bench/constrained.json'
CATEGORY = 'constrained'
GOAL_OVERHEAD = 0.10    # time per token with the schema vs without, at the same tau
# the constraint's calls during a generation: the matcher (Lookahead.mask goes through next_mask) and the masking
_TIMED = ((GrammarConstraint, ('next_mask', 'masks_along', 'allowed_prefix_len', 'accept')), (Lookahead, ('push',)),
          (round_steps, ('mask_logits',)), (drafter_base, ('mask_logits',)))


@dataclass
class ConstrainedSpec:
    json_schema: str        # JSON text
    prompts: list[Prompt]


@dataclass
class Sample:
    """One timed generation."""

    system: str
    constrained: bool
    prompt_id: str
    repeat: int
    new_tokens: int
    target_passes: int
    decode_s: float
    decode_cpu_s: float
    grammar_s: float            # CPU seconds in the constraint's calls
    structure_complete: bool


@dataclass
class Side:
    """One system without or with the schema: medians over repeats."""

    tau: float
    tokens_per_s: float         # wall clock
    round_ms: float             # decode CPU seconds per decode target pass
    round_wall_ms: float
    grammar_us_per_token: float  # CPU
    grammar_share: float        # grammar CPU time / the rest of the decode CPU time
    complete: float             # share of outputs that completed the schema


@dataclass
class Cell:
    system: str
    drafter: str
    k: int
    unconstrained: Side
    constrained: Side
    overhead: float             # constrained.grammar_share: time per token added at the same tau
    end_to_end: float           # round_ms constrained / unconstrained - 1 (separate runs: noisy on shared cores)
    met: bool                   # overhead <= GOAL_OVERHEAD


class GrammarClock:
    """Adds up the CPU seconds spent in the constraint's calls while `timing()` is active (this thread)."""

    def __init__(self):
        self.seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator['GrammarClock']:
        originals = [(owner, name, getattr(owner, name)) for owner, names in _TIMED for name in names]
        for owner, name, method in originals:
            setattr(owner, name, self._timed(method))
        try:
            yield self
        finally:
            for owner, name, method in originals:
                setattr(owner, name, method)

    def _timed(self, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start
        return timed


def load_spec(path: str) -> ConstrainedSpec:
    """Read {"json_schema": {...}, "prompts": [{"id", "prompt"}, ...]}; ValueError naming the file and the problem."""
    try:
        document = json.loads(Path(path).read_text(encoding='utf-8'))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError('{}: {}'.format(path, error)) from None
    if not (isinstance(document, dict) and isinstance(document.get('json_schema'), dict)
            and isinstance(document.get('prompts'), list) and document['prompts']):
        raise ValueError('{}: expected {{"json_schema": {{...}}, "prompts": [{{"id": ..., "prompt": ...}}, ...]}}'
                         .format(path))
    prompts = []
    for index, item in enumerate(document['prompts']):
        if not isinstance(item, dict) or not isinstance(item.get('prompt'), str) or not item['prompt']:
            raise ValueError('{}: prompts[{}] needs a non-empty "prompt"'.format(path, index))
        prompts.append(Prompt(str(item.get('id') or 'prompt{}'.format(index)), CATEGORY, item['prompt']))
    return ConstrainedSpec(json.dumps(document['json_schema']), prompts)


def measure(engine, settings: Settings, spec: ConstrainedSpec, prompts: list[Prompt],
            on_step: Callable[[str], None], json_free_whitespace: bool = False) -> list[Sample]:
    """Run every system with and without the schema on every prompt, `repeats` times, after one warm-up each."""
    systems = [System('ours', 'none')] + [System('ours', d, k) for d in settings.drafters for k in settings.ks]
    runners = {(system.name, constrained): EngineRunner(engine, system.drafter, system.k or 0,
                                                        spec.json_schema if constrained else '',
                                                        json_free_whitespace and constrained)
               for system in systems for constrained in (False, True)}
    encoded = {prompt.id: engine.tokenizer(prompt.text).input_ids for prompt in prompts}
    # without the schema a system generates as many tokens as with it (greedy: the same count for every system), so
    # both sides decode at the same context lengths
    with_schema = runners['ours/none', True]
    lengths = {prompt.id: max(2, len(with_schema(encoded[prompt.id], settings.max_new_tokens).token_ids))
               for prompt in prompts}
    for (name, _), runner in runners.items():  # warm-up: one-time initialization and the compile cache
        runner(encoded[prompts[0].id], min(WARM_UP_TOKENS, settings.max_new_tokens))
        on_step(name)
    order = random.Random(settings.seed)
    clock = GrammarClock()
    samples = []
    with clock.timing():
        for repeat in range(settings.repeats):
            for prompt in prompts:
                keys = list(runners)
                order.shuffle(keys)
                for name, constrained in keys:
                    clock.seconds = 0.0
                    max_new = settings.max_new_tokens if constrained else lengths[prompt.id]
                    outcome = runners[name, constrained](encoded[prompt.id], max_new)
                    samples.append(Sample(name, constrained, prompt.id, repeat, len(outcome.token_ids),
                                          outcome.target_passes, outcome.decode_s, outcome.decode_cpu_s,
                                          clock.seconds, outcome.structure_complete))
                    on_step(name)
    return samples


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def side(samples: list[Sample]) -> Side:
    """Medians over repeats of the sums over prompts (decode only: the prefill pass and first token excluded)."""
    per_repeat = []
    for repeat in sorted({s.repeat for s in samples}):
        chosen = [s for s in samples if s.repeat == repeat]
        tokens = sum(max(0, s.new_tokens - 1) for s in chosen)
        passes = sum(max(0, s.target_passes - 1) for s in chosen)
        pooled = tau([s.new_tokens for s in chosen], [s.target_passes for s in chosen])
        seconds, cpu_seconds = sum(s.decode_s for s in chosen), sum(s.decode_cpu_s for s in chosen)
        grammar = sum(s.grammar_s for s in chosen)
        per_repeat.append((pooled, tokens_per_second(tokens, seconds), 1e3 * _ratio(cpu_seconds, passes),
                           1e3 * _ratio(seconds, passes), 1e6 * _ratio(grammar, tokens),
                           _ratio(grammar, cpu_seconds - grammar)))
    medians = (statistics.median(values) for values in zip(*per_repeat, strict=True))
    return Side(*medians, complete=sum(s.structure_complete for s in samples) / len(samples))


def summarize(settings: Settings, samples: list[Sample]) -> list[Cell]:
    cells = []
    systems = [System('ours', 'none')] + [System('ours', d, k) for d in settings.drafters for k in settings.ks]
    for system in systems:
        without = side([s for s in samples if s.system == system.name and not s.constrained])
        with_schema = side([s for s in samples if s.system == system.name and s.constrained])
        end_to_end = _ratio(with_schema.round_ms, without.round_ms) - 1.0
        cells.append(Cell(system.name, system.drafter, system.k or 0, without, with_schema, with_schema.grammar_share,
                          end_to_end, with_schema.grammar_share <= GOAL_OVERHEAD))
    return cells


def per_prompt(samples: list[Sample]) -> list[dict]:
    """Per prompt, over every system and repeat with the schema: median tokens used and the share that completed."""
    outcomes = []
    for prompt_id in dict.fromkeys(s.prompt_id for s in samples):
        chosen = [s for s in samples if s.prompt_id == prompt_id and s.constrained]
        outcomes.append({'prompt': prompt_id, 'new_tokens': statistics.median(s.new_tokens for s in chosen),
                         'complete': sum(s.structure_complete for s in chosen) / len(chosen)})
    return outcomes


def markdown(document: dict, cells: list[Cell]) -> str:
    settings, machine = document['settings'], document['machine']
    whitespace = ('free whitespace (up to {} characters between elements)'.format(MAX_JSON_WHITESPACE)
                  if document['json_free_whitespace'] else 'compact JSON')
    lines = ['# Constrained category', '', 'Command: `{}`'.format(document['command']), '',
             'Machine: {} ({} cores, torch threads {}); load average at start {}, at end {}. Started {}, took {:.0f} s.'
             .format(machine['cpu_model'], machine['cores'], machine['torch_threads'],
                     '/'.join('{:.2f}'.format(v) for v in machine['load_average']),
                     '/'.join('{:.2f}'.format(v) for v in document['load_average_end']), document['created_utc'],
                     document['duration_s']), '',
             'Settings: {} prompts of `{}`, max_new_tokens {}, repeats {}, greedy, fixed K; every system ran with '
             'and without the JSON Schema (output: {}; without it generating as many tokens as with it), '
             'interleaved in a shuffled order per prompt and repeat.'.format(
                 len(document['prompts']), document['spec'], settings['max_new_tokens'], settings['repeats'],
                 whitespace), '',
             '| Prompt | tokens used with the schema (median) | complete |', '|---|---|---|',
             *('| {} | {:g} | {:.0f}% |'.format(o['prompt'], o['new_tokens'], 100 * o['complete'])
               for o in document['per_prompt']), '',
             'tau: decode tokens per decode target pass. tok/s: wall clock. Round: decode CPU ms of the '
             'generating thread per target pass. Grammar: CPU time of the constraint (matcher calls and masking the '
             'logits) per decode token. Overhead at the same tau: that time over the rest of the same runs\' '
             'decode time (goal <= {:.0f}%). End-to-end: round with / round without - 1 from separate runs (on '
             'shared cores it moves by 10-30% between repeats). Complete: share of constrained outputs that '
             'completed the schema.'.format(
                 100 * GOAL_OVERHEAD), '',
             '| System | K | tau without → with | tok/s without → with | round CPU ms without → with | '
             'grammar us/token | overhead at same tau | end-to-end | complete | goal |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for cell in cells:
        u, c = cell.unconstrained, cell.constrained
        lines.append('| {} | {} | {:.2f} → {:.2f} | {:.1f} → {:.1f} | {:.2f} → {:.2f} | {:.0f} | {:.1f}% | {:+.1f}% | '
                     '{:.0f}% | {} |'.format(cell.system, cell.k or '–', u.tau, c.tau, u.tokens_per_s,
                                             c.tokens_per_s, u.round_ms, c.round_ms, c.grammar_us_per_token,
                                             100 * cell.overhead, 100 * cell.end_to_end, 100 * c.complete,
                                             'met' if cell.met else '**not met**'))
    return '\n'.join(lines) + '\n'


def run(settings: Settings, spec_path: str, per_category: int, out: Path, command: str,
        progress: Callable[[str], None], on_step: Callable[[str], None], json_free_whitespace: bool = False) -> None:
    """Measure the constrained category; write results.json and results.md under out."""
    started, machine = time.time(), machine_description(settings.threads)
    spec = load_spec(spec_path)
    prompts = take_per_category(spec.prompts, per_category)
    if len(settings.compile_modes) != 1:
        raise ValueError('--constrained measures one compile mode, got {}'.format(','.join(settings.compile_modes)))
    engine = load_engine(settings, progress, settings.compile_modes[0])
    engine.validate(GenerationRequest(prompt_ids=[1], max_new_tokens=1, json_schema=spec.json_schema,  # fail early
                                      json_free_whitespace=json_free_whitespace))
    samples = measure(engine, settings, spec, prompts, on_step, json_free_whitespace)
    cells = summarize(settings, samples)
    document = {
        'schema': SCHEMA, 'created_utc': datetime.fromtimestamp(started, UTC).strftime('%Y-%m-%dT%H:%M:%SZ'),
        'duration_s': time.time() - started, 'command': command, 'machine': machine,
        'load_average_end': list(machine_description(settings.threads)['load_average']),
        'settings': asdict(settings), 'spec': spec_path, 'json_schema': json.loads(spec.json_schema),
        'json_free_whitespace': json_free_whitespace,
        'prompts': [{'id': p.id, 'prompt_tokens': len(engine.tokenizer(p.text).input_ids)} for p in prompts],
        'goal_overhead': GOAL_OVERHEAD, 'per_prompt': per_prompt(samples), 'cells': cells, 'samples': samples,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / 'results.json', document)
    (out / 'results.md').write_text(markdown(document, cells))
