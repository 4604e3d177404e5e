"""
From measurements to per-system, per-category figures, the Leviathan prediction, the goals and the peer ratios.

Figures are engine.stats' definitions: tau is tokens per decode pass, (new_tokens - 1) / (target_passes - 1), as in
GenerationStats and /diagnostics; decode tok/s and the Leviathan prediction start after the prefill pass too.
"""

import statistics
from dataclasses import dataclass, field

from gemma_spec_ros.benchmarks.decode.probe import CostProbe
from gemma_spec_ros.benchmarks.harness import Measurement
from gemma_spec_ros.benchmarks.systems import System
from gemma_spec_ros.engine.stats import acceptance_rate, iid_expected_tokens, mib, tau, tokens_per_second

ALL = 'all'
GOAL_PLAIN = 1.2        # our plain decoding vs transformers' plain generate
GOAL_ASSISTED = 1.5     # our best system per drafter vs transformers' best with the same drafter
GOAL_EFFICIENCY = 0.9   # measured / predicted speedup
TRANSFORMERS = ('hf', 'hf-static')  # transformers' generate, eager and static+compile


@dataclass
class Cell:
    """One system on one category (or ALL prompts)."""

    system: str
    family: str
    drafter: str
    k: int | None
    category: str
    samples: int
    tokens_per_s: float              # median over repeats of sum(decode tokens) / sum(decode seconds)
    tokens_per_s_min: float
    tokens_per_s_max: float
    speedup_vs_ours_plain: float     # ours: vs plain decoding in the same compile mode; peers: vs Summary.ours_plain
    speedup_vs_hf_plain: float
    tau: float                # tokens per decode pass (engine.stats.tau); NaN: no decode pass
    acceptance_rate: float           # accepted / drafted; NaN: nothing drafted
    mean_k: float                    # drafted tokens per decode round
    ttft_ms: float                   # median
    peak_rss_mib: float              # max over samples
    rss_growth_mib: float            # max over samples
    parity: bool
    mismatches: list[str]            # 'prompt_id#repeat@position'
    warnings: list[str]
    alpha: float | None = None       # i.i.d. acceptance fitted to per-position acceptance (our engine only)
    draft_cost_ratio: float | None = None
    predicted_tau: float | None = None
    predicted_speedup: float | None = None
    tau_cost_speedup: float | None = None  # measured tau / predicted round cost: without the i.i.d. part
    efficiency: float | None = None  # speedup_vs_ours_plain / predicted_speedup
    loop_efficiency: float | None = None  # speedup_vs_ours_plain / tau_cost_speedup


@dataclass
class Goal:
    name: str
    threshold: float
    value: float | None
    met: bool
    detail: str


@dataclass
class Ratio:
    """One peer comparison: tok/s of a numerator system over a denominator system (all prompts)."""

    name: str
    numerator: str                   # system name, '' when not measured
    denominator: str
    value: float | None              # None when a side was not measured


@dataclass
class AdaptiveRow:
    """Adaptive K against the fixed K best in hindsight, for one of our drafters on one category (or the mean)."""

    system: str                      # ours/<drafter>/adaptive (or another compile mode's)
    category: str                    # a category, or 'mean' over categories
    best_k: int
    best_speedup: float              # vs our plain decoding in the same compile mode
    adaptive_speedup: float
    paused_rounds: int               # rounds the profit gate ran plain (sum over samples)
    repeat_ratios: list[float] = field(default_factory=list)  # per repeat: adaptive tok/s over best_k's (categories)

    @property
    def ratio(self) -> float:
        return _ratio(self.adaptive_speedup, self.best_speedup)


@dataclass
class Summary:
    cells: list[Cell]
    goals: list[Goal]
    parity_failures: list[str] = field(default_factory=list)
    ours_plain: str = 'ours/none'    # plain decoding of the first compile mode: "our plain"
    ratios: list[Ratio] = field(default_factory=list)
    adaptive: list[AdaptiveRow] = field(default_factory=list)  # adaptive K against the best fixed K (ours)

    def cell(self, system: str, category: str = ALL) -> Cell | None:
        return next((c for c in self.cells if c.system == system and c.category == category), None)


