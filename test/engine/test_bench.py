import json
from pathlib import Path

import pytest

from gemma_spec_ros.benchmarks import main
from gemma_spec_ros.benchmarks.analysis import fit_alpha, predict_speedup, summarize
from gemma_spec_ros.benchmarks.cli import build_parser
from gemma_spec_ros.benchmarks.decode.probe import CostProbe
from gemma_spec_ros.benchmarks.harness import Measurement, check_compile_modes, first_mismatch
from gemma_spec_ros.benchmarks.peers import vllm as vllm_peers
from gemma_spec_ros.benchmarks.prompts import load_prompts, take_per_category
from gemma_spec_ros.benchmarks.systems import System
from gemma_spec_ros.engine.stats import iid_expected_tokens as expected_tokens

REPO = Path(__file__).resolve().parents[2]
# corpus schemas for the quick run: a function call, an API object, a planner plan, one with uniqueItems (refused)
HANDFUL = ('bfcl-calculate_density.json', 'openai-api-CreateModerationRequest.json',
           'project-test-grammar-json-plan.json', 'schemastore-bxci.schema-2.0.0.json')
EXPECTED_SYSTEMS = {'ours/none', 'ours/ngram/K2', 'ours/ngram/adaptive', 'ours/draft/K2', 'ours/draft/adaptive',
                    'ours/mtp/K2', 'ours/mtp/adaptive', 'hf/none', 'hf/ngram/default', 'hf/ngram/K2',
                    'hf/draft/default', 'hf/draft/K2', 'hf/mtp/default', 'hf/mtp/K2'}


def test_quick_bench_on_tiny_models(tiny_models, tmp_path):
    out = tmp_path / 'out'
    code = main(['--quick', '--no-hf-static', '--target', tiny_models.target, '--draft', tiny_models.draft,
                 '--assistant', tiny_models.assistant, '--out', str(out)])
    assert code == 0
    document = json.loads((out / 'results.json').read_text())
    assert document['schema'] == 'gemma_spec_ros.bench/1'
    assert {s['name'] for s in document['systems']} == EXPECTED_SYSTEMS
    overall = {c['system']: c for c in document['summary'] if c['category'] == 'all'}
    assert set(overall) == EXPECTED_SYSTEMS
    assert document['parity_failures'] == []
    assert all(c['parity'] for c in document['summary'])
    assert all(c['tokens_per_s'] > 0 for c in overall.values())
    assert overall['ours/none']['speedup_vs_ours_plain'] == pytest.approx(1.0)
    categories = {p['category'] for p in document['prompts']}
    assert categories == {'code', 'explain', 'summarize', 'math', 'extract'}
    assert len(document['measurements']) == len(EXPECTED_SYSTEMS) * len(document['prompts'])
    assert 'token_ids' not in document['measurements'][0]
    for name in ('results.md', 'speedup_by_category.png', 'k_sweep.png', 'predicted_vs_measured.png'):
        assert (out / name).stat().st_size > 0, name
    assert 'ours/mtp/adaptive' in (out / 'results.md').read_text()
    assert [s['name'] for s in document['startup']] == ['ours', 'hf']
    assert all(s['load_s'] > 0 and s['first_call_s'] > 0 for s in document['startup'])
    assert set(document['warm_up_s']) == EXPECTED_SYSTEMS
    ratios = {r['name']: r for r in document['peer_ratios']}
    assert ratios['our plain vs transformers eager plain']['value'] > 0
    assert ratios['our plain vs vLLM plain']['value'] is None  # not asked for
    assert ratios['our best speculative vs our plain']['numerator'].startswith('ours/')


