"""The llama.cpp bench's main-venv side on fixed inputs: rows, ratios, interleaving and the MTP probe's verdict."""

import math

import pytest

from gemma_spec_ros.benchmarks.harness import Measurement, Skipped
from gemma_spec_ros.benchmarks.peers import llamacpp as llamacpp_peers
from gemma_spec_ros.benchmarks.prompts import Prompt
from gemma_spec_ros.benchmarks.systems import Outcome


def measurement(system, prompt_id='p', repeat=0, new_tokens=11, decode_s=0.1, passes=11, drafted=0, accepted=0,
                tokens=None, parity=True, ttft_s=0.01, decode_cpu_s=0.08) -> Measurement:
    return Measurement(
        system=system, prompt_id=prompt_id, category='code', repeat=repeat, new_tokens=new_tokens, ttft_s=ttft_s,
        decode_s=decode_s, wall_s=ttft_s + decode_s, target_passes=passes, drafted_tokens=drafted,
        accepted_tokens=accepted, per_position_acceptance=[], mean_num_draft_tokens=0.0, draft_cost_ratio=0.0,
        paused_rounds=0, drafter_used='none', warnings=[], peak_rss_bytes=0, rss_growth_bytes=0, parity=parity,
        first_mismatch=-1 if parity else 3, token_ids=list(tokens or range(new_tokens)), decode_cpu_s=decode_cpu_s)


def test_rows_take_the_median_repeat_and_count_tokens_per_decode_pass():
    measurements = [measurement('ours/none', repeat=r, decode_s=s) for r, s in enumerate((0.1, 0.2, 0.05))]
    measurements += [measurement('llamacpp-q8_0/none', tokens=[5] * 11, parity=False),
                     measurement('llamacpp-q8_0/draft/K3', tokens=[5] * 11, parity=False, passes=5, drafted=12,
                                 accepted=6),
                     measurement('llamacpp-q8_0/ngram/K4', tokens=[6] * 11, parity=False)]
    rows = {row.system: row for row in llamacpp_peers.rows_of(measurements)}
    assert list(rows) == ['ours/none', 'llamacpp-q8_0/none', 'llamacpp-q8_0/draft/K3', 'llamacpp-q8_0/ngram/K4']
    assert rows['ours/none'].tokens_per_s == pytest.approx(100.0)   # 10 decode tokens: 100, 50, 200 tok/s
    assert rows['ours/none'].tokens_per_cpu_s == pytest.approx(125.0)   # 10 tokens in 0.08 CPU s each repeat
    assert rows['ours/none'].ttft_ms == pytest.approx(10.0)
    assert rows['ours/none'].tau == pytest.approx(1.0)
    assert math.isnan(rows['ours/none'].acceptance_rate)
    draft = rows['llamacpp-q8_0/draft/K3']
    assert draft.tau == pytest.approx(10 / 4)
    assert draft.acceptance_rate == pytest.approx(0.5)
    assert (draft.same_as_reference, draft.same_as_own_plain, draft.generations) == (0, 1, 1)
    assert rows['llamacpp-q8_0/ngram/K4'].same_as_own_plain == 0