def adaptive_against_fixed(summary: Summary, systems: list[System], measurements: list[Measurement],
                           categories: list[str]) -> list[AdaptiveRow]:
    """
    Return, per adaptive system of ours and category, the best fixed K of its drafter and mode, and a 'mean' row.

    The mean row compares adaptive's mean speedup over categories with the single fixed K best on average. A
    category row also holds the ratio within each repeat (that repeat's prompts, interleaved), whose spread shows
    how far the machine's noise reaches.
    """
    rows = []
    for adaptive in (s for s in systems if s.family == 'ours' and s.drafter != 'none' and s.k == 0):
        fixed = [s for s in systems if s.family == 'ours' and s.drafter == adaptive.drafter and
                 s.compile == adaptive.compile and s.k]
        if not fixed:
            continue

        def speedup(system: System, category: str) -> float:
            cell = summary.cell(system.name, category)
            return cell.speedup_vs_ours_plain if cell is not None else 0.0

        for category in categories:
            best = max(fixed, key=lambda s, category=category: speedup(s, category))
            paused = sum(m.paused_rounds for m in measurements if m.system == adaptive.name and
                         m.category == category)
            rows.append(AdaptiveRow(adaptive.name, category, best.k, speedup(best, category),
                                    speedup(adaptive, category), paused,
                                    _repeat_ratios(measurements, adaptive.name, best.name, category)))
        best = max(fixed, key=lambda s: statistics.mean(speedup(s, c) for c in categories))
        rows.append(AdaptiveRow(adaptive.name, 'mean', best.k, statistics.mean(speedup(best, c) for c in categories),
                                statistics.mean(speedup(adaptive, c) for c in categories),
                                sum(r.paused_rounds for r in rows if r.system == adaptive.name)))
    return rows


def _repeat_ratios(measurements: list[Measurement], system: str, other: str, category: str) -> list[float]:
    """Per repeat, system's decode tok/s over other's on the category's prompts (repeats both ran, in order)."""
    def rates(name: str) -> dict[int, float]:
        by_repeat: dict[int, list[Measurement]] = {}
        for sample in measurements:
            if sample.system == name and sample.category == category:
                by_repeat.setdefault(sample.repeat, []).append(sample)
        return {repeat: _rate(samples) for repeat, samples in by_repeat.items()}

    mine, theirs = rates(system), rates(other)
    return [_ratio(mine[repeat], theirs[repeat]) for repeat in sorted(mine.keys() & theirs.keys())]


def fit_alpha(samples: list[Measurement]) -> float | None:
    """
    Pooled per-position estimate: accepted at position i over rounds that reached position i.

    The engine reports p_i = P(position i accepted | position i drafted); under the i.i.d. model p_i = alpha^i,
    so alpha = sum_i p_i / sum_i p_(i-1) with p_0 = 1, each sample weighted by its decode rounds.
    """
    accepted = reached = 0.0
    for sample in samples:
        p = sample.per_position_acceptance
        rounds = max(0, sample.target_passes - 1)
        if p and rounds:
            accepted += rounds * sum(p)
            reached += rounds * (1.0 + sum(p[:-1]))
    return accepted / reached if reached else None


def round_cost(rounds_by_draft_length: list[int], cost_ratio: float, probe: CostProbe,
               compile_mode: str = '') -> float:
    """
    Mean cost of a decode round in 1-token target passes: k * c + v(k + 1) for a round that drafted k (plain: 1).

    rounds_by_draft_length[k]: rounds that drafted k tokens. v is our engine's curve in compile_mode when given
    (else transformers' forward's).
    """
    total = sum(count * (k * cost_ratio + probe.verify_cost_at(k + 1, compile_mode))
                for k, count in enumerate(rounds_by_draft_length))
    return total / sum(rounds_by_draft_length)


def predict_speedup(alpha: float, rounds_by_draft_length: list[int], cost_ratio: float, probe: CostProbe,
                    compile_mode: str = '') -> tuple[float, float]:
    """
    Predict (tau, speedup) per decode round from the rounds' draft lengths (K varies: adaptive K, short n-grams).

    A round that drafted k yields E(alpha, k) tokens (a plain round 1); speedup = tokens per round / round_cost.
    Taking E at the mean K instead would over-predict: E is concave in k.
    """
    tokens = sum(count * iid_expected_tokens(alpha, k) for k, count in enumerate(rounds_by_draft_length))
    tokens /= sum(rounds_by_draft_length)
    return tokens, tokens / round_cost(rounds_by_draft_length, cost_ratio, probe, compile_mode)