def test_vllm_rows_skipped_without_venv(tiny_models, tmp_path, capsys):
    out = tmp_path / 'out'
    assert main(['--quick', '--no-hf-static', '--drafters', 'ngram', '--vllm', '--vllm-venv', str(tmp_path / 'none'),
                 '--target', tiny_models.target, '--out', str(out)]) == 0
    assert 'no vLLM environment at' in capsys.readouterr().err
    document = json.loads((out / 'results.json').read_text())
    assert document['skipped'] == [{'system': 'vllm', 'reason': vllm_peers.skip_message(str(tmp_path / 'none'))}]
    assert not any(s['family'] == 'vllm' for s in document['systems'])
    assert 'Not measured' in (out / 'results.md').read_text()


def test_quick_constrained_category_on_tiny_models(tiny_models, tmp_path, capsys):
    out = tmp_path / 'constrained'
    assert main(['--constrained', '--quick', '--target', tiny_models.target, '--draft', tiny_models.draft,
                 '--assistant', tiny_models.assistant, '--max-new-tokens', '64', '--out', str(out)]) == 0
    document = json.loads((out / 'results.json').read_text())
    assert document['schema'] == 'gemma_spec_ros.bench.constrained/1' and len(document['prompts']) == 1
    assert [c['system'] for c in document['cells']] == ['ours/none', 'ours/ngram/K2', 'ours/draft/K2', 'ours/mtp/K2']
    assert len(document['samples']) == 2 * 4 and sum(s['constrained'] for s in document['samples']) == 4
    for cell in document['cells']:
        for side in (cell['unconstrained'], cell['constrained']):
            assert side['tau'] >= 1.0 and side['tokens_per_s'] > 0 and side['round_ms'] > 0
        assert cell['unconstrained']['grammar_us_per_token'] == 0 < cell['constrained']['grammar_us_per_token']
        assert 0 < cell['overhead'] == cell['constrained']['grammar_share'] < 1
    greedy = {s['system']: s['new_tokens'] for s in document['samples'] if s['constrained']}
    assert len(set(greedy.values())) == 1  # constrained greedy output is the same for every drafter
    assert document['json_free_whitespace'] is False
    assert [o['prompt'] for o in document['per_prompt']] == [p['id'] for p in document['prompts']]
    assert document['per_prompt'][0]['new_tokens'] == next(iter(greedy.values()))
    assert '| ours/mtp/K2 | 2 |' in capsys.readouterr().out


def test_planner_category_on_tiny_models(tiny_models, tmp_path, capsys):
    out = tmp_path / 'planner'
    assert main(['--planner', '2', '--target', tiny_models.target, '--draft', tiny_models.draft, '--assistant',
                 tiny_models.assistant, '--drafters', 'ngram,mtp', '--repeats', '1', '--max-new-tokens', '12',
                 '--compile', 'eager', '--threads', '1', '--out', str(out)]) == 0
    document = json.loads((out / 'results.json').read_text())
    assert document['schema'] == 'gemma_spec_ros.bench.planner/1' and document['conversations'] == 2
    accuracy = document['accuracy']
    assert 0 <= accuracy['exact_sequences'] <= 1 and accuracy['valid_calls'] in (0.0, 1.0)
    assert accuracy['valid_calls'] == 1.0 or accuracy['calls'] == 0   # the grammar makes every call valid
    assert list(document['systems']) == ['none', 'ngram', 'mtp']
    for name, system in document['systems'].items():
        assert system['identical_to_plain'], name   # greedy: every drafter gives plain decoding's tokens
        assert system['tau'] >= 1.0 and system['tokens_per_second'] > 0
    assert document['systems']['none']['speedup'] == 1.0
    assert '| mtp |' in capsys.readouterr().out