def test_comparisons_pair_plain_by_precision_and_the_best_speculative_systems():
    rows = [llamacpp_peers.Row(system, rate, rate, 1.0, 1.0, float('nan'), 1, 1, 1) for system, rate in (
        ('ours/none', 400.0), ('ours/ngram/adaptive', 700.0), ('ours/mtp/adaptive', 800.0),
        ('ours-int8/mtp/adaptive', 960.0), ('ours-f16/none', 520.0), ('ours-f16/mtp/adaptive', 1000.0),
        ('llamacpp-f16/none', 650.0), ('llamacpp-f16/draft/K3', 500.0),
        ('llamacpp-f32/none', 500.0), ('llamacpp-q8_0/none', 900.0), ('llamacpp-f32/draft/K3', 250.0),
        ('llamacpp-f32/ngram/K4', 320.0), ('llamacpp-q8_0/ngram/K4', 640.0))]
    # per prompt: ours 2x faster on one, 1.5x on another, slower on the third; the median pair is 1.5x
    measurements = [measurement('ours/none', prompt, decode_s=s) for prompt, s in (('a', 0.05), ('b', 0.1),
                                                                                    ('c', 0.2))]
    measurements += [measurement('llamacpp-f32/none', prompt, decode_s=s) for prompt, s in (('a', 0.1), ('b', 0.15),
                                                                                             ('c', 0.1))]
    ratios = {ratio.name: ratio for ratio in llamacpp_peers.comparisons(rows, measurements)}
    plain = ratios['our plain float32 / llama.cpp plain f32']
    assert (plain.ours, plain.theirs, plain.ratio, plain.threshold) == ('ours/none', 'llamacpp-f32/none', 0.8, 1.0)
    assert plain.paired_ratio == pytest.approx(1.5)
    int8 = ratios['our plain int8 / llama.cpp plain Q8_0']
    assert int8.ours == '-' and math.isnan(int8.ratio) and math.isnan(int8.paired_ratio)   # no int8 row measured
    best = ratios["our best speculative / llama.cpp's best speculative, any precision"]
    assert (best.ours, best.theirs, best.ratio) == ('ours-f16/mtp/adaptive', 'llamacpp-q8_0/ngram/K4', 1000 / 640)
    at_f32 = ratios["our best speculative / llama.cpp's best speculative, float32 against f32"]
    assert (at_f32.ours, at_f32.theirs, at_f32.ratio) == ('ours/mtp/adaptive', 'llamacpp-f32/ngram/K4', 2.5)
    at_int8 = ratios["our best speculative / llama.cpp's best speculative, int8 against Q8_0"]
    assert (at_int8.ours, at_int8.theirs, at_int8.ratio) == ('ours-int8/mtp/adaptive', 'llamacpp-q8_0/ngram/K4', 1.5)
    at_f16 = ratios["our best speculative / llama.cpp's best speculative, float16 against f16"]
    assert (at_f16.ours, at_f16.theirs, at_f16.ratio) == ('ours-f16/mtp/adaptive', 'llamacpp-f16/draft/K3', 2.0)
    f16 = ratios['our plain float16 / llama.cpp plain f16']
    assert (f16.ours, f16.theirs, f16.ratio) == ('ours-f16/none', 'llamacpp-f16/none', 0.8)
    table = llamacpp_peers.markdown(rows, list(ratios.values()), [Skipped('llamacpp-f32/mtp', 'aborts')])
    assert '| our plain float32 / llama.cpp plain f32 | ours/none | llamacpp-f32/none | 0.80× | 1.50× | ≥ 1.0× |' \
        in table
    assert '| our plain int8 / llama.cpp plain Q8_0 | - | llamacpp-q8_0/none | - | - | ≥ 1.0× |' in table
    assert table.endswith('- llamacpp-f32/mtp: aborts\n')


def test_interleave_checks_every_system_against_our_plain_decoding_in_a_seeded_order():
    calls = []

    def runner(name, tokens):
        def run(prompt_ids, max_new_tokens):
            calls.append((name, max_new_tokens))
            return Outcome(token_ids=tokens[:max_new_tokens], ttft_s=0.01, decode_s=0.1, wall_s=0.11,
                           target_passes=max_new_tokens, drafted_tokens=0, accepted_tokens=0)
        return run

    runners = {'ours/none': runner('ours/none', [1, 2, 3, 4]), 'llamacpp-q8_0/none': runner('q8', [1, 2, 9, 4])}
    prompts = [Prompt('a', 'code', 'x'), Prompt('b', 'code', 'y')]
    measurements = llamacpp_peers.interleave(runners, prompts, {'a': [1], 'b': [2]}, 2, 4, 0, lambda name: None)
    assert calls[:2] == [('ours/none', 4), ('q8', 4)]   # warm-up: min(8, max_new_tokens) tokens
    assert len(measurements) == 2 * 2 * 2
    assert all(m.parity for m in measurements if m.system == 'ours/none')
    assert all(not m.parity and m.first_mismatch == 2 for m in measurements if m.system == 'llamacpp-q8_0/none')
    with pytest.raises(ValueError, match='ours/none'):
        llamacpp_peers.interleave({'llamacpp-f32/none': runners['llamacpp-q8_0/none']}, prompts, {'a': [1], 'b': [2]},
                                  1, 4, 0, lambda name: None)