def _draft_lengths(samples: list[Measurement]) -> list[int]:
    """Return the decode rounds by draft length, summed over samples ([] when none reports them)."""
    counts: list[int] = []
    for sample in samples:
        counts += [0] * (len(sample.rounds_by_draft_length) - len(counts))
        for k, count in enumerate(sample.rounds_by_draft_length):
            counts[k] += count
    return counts


def _rate(samples: list[Measurement]) -> float:
    return tokens_per_second(sum(max(0, s.new_tokens - 1) for s in samples), sum(s.decode_s for s in samples))


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def _cell(system: System, category: str, samples: list[Measurement], probe: CostProbe) -> Cell:
    by_repeat: dict[int, list[Measurement]] = {}
    for sample in samples:
        by_repeat.setdefault(sample.repeat, []).append(sample)
    rates = [_rate(group) for group in by_repeat.values()]
    decode_passes = sum(max(0, s.target_passes - 1) for s in samples)
    drafted = sum(s.drafted_tokens for s in samples)
    warnings = sorted({w for s in samples for w in s.warnings})
    cell = Cell(
        system=system.name, family=system.family, drafter=system.drafter, k=system.k, category=category,
        samples=len(samples), tokens_per_s=statistics.median(rates), tokens_per_s_min=min(rates),
        tokens_per_s_max=max(rates), speedup_vs_ours_plain=0.0, speedup_vs_hf_plain=0.0,
        tau=tau([s.new_tokens for s in samples], [s.target_passes for s in samples]),
        acceptance_rate=acceptance_rate(sum(s.accepted_tokens for s in samples), drafted),
        mean_k=_ratio(drafted, decode_passes), ttft_ms=statistics.median(s.ttft_s for s in samples) * 1000.0,
        peak_rss_mib=mib(max(s.peak_rss_bytes for s in samples)),
        rss_growth_mib=mib(max(s.rss_growth_bytes for s in samples)),
        parity=all(s.parity for s in samples),
        mismatches=['{}#{}@{}'.format(s.prompt_id, s.repeat, s.first_mismatch) for s in samples if not s.parity],
        warnings=warnings)
    if system.drafter == 'none':
        return cell
    if system.family != 'ours':
        cell.draft_cost_ratio = probe.draft_cost_ratio[system.drafter]
        return cell
    engine_costs = [s.draft_cost_ratio for s in samples if s.draft_cost_ratio > 0]
    cell.draft_cost_ratio = statistics.median(engine_costs) if engine_costs else probe.draft_cost_ratio[
        system.drafter]
    cell.alpha = fit_alpha(samples)
    draft_lengths = _draft_lengths(samples)
    if cell.alpha is not None and sum(draft_lengths):
        mode = system.compile or 'auto'  # our verify passes cost what our decode steps cost
        cell.predicted_tau, cell.predicted_speedup = predict_speedup(cell.alpha, draft_lengths,
                                                                     cell.draft_cost_ratio, probe, mode)
        cell.tau_cost_speedup = cell.tau / round_cost(draft_lengths, cell.draft_cost_ratio, probe, mode)
    return cell


def summarize(systems: list[System], measurements: list[Measurement], categories: list[str],
              probe: CostProbe) -> Summary:
    cells = []
    for category in [ALL] + categories:
        for system in systems:
            samples = [m for m in measurements if m.system == system.name and category in (ALL, m.category)]
            if samples:
                cells.append(_cell(system, category, samples, probe))
    ours_plain = next(s.name for s in systems if s.family == 'ours' and s.drafter == 'none')
    plain_of = {s.name: System(s.family, 'none', compile=s.compile).name if s.family == 'ours' else ours_plain
                for s in systems}
    by_key = {(c.system, c.category): c for c in cells}
    for cell in cells:
        ours = by_key[plain_of[cell.system], cell.category]
        hf = by_key['hf/none', cell.category]
        cell.speedup_vs_ours_plain = _ratio(cell.tokens_per_s, ours.tokens_per_s)
        cell.speedup_vs_hf_plain = _ratio(cell.tokens_per_s, hf.tokens_per_s)
        if cell.predicted_speedup:
            cell.efficiency = cell.speedup_vs_ours_plain / cell.predicted_speedup
            cell.loop_efficiency = cell.speedup_vs_ours_plain / cell.tau_cost_speedup
    failures = sorted({'{}: {}'.format(c.system, ', '.join(c.mismatches)) for c in cells
                       if c.category == ALL and not c.parity})
    summary = Summary(cells, [], failures, ours_plain)
    summary.goals = _goals(summary, systems)
    summary.ratios = peer_ratios(summary, systems)
    summary.adaptive = adaptive_against_fixed(summary, systems, measurements, categories)
    return summary