def test_schema_corpus_on_a_handful_of_schemas(tiny_models, tmp_path, capsys):
    corpus = tmp_path / 'corpus'
    corpus.mkdir()
    manifest = json.loads((REPO / 'test' / 'data' / 'schemas' / 'manifest.json').read_text())
    picked = [entry for entry in manifest['schemas'] if entry['file'] in HANDFUL]
    for entry in picked:
        (corpus / entry['file']).write_text((REPO / 'test' / 'data' / 'schemas' / entry['file']).read_text())
    (corpus / 'manifest.json').write_text(json.dumps(dict(manifest, schemas=picked)))
    out = tmp_path / 'schemas'
    assert main(['--schemas', str(corpus), '--target', tiny_models.target, '--assistant', tiny_models.assistant,
                 '--drafters', 'mtp', '--max-new-tokens', '48', '--compile', 'eager', '--threads', '1',
                 '--sampled-seeds', '2', '--out', str(out)]) == 0
    document = json.loads((out / 'results.json').read_text())
    assert document['format'] == 'gemma_spec_ros.bench.schemas/1' and document['json_schema_unenforced'] == 'refuse'
    summary = document['summary']
    sampled = summary['drafters']['mtp@t1']   # two sampled runs per accepted schema, none for the refused one
    assert sampled['schemas'] == 2 * (len(HANDFUL) - 1) and sampled['complete_invalid'] == 0
    for drafter in ('none', 'mtp'):
        row = summary['drafters'][drafter]
        assert row['schemas'] == len(HANDFUL) and row['refused'] == 1 and row['accepted'] == len(HANDFUL) - 1
        assert row['complete_valid'] + row['incomplete'] + row['caught'] + row['complete_invalid'] == row['accepted']
        assert row['complete_invalid'] == 0 and row['identical_to_plain'] == row['accepted']
    assert summary['refused_keywords'] == {'uniqueItems': 1}
    assert '| mtp |' in (out / 'results.md').read_text() and 'uniqueItems 1' in capsys.readouterr().out


def test_the_committed_schema_corpus_has_provenance():
    directory = REPO / 'test' / 'data' / 'schemas'
    manifest = json.loads((directory / 'manifest.json').read_text())
    files = {path.name for path in directory.glob('*.json')} - {'manifest.json'}
    assert len(manifest['schemas']) >= 100 and {entry['file'] for entry in manifest['schemas']} == files
    for entry in manifest['schemas']:
        assert entry['repository'] and entry['path'] and entry['licence'], entry
        assert entry['source'] == 'project' or len(entry['commit']) == 40, entry
        assert (directory / entry['file']).stat().st_size <= 30000, entry


def test_constrained_category_measures_one_compile_mode(capsys, tiny_models):
    assert main(['--constrained', '--quick', '--compile', 'eager,auto', '--target', tiny_models.target]) == 2
    assert '--constrained measures one compile mode, got eager,auto' in capsys.readouterr().err


def test_every_study_runs_from_the_one_bench_entry_point(capsys):
    from gemma_spec_ros.benchmarks.cli import STUDIES

    for study in STUDIES:
        with pytest.raises(SystemExit) as ended:
            main([study, '--help'])
        assert ended.value.code == 0, study
        assert 'python -m gemma_spec_ros bench ' + study in capsys.readouterr().out, study
    main_help = build_parser().format_help()
    assert all(study in main_help for study in STUDIES)  # bench --help lists them


def test_free_whitespace_needs_the_constrained_category(capsys):
    assert main(['--quick', '--json-free-whitespace']) == 2
    assert '--json-free-whitespace applies to --constrained only' in capsys.readouterr().err


def test_bad_constrained_spec_exits_with_message(tmp_path, capsys, tiny_models):
    spec = tmp_path / 'spec.json'
    spec.write_text(json.dumps({'json_schema': {'type': 'object'}, 'prompts': []}))
    assert main(['--constrained', str(spec), '--quick', '--target', tiny_models.target]) == 2
    assert 'expected {"json_schema"' in capsys.readouterr().err


def test_committed_prompt_set_covers_every_category():
    prompts = load_prompts('bench/prompts.jsonl')
    by_category = {}
    for prompt in prompts:
        by_category[prompt.category] = by_category.get(prompt.category, 0) + 1
    assert set(by_category) == {'code', 'explain', 'summarize', 'math', 'extract'}
    assert min(by_category.values()) >= 3
    assert len(take_per_category(prompts, 1)) == 5


