"""The stress tool's figures: the RSS trend after the warm-up (its graphs must not read as a leak), fair shares."""

from gemma_spec_ros.tools.stress import AFTER_WARMUP_SETTLE, ClientTally, RssTrend, fair_shares


class _Silent:
    """A DiagnosticsListener that has heard nothing: the samples are set by the test."""

    def latest(self):
        return {}


def _trend(samples, warm_at):
    trend = RssTrend(_Silent(), 'gemma_spec')
    trend.stop()
    trend.samples, trend.warm_at = samples, warm_at
    return trend


def test_the_warm_up_ramp_counts_in_the_whole_run_trend_only():
    # 800 -> 1200 MiB while 60 graphs are adopted (10 min), then flat for 20 min
    samples = [(float(t), 800.0 + 400.0 * min(t, 600) / 600) for t in range(0, 1800, 5)]
    trend = _trend(samples, warm_at=600.0)
    assert trend.slope_mib_per_minute() > 10.0
    assert trend.slope_mib_per_minute(since=600.0 + AFTER_WARMUP_SETTLE) == 0.0
    said = trend.after_warmup()
    assert said.startswith('from {:.1f} min (warm-up done after 10.0 min): 1200.0 -> 1200.0 MiB, trend +0.000 '
                           'MiB/min'.format((600.0 + AFTER_WARMUP_SETTLE) / 60.0)), said


def test_growth_after_the_warm_up_shows():
    samples = [(float(t), 1000.0 + t / 60.0) for t in range(0, 1200, 5)]   # +1 MiB/min all along
    said = _trend(samples, warm_at=0.0).after_warmup()
    assert 'trend +1.000 MiB/min' in said, said


def test_no_trend_after_a_warm_up_that_did_not_end_or_ended_too_late():
    samples = [(float(t), 1000.0) for t in range(0, 600, 5)]
    assert _trend(samples, warm_at=None).after_warmup().startswith('none: the warm-up was not done')
    assert 'too late' in _trend(samples, warm_at=500.0).after_warmup()   # 40 s of samples after it


def test_fair_shares_count_each_clients_goals_among_the_first_half_served():
    # client 0 served at 0, 1, 2, 3; client 1 at 10, 11; client 2 at 4, 5: the first half is 0, 1, 2, 3
    tallies = [ClientTally(served_at=[0.0, 1.0, 2.0, 3.0]), ClientTally(served_at=[10.0, 11.0]),
               ClientTally(served_at=[4.0, 5.0])]
    assert fair_shares(tallies) == ([4, 0, 0], 4 / 3)
