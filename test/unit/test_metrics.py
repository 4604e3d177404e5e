"""The definitions in gemma_spec_ros.engine.stats, one test each, the undefined cases included (pure functions)."""

import math
import subprocess
import sys

import pytest

from gemma_spec_ros.engine import stats
from gemma_spec_ros.engine.types import GenerationStats


def test_tau_is_tokens_per_decode_pass_leaving_the_prefill_pass_out():
    assert stats.tau(10, 4) == 3.0            # prefill pass + 3 rounds: the 3 rounds emitted 9 tokens
    assert stats.tau(7, 7) == 1.0             # plain decoding
    assert math.isnan(stats.tau(1, 1))        # the prefill pass alone: no decode round
    assert math.isnan(stats.tau(0, 0))        # no target pass: no data
    assert stats.tau(20, 8, generations=2) == pytest.approx(18 / 6)   # sums of 2 generations: 2 prefill passes out


def test_acceptance_rate_is_accepted_over_drafted():
    assert stats.acceptance_rate(3, 4) == 0.75
    assert stats.acceptance_rate(0, 4) == 0.0  # drafted and all rejected: a measurement, not missing data
    assert math.isnan(stats.acceptance_rate(0, 0))


def test_tokens_per_second():
    assert stats.tokens_per_second(30, 1.5) == 20.0
    assert math.isnan(stats.tokens_per_second(0, 0.0))
    assert math.isnan(stats.tokens_per_second(5, -1.0))


def test_decode_tokens_per_second_starts_after_the_first_arrival():
    assert stats.decode_tokens_per_second([(1.0, 1), (1.5, 3), (2.0, 2)]) == 5.0
    assert stats.decode_tokens_per_second([(0.0, 3), (1.0, 2)]) == 2.0     # a first chunk of 3 tokens
    assert stats.decode_tokens_per_second([(1.0, 1), (2.0, 4)], total_tokens=3) == 2.0  # the round was cut to 2
    assert math.isnan(stats.decode_tokens_per_second([]))
    assert math.isnan(stats.decode_tokens_per_second([(1.0, 1)]))              # one token: no decode time


def test_percentile_interpolates_and_is_undefined_without_values():
    assert stats.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert stats.percentile([0.0, 1.0], 95) == pytest.approx(0.95)
    assert stats.percentile([4.0], 95) == 4.0
    assert math.isnan(stats.percentile([], 50))


def test_token_gaps_share_a_round_over_its_tokens():
    assert stats.token_gaps([(0.0, 1), (0.3, 3)]) == pytest.approx([0.1, 0.1, 0.1])
    assert stats.token_gaps([(0.0, 1)]) == []


def test_mib():
    assert stats.mib(3 * 2 ** 20) == 3.0 and stats.MIB == 2 ** 20
    assert stats.mib(512 * 1024) == 0.5


def test_undefined_figures_show_a_dash():
    assert stats.format_figure(math.nan) == stats.NO_DATA == '-'
    assert stats.format_figure(-1) == '-'          # a server backend's unknown count
    assert stats.format_figure(None) == '-'
    assert stats.format_figure(0.0) == '0.000' and stats.format_figure(2.25, '{:.1f}') == '2.2'
    assert stats.is_known(0) and not stats.is_known(math.nan)


def test_generation_stats_use_the_definitions():
    tally = stats.RoundTally()
    tally.add_prefill(1.0)
    tally.add_round(4, 2, 1.5)       # 3 tokens
    tally.add_round(4, 4, 2.0)       # 5 tokens, the last 2 cut by max_new_tokens
    result = stats.generation_stats(tally, prompt_tokens=5, new_tokens=7, started=0.5, finished=2.1,
                                    drafter='mtp', draft_cost_ratio=0.1)
    assert result.tau == stats.tau(7, 3) and result.acceptance_rate == stats.acceptance_rate(6, 8)
    assert result.tokens_per_second == pytest.approx(6 / 1.0) and result.time_to_first_token == 0.5
    plain = stats.RoundTally()
    plain.add_prefill(1.0)
    alone = stats.generation_stats(plain, 5, 1, 0.5, 1.1, 'none', 0.0)
    assert all(math.isnan(value) for value in (alone.tau, alone.acceptance_rate, alone.tokens_per_second,
                                               alone.inter_token_latency_p50, alone.inter_token_latency_p95))
    assert 'acceptance -' in stats.format_stats(alone) and 'decode - tok/s' in stats.format_stats(alone)


def test_format_stats_reads_the_message_fields():
    text = stats.format_stats(GenerationStats(new_tokens=10, tau=2.5, acceptance_rate=0.5, tokens_per_second=40.0,
                                              process_peak_rss_bytes=300 * 2 ** 20))
    assert 'tau 2.50' in text and 'acceptance 0.50' in text and 'decode 40.0 tok/s' in text and '300 MiB' in text


def test_the_module_imports_without_torch():
    code = 'import sys, gemma_spec_ros.engine.stats; sys.exit("torch" in sys.modules)'
    assert subprocess.run([sys.executable, '-c', code], check=False).returncode == 0


def test_tau_pools_generations_each_without_its_prefill_pass():
    assert stats.tau([10, 1], [4, 1]) == 3.0        # a one-token generation adds no decode pass
    assert stats.tau([10, 5], [4, 5]) == pytest.approx((9 + 4) / (3 + 4))
    assert stats.tau([10, 5], [4, 5]) == stats.tau(15, 9, generations=2)
    assert math.isnan(stats.tau([], []))


def test_drafter_evaluation_pools_with_the_same_definitions():
    from gemma_spec_ros.train.evaluate import RunFigures, format_cell

    figures = RunFigures()
    for new_tokens, passes, drafted, accepted in ((11, 4, 12, 7), (5, 2, 4, 3)):
        figures.add(GenerationStats(new_tokens=new_tokens, target_passes=passes, drafted_tokens=drafted,
                                    accepted_tokens=accepted, tau=new_tokens / passes, wall_time=1.5,
                                    time_to_first_token=0.5), True)
    cell = figures.summary(plain_seconds=4.0)
    assert cell['tau'] == round(stats.tau([11, 5], [4, 2]), 3) and cell['acceptance'] == round(10 / 16, 3)
    assert cell['tokens_per_s'] == stats.tokens_per_second(10 + 4, 2.0)   # the first tokens are not decode tokens
    plain = RunFigures()
    plain.add(GenerationStats(new_tokens=8, target_passes=8, tau=1.0, wall_time=1.0, time_to_first_token=0.2), True)
    plain_cell = plain.summary(plain_seconds=0.8)
    assert math.isnan(plain_cell['acceptance']) and format_cell(plain_cell) == '1.00 / - / 1.00x'


def test_slope_is_the_least_squares_trend():
    assert stats.slope([0, 1, 2, 3], [10.0, 12.0, 14.0, 16.0]) == pytest.approx(2.0)
    assert stats.slope(range(3), [5.0, 4.0, 6.0]) == pytest.approx(0.5)
    assert math.isnan(stats.slope([1], [3.0])) and math.isnan(stats.slope([2, 2], [1.0, 3.0]))