def test_bad_prompt_file_raises_value_error(tmp_path):
    bad = tmp_path / 'bad.jsonl'
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match='category'):
        load_prompts(str(bad))
    bad.write_text('not json\n')
    with pytest.raises(ValueError, match='not JSON'):
        load_prompts(str(bad))


def test_bad_options_exit_with_message(capsys, tiny_models):
    assert main(['--quick', '--ks', '0', '--target', tiny_models.target, '--draft', tiny_models.draft,
                 '--assistant', tiny_models.assistant]) == 2
    assert 'K values must be >= 1' in capsys.readouterr().err
    assert main(['--quick', '--compile', 'auto,fast', '--target', tiny_models.target]) == 2
    assert ('--compile must list distinct modes of auto, inductor, inductor-gemm, cudagraph, eager, transformers'
            in capsys.readouterr().err)
    assert main(['--quick', '--vllm-ks', '0', '--target', tiny_models.target]) == 2
    assert '--vllm-ks values must be >= 1' in capsys.readouterr().err


def test_compile_and_peer_options():
    args = build_parser().parse_args(['--compile', 'auto,off', '--vllm', '--vllm-ks', '2,4', '--no-hf-static'])
    assert (args.compile, args.vllm, args.vllm_ks, args.no_hf_static) == ('auto,off', True, '2,4', True)
    defaults = build_parser().parse_args([])
    assert (defaults.compile, defaults.vllm, defaults.no_hf_static) == ('auto', False, False)
    check_compile_modes(['transformers', 'eager', 'inductor', 'cudagraph', 'auto'])
    for bad in ([], ['auto', 'auto'], ['static']):
        with pytest.raises(ValueError, match='--compile must list distinct modes'):
            check_compile_modes(bad)


def test_system_names_per_family_and_compile_mode():
    assert System('ours', 'none').name == System('ours', 'none', compile='auto').name == 'ours/none'
    assert System('ours', 'ngram', 0, 'transformers').name == 'ours-transformers/ngram/adaptive'
    assert System('ours', 'mtp', 4, 'eager').prefix == 'ours-eager'
    assert System('hf-static', 'draft', 2).name == 'hf-static/draft/K2'
    assert System('vllm', 'ngram', 4).name == 'vllm/ngram/K4'
    assert System('vllm', 'none').name == 'vllm/none'


def test_vllm_server_plans_and_skip_message(tmp_path):
    plans, skipped = vllm_peers.server_plans(['ngram', 'draft', 'mtp'], {'ngram': [2, 4], 'draft': [3], 'mtp': [2]},
                                             '/models/draft')
    assert [plan.system.name for plan in plans] == ['vllm/none', 'vllm/ngram/K2', 'vllm/ngram/K4', 'vllm/draft/K3']
    assert plans[0].speculative_config is None
    assert plans[2].speculative_config == {'method': 'ngram', 'num_speculative_tokens': 4, 'prompt_lookup_min': 2,
                                           'prompt_lookup_max': 4}
    assert plans[3].speculative_config == {'method': 'draft_model', 'model': '/models/draft',
                                           'num_speculative_tokens': 3}
    assert [item.system for item in skipped] == ['vllm/mtp']
    assert vllm_peers.skip_message(str(tmp_path)).startswith('no vLLM environment at {}'.format(tmp_path))
    (tmp_path / 'bin').mkdir()
    (tmp_path / 'bin' / 'python').write_text('')
    assert vllm_peers.skip_message(str(tmp_path)) == ''