def test_the_llamacpp_systems_and_why_they_cannot_run(tmp_path):
    assert llamacpp_peers.llamacpp_systems([4], [3]) == [
        'llamacpp-f32/none', 'llamacpp-f16/none', 'llamacpp-q8_0/none', 'llamacpp-f32/ngram/K4',
        'llamacpp-f32/draft/K3', 'llamacpp-f16/ngram/K4', 'llamacpp-f16/draft/K3', 'llamacpp-q8_0/ngram/K4',
        'llamacpp-q8_0/draft/K3']
    assert 'scripts/setup_llamacpp.sh' in llamacpp_peers.skip_message(tmp_path / 'venv', tmp_path)
    (tmp_path / 'venv' / 'bin').mkdir(parents=True)
    (tmp_path / 'venv' / 'bin' / 'python').write_text('')
    assert 'export_gguf.py' in llamacpp_peers.skip_message(tmp_path / 'venv', tmp_path)


def test_mtp_refusal_reports_the_failed_assertion_of_an_aborted_probe(tmp_path):
    python = tmp_path / 'bin' / 'python'
    python.parent.mkdir()
    python.write_text('#!/bin/sh\necho "src/llama-model.cpp:2807: GGML_ASSERT(hparams.is_swa_any()) failed" >&2\n'
                      'kill -ABRT $$\n')
    python.chmod(0o755)
    reason = llamacpp_peers.mtp_refusal(tmp_path, tmp_path, 1)
    assert reason == ('llama.cpp aborts creating the MTP context of the assistant (exit status -6): '
                      'GGML_ASSERT(hparams.is_swa_any()) failed')
    python.write_text('#!/bin/sh\nexit 0\n')
    assert llamacpp_peers.mtp_refusal(tmp_path, tmp_path, 1) == ''


def test_bandwidth_counts_bytes_as_stream_does_and_refuses_nonsense():
    from gemma_spec_ros.benchmarks.decode import bandwidth

    figures = bandwidth.measure(1, array_mib=8, repeats=2)
    assert figures.threads == 1 and figures.array_mib == 8
    assert min(figures.read_gb_s, figures.copy_gb_s, figures.triad_gb_s) > 0.1
    with pytest.raises(ValueError, match='threads'):
        bandwidth.measure(0)


def test_e2b_rows_get_their_roofline_and_errors_stay_rows():
    from gemma_spec_ros.benchmarks.peers import llamacpp_e2b

    row = {'system': 'ours-int8', 'threads': 1, 'decode_tokens_per_s': 4.0, 'step_bytes': 3_000_000_000,
           'prompt_tokens_per_s': {'512': 40.0, '2048': 30.0}, 'load_s': 9.0, 'peak_rss_gib': 6.3}
    measured = llamacpp_e2b._with_roofline(row, read_gb_s=15.0)
    assert measured['roofline_tokens_per_s'] == pytest.approx(5.0)
    assert measured['of_roofline'] == pytest.approx(0.8)
    failed = llamacpp_e2b._with_roofline({'system': 'llamacpp-q8_0', 'threads': 1, 'error': 'exit 1: boom'}, 15.0)
    table = llamacpp_e2b.markdown([measured, failed], {1: {'read_gb_s': 15.0}})
    assert '| 1 | ours-int8 | 4.00 | 80% | 512: 40.0 / 2048: 30.0 | 9.0 | 6.30 | 3.00 |' in table
    assert '| 1 | llamacpp-q8_0 | error: exit 1: boom |' in table and '1 thread(s) 15.0 GB/s' in table
    assert llamacpp_e2b.prompt_ids(5, 0) == llamacpp_e2b.prompt_ids(5, 0) != llamacpp_e2b.prompt_ids(5, 1)
    assert all(10 <= token < 4000 for token in llamacpp_e2b.prompt_ids(100, 3))