def _best(summary: Summary, systems: list[System], families: tuple[str, ...], drafter: str | None) -> Cell | None:
    """Return the fastest system (all prompts) of these families with this drafter (None: any speculative one)."""
    cells = [summary.cell(s.name) for s in systems if s.family in families and (
        s.drafter == drafter if drafter else s.drafter != 'none')]
    cells = [c for c in cells if c is not None]
    return max(cells, key=lambda c: c.tokens_per_s) if cells else None


def _compare(summary: Summary, name: str, numerator: Cell | str | None, denominator: Cell | str | None) -> Ratio:
    top, bottom = (summary.cell(side) if isinstance(side, str) else side for side in (numerator, denominator))
    value = _ratio(top.tokens_per_s, bottom.tokens_per_s) if top and bottom else None
    return Ratio(name, top.system if top else '', bottom.system if bottom else '', value)


def peer_ratios(summary: Summary, systems: list[System]) -> list[Ratio]:
    """
    Compare tok/s on all prompts as the goals ask.

    Our plain vs each peer's plain; our best speculative vs vLLM's best speculative, vs transformers' best with the
    same drafter (eager or static) and vs our plain.
    """
    ours = summary.ours_plain
    ratios = [_compare(summary, 'our plain vs {} plain'.format(label), ours, '{}/none'.format(family))
              for family, label in (('hf', 'transformers eager'), ('hf-static', 'transformers static+compile'),
                                    ('vllm', 'vLLM'))]
    ratios += [_compare(summary, '{} plain vs our plain'.format(s.prefix), s.name, ours)
               for s in systems if s.family == 'ours' and s.drafter == 'none' and s.name != ours]
    best = _best(summary, systems, ('ours',), None)
    ratios.append(_compare(summary, "our best speculative vs vLLM's best speculative", best,
                           _best(summary, systems, ('vllm',), None)))
    ratios.append(_compare(summary, "our best speculative vs transformers' best with the same drafter", best,
                           best and _best(summary, systems, TRANSFORMERS, best.drafter)))
    ratios.append(_compare(summary, 'our best speculative vs our plain', best, ours))
    return ratios


def _goals(summary: Summary, systems: list[System]) -> list[Goal]:
    goals = []
    ours_plain, hf_plain = summary.cell(summary.ours_plain), summary.cell('hf/none')
    if ours_plain and hf_plain:
        value = _ratio(ours_plain.tokens_per_s, hf_plain.tokens_per_s)
        goals.append(Goal('our plain decoding vs transformers plain generate', GOAL_PLAIN, value,
                          value >= GOAL_PLAIN, '{:.1f} vs {:.1f} tok/s'.format(ours_plain.tokens_per_s,
                                                                               hf_plain.tokens_per_s)))
    drafters = list(dict.fromkeys(s.drafter for s in systems if s.drafter != 'none'))
    for drafter in drafters:
        ours, hf = _best(summary, systems, ('ours',), drafter), _best(summary, systems, TRANSFORMERS, drafter)
        if ours is None or hf is None:
            continue
        adaptive = summary.cell('{}/{}/adaptive'.format(summary.ours_plain.split('/')[0], drafter))
        value = _ratio(ours.tokens_per_s, hf.tokens_per_s)
        detail = '{} {:.1f} vs {} {:.1f} tok/s'.format(ours.system, ours.tokens_per_s, hf.system, hf.tokens_per_s)
        if adaptive is not None:
            detail += '; adaptive {:.2f}x'.format(_ratio(adaptive.tokens_per_s, hf.tokens_per_s))
        goals.append(Goal('our best {} vs transformers best {}'.format(drafter, drafter), GOAL_ASSISTED, value,
                          value >= GOAL_ASSISTED, detail))
    speculative = [c for c in summary.cells if c.category == ALL and c.family == 'ours' and c.efficiency]
    if speculative:
        fastest = max(speculative, key=lambda c: c.tokens_per_s)
        goals.append(Goal('efficiency of our fastest speculative system (measured / predicted speedup)',
                          GOAL_EFFICIENCY, fastest.efficiency, fastest.efficiency >= GOAL_EFFICIENCY,
                          '{}: measured {:.2f}x, predicted {:.2f}x'.format(
                              fastest.system, fastest.speedup_vs_ours_plain, fastest.predicted_speedup)))
    return goals