def test_server_startup_failure_names_the_root_cause():
    log = ('(APIServer pid=1) WARNING [system_utils.py:255] This can cause errors like `OSError: [Errno 24] Too many '
           'open files`.\n'
           '(Worker pid=2) ERROR 12-01 [multiproc_executor.py:1063] Traceback (most recent call last):\n'
           '(Worker pid=2) ERROR 12-01 [multiproc_executor.py:1063] AssertionError: All drafting layers should belong '
           'to the same kv cache group\n'
           'RuntimeError: Engine core initialization failed. See root cause above.\n'
           '  warnings.warn(\n')
    assert vllm_peers.startup_failure(log) == ('AssertionError: All drafting layers should belong to the same kv '
                                               'cache group')
    assert vllm_peers.startup_failure('just a line\n') == 'just a line'
    assert vllm_peers.startup_failure('') == 'no log'


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) == -1
    assert first_mismatch([1, 5, 3], [1, 2, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def _sample(per_position, passes):
    return Measurement(system='s', prompt_id='p', category='c', repeat=0, new_tokens=10, ttft_s=0.1, decode_s=1.0,
                       wall_s=1.1, target_passes=passes, drafted_tokens=0, accepted_tokens=0,
                       per_position_acceptance=per_position, mean_num_draft_tokens=0.0, draft_cost_ratio=0.1,
                       paused_rounds=0, drafter_used='ngram', warnings=[], peak_rss_bytes=0, rss_growth_bytes=0,
                       parity=True, first_mismatch=-1)


def test_leviathan_model():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # Per-position acceptance of an i.i.d. alpha = 0.6 drafter is 0.6, 0.36, 0.216.
    assert fit_alpha([_sample([0.6, 0.36, 0.216], 11)]) == pytest.approx(0.6)
    assert fit_alpha([_sample([], 11)]) is None
    probe = CostProbe(context_tokens=100, rounds=1, target_forward_ms={1: 10.0, 3: 12.0}, verify_cost={1: 1.0, 3: 1.2},
                      draft_step_ms=1.0, assistant_step_ms=1.0, draft_cost_ratio={})
    assert probe.verify_cost_at(2) == pytest.approx(1.1)
    tau, speedup = predict_speedup(0.5, [0, 0, 7], 0.1, probe)  # 7 rounds of K = 2
    assert tau == pytest.approx(1.75)
    assert speedup == pytest.approx(1.75 / (2 * 0.1 + 1.2))
    # Rounds with nothing to draft are plain rounds: one token for one 1-token pass.
    tau, speedup = predict_speedup(0.5, [3, 0, 3], 0.0, probe)
    assert tau == pytest.approx(0.5 * 1.75 + 0.5)
    assert speedup == pytest.approx(tau / (0.5 * 1.2 + 0.5))
    # K varies (adaptive K, short n-gram matches): each round is predicted at its own K, not all at the mean K.
    tau, _ = predict_speedup(0.5, [0, 1, 0, 1], 0.0, probe)
    assert tau == pytest.approx(0.5 * 1.5 + 0.5 * 1.875) and tau < 1.75
    # Our systems are predicted on the curve of our own verify passes.
    probe.engine_verify_cost = {'auto': {1: 1.0, 3: 1.5}}
    assert probe.verify_cost_at(2, 'auto') == pytest.approx(1.25)
    tau, speedup = predict_speedup(0.5, [0, 0, 1], 0.1, probe, 'auto')
    assert speedup == pytest.approx(1.75 / (2 * 0.1 + 1.5))


def _timed(system, category, rate):
    """Return a measurement of rate decode tok/s: 11 tokens, 10 of them in 10 / rate seconds."""
    sample = _sample([], 11)
    sample.system, sample.category, sample.decode_s = system.name, category, 10.0 / rate
    return sample


def _flat_probe() -> CostProbe:
    """Return a cost probe whose verify passes all cost one plain pass."""
    return CostProbe(context_tokens=100, rounds=1, target_forward_ms={1: 10.0}, verify_cost={1: 1.0},
                     draft_step_ms=1.0, assistant_step_ms=1.0,
                     draft_cost_ratio={'none': 0.0, 'ngram': 0.0, 'draft': 0.1, 'mtp': 0.1})


def test_peer_ratios():
    probe = _flat_probe()
    rates = {System('ours', 'none'): 30.0, System('ours', 'ngram', 2): 45.0, System('ours', 'draft', 0): 60.0,
             System('ours', 'none', compile='transformers'): 20.0, System('ours', 'draft', 2, 'transformers'): 50.0,
             System('hf', 'none'): 20.0, System('hf', 'draft', 4): 24.0, System('hf-static', 'none'): 25.0,
             System('hf-static', 'draft', 2): 40.0, System('vllm', 'none'): 15.0, System('vllm', 'ngram', 2): 16.0}
    systems = list(rates)
    summary = summarize(systems, [_timed(s, 'code', rate) for s, rate in rates.items()], ['code'], probe)
    assert summary.ours_plain == 'ours/none'
    ratios = {r.name: r for r in summary.ratios}
    assert ratios['our plain vs transformers eager plain'].value == pytest.approx(1.5)
    assert ratios['our plain vs transformers static+compile plain'].value == pytest.approx(1.2)
    assert ratios['our plain vs vLLM plain'].value == pytest.approx(2.0)
    assert ratios['ours-transformers plain vs our plain'].value == pytest.approx(20 / 30)
    best = ratios["our best speculative vs vLLM's best speculative"]
    assert (best.numerator, best.denominator, best.value) == ('ours/draft/adaptive', 'vllm/ngram/K2',
                                                              pytest.approx(60 / 16))
    same = ratios["our best speculative vs transformers' best with the same drafter"]
    assert (same.denominator, same.value) == ('hf-static/draft/K2', pytest.approx(1.5))
    assert ratios['our best speculative vs our plain'].value == pytest.approx(2.0)
    # Our rows compare with plain decoding in their own compile mode, peers with "our plain".
    assert summary.cell('ours-transformers/draft/K2').speedup_vs_ours_plain == pytest.approx(2.5)
    assert summary.cell('vllm/none').speedup_vs_ours_plain == pytest.approx(0.5)
    # A peer that was not measured leaves its ratio empty.
    summary = summarize(systems[:7], [_timed(s, 'code', rates[s]) for s in systems[:7]], ['code'], probe)
    ratios = {r.name: r for r in summary.ratios}
    assert ratios['our plain vs vLLM plain'].value is None and ratios['our plain vs vLLM plain'].denominator == ''


def test_adaptive_against_the_best_fixed_k_per_category():
    probe = _flat_probe()
    rates = {'code': {0: 10.0, 2: 20.0, 4: 30.0, 'adaptive': 29.0},   # K4 best on code
             'prose': {0: 10.0, 2: 15.0, 4: 8.0, 'adaptive': 12.0}}   # K2 best on prose; K4 loses
    systems = [System('ours', 'none'), System('ours', 'ngram', 2), System('ours', 'ngram', 4),
               System('ours', 'ngram', 0), System('hf', 'none')]
    measurements = []
    for category, by_k in rates.items():
        for system in systems:
            key = 'adaptive' if system.k == 0 else (system.k or 0)
            measurements.append(_timed(system, category, by_k[key] if system.family == 'ours' else 5.0))
    measurements[3].paused_rounds = 7  # the adaptive run on code
    rows = {row.category: row for row in summarize(systems, measurements, list(rates), probe).adaptive}
    assert (rows['code'].best_k, rows['code'].ratio, rows['code'].paused_rounds) == (4, pytest.approx(29 / 30), 7)
    assert (rows['prose'].best_k, rows['prose'].ratio) == (2, pytest.approx(12 / 15))
    # the mean row: adaptive's mean speedup (2.9 + 1.2) / 2 against the single K best on average (K4: 1.9, K2: 1.75)
    assert (rows['mean'].best_k, rows['mean'].best_speedup) == (4, pytest.approx(1.9))
    assert rows['mean'].adaptive_speedup == pytest.approx(2.05) and rows['mean'].paused_rounds == 7


def test_adaptive_rows_give_the_ratio_within_each_repeat():
    probe = _flat_probe()
    systems = [System('ours', 'none'), System('ours', 'ngram', 4), System('ours', 'ngram', 0), System('hf', 'none')]
    rates = {0: {0: 10.0, 4: 30.0, 'adaptive': 33.0}, 1: {0: 8.0, 4: 20.0, 'adaptive': 18.0}}  # a slow second repeat
    measurements = []
    for repeat, by_k in rates.items():
        for system in systems:
            key = 'adaptive' if system.k == 0 else (system.k or 0)
            sample = _timed(system, 'code', by_k[key] if system.family == 'ours' else 5.0)
            sample.repeat = repeat
            measurements.append(sample)
    row = next(row for row in summarize(systems, measurements, ['code'], probe).adaptive if row.category == 'code')
    assert row.best_k == 4 and row.repeat_ratios == [pytest.approx(1.1), pytest.approx(0.9)]  # in repeat order


def test_random_models_for_memory_scaling_load_and_fit_together(tmp_path):
    import torch

    from gemma_spec_ros.benchmarks.decode.fast_measure import write_random_models
    from gemma_spec_ros.engine.runtime.model import checkpoints

    target_path, assistant_path = write_random_models('3x64x256', str(tmp_path))
    target = checkpoints.load_causal_lm(target_path, 'target', torch.device('cpu'), torch.float32)
    assistant = checkpoints.load_assistant(assistant_path, torch.device('cpu'), torch.float32)
    checkpoints.check_assistant_fits(target, assistant, assistant_path)
    config = checkpoints.text_config(target)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (3, 64, 256)
    assert assistant.config.get_text_config().hidden_size == 64
    assert checkpoints.load_tokenizer(target_path)('def f():').input_ids


def test_gpu_check_keeps_the_figures_of_the_modes_that_run(tmp_path):
    from gemma_spec_ros.benchmarks.decode import gpu_check

    code = gpu_check.main(['--device', 'cpu', '--models', 'bundled', '--modes', 'eager,cudagraph', '--new-tokens', '4',
                           '--repeats', '1', '--out', str(tmp_path)])
    assert code == 1  # a mode failed
    eager, cudagraph = json.loads((tmp_path / 'results.json').read_text())['rows']
    assert eager['compile'] == 'eager' and eager['plain_tok_s'] > 0 and eager['mtp_k4_tau'] >= 1.0
    assert eager['mtp_tokens_equal_plain'] is True and 0 < eager['roofline_fraction'] < 1
    assert cudagraph['compile'] == 'cudagraph' and 'needs a CUDA device' in cudagraph['error']
    report = (tmp_path / 'results.md').read_text()
    assert '| bundled | eager |' in report and 'needs a CUDA device' in report


def test_batching_bench_reports_every_engine_level_and_drafter(tiny_models, tmp_path):
    import json

    from gemma_spec_ros.benchmarks.decode import batching

    out = tmp_path / 'batching.json'
    assert batching.main(['--target', tiny_models.target, '--assistant', tiny_models.assistant, '--compile', 'eager',
                          '--concurrency', '1,2', '--drafters', 'none,mtp', '--repeats', '1', '--max-new-tokens', '6',
                          '--out', str(out)]) == 0
    rows = json.loads(out.read_text())['rows']
    assert {(row['engine'], row['concurrency'], row['drafter']) for row in rows} == {
        (engine, level, drafter) for drafter in ('none', 'mtp')
        for engine, level in (('one at a time', 1), ('batched', 1), ('batched', 2))}
    assert all(row['aggregate_tokens_per_second'] > 0 and row['waves'] == 1 for row in rows)
    assert all(row['tau_mean'] == 1.0 for row in rows if row['drafter'] == 'none')
