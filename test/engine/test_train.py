"""End-to-end tests of ``python -m gemma_spec_ros train ...`` on a tiny corpus with tiny shapes (seconds each)."""

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from gemma_spec_ros.train.cli import main

STDLIB = Path(sysconfig.get_paths()['stdlib'])
TINY = ['--seq-len', '32', '--batch-size', '2', '--warmup', '1', '--checkpoint-every', '2', '--eval-windows', '4',
        '--threads', '1', '--device', 'cpu']


@pytest.fixture(scope='module')
def tiny_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('corpus')
    for name in ('textwrap.py', 'bisect.py', 'heapq.py', 'shlex.py'):
        shutil.copy(STDLIB / name, root / name)
    (root / 'notes.jsonl').write_text('\n'.join(json.dumps({'text': f'Robot {i} goes to the kitchen.'})
                                                for i in range(20)) + '\n')
    return root


@pytest.fixture(scope='module')
def tiny_target(tiny_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp('target') / 'model'
    assert main(['target', '--input', str(tiny_corpus), '--eval-input', str(STDLIB / 'glob.py'),
                 '--shape', '2x32x64', '--sliding-window', '8', '--steps', '3', '--out', str(out),
                 '--run-dir', str(out.parent / 'run'), *TINY]) == 0
    return out


def test_tokenizer_command(tiny_corpus, tmp_path):
    from transformers import AutoTokenizer

    assert main(['tokenizer', '--input', str(tiny_corpus), '--vocab-size', '400', '--out', str(tmp_path)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    text = 'def f(x):\n    return x  # héllo\n'
    ids = tokenizer(text).input_ids
    assert ids[0] == 2 and tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template([{'role': 'user', 'content': 'Go to the dock'}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == '<bos><|turn>user\nGo to the dock<turn|>\n<|turn>model\n'


def test_target_trains_saves_and_resumes(tiny_target, tiny_corpus):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert type(model).__name__ == 'Gemma4ForCausalLM' and model.dtype == torch.float32
    assert set(model.config.layer_types) == {'sliding_attention', 'full_attention'}
    report = json.loads((tiny_target / 'training.json').read_text())
    assert report['steps'] == 3 and report['held_out_perplexity']['code'] > 1
    assert (tiny_target / 'tokenizer.json').exists()
    run = tiny_target.parent / 'run'
    assert (run / 'checkpoint' / 'model.safetensors').exists()
    resumed = tiny_target.parent / 'resumed'
    assert main(['target', '--input', str(tiny_corpus), '--shape', '2x32x64', '--sliding-window', '8',
                 '--steps', '5', '--resume', '--out', str(resumed), '--run-dir', str(run), *TINY]) == 0
    assert json.loads((resumed / 'training.json').read_text())['steps'] == 5
    assert json.loads((run / 'checkpoint' / 'state.json').read_text())['step'] == 5


def test_draft_distills_from_target(tiny_target, tiny_corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    assert main(['draft', '--target', str(tiny_target), '--input', str(tiny_corpus), '--shape', '1x32x64',
                 '--steps', '2', '--out', str(tmp_path / 'draft'), '--run-dir', str(tmp_path / 'run'), *TINY]) == 0
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / 'draft')
    assert draft.config.vocab_size == AutoModelForCausalLM.from_pretrained(tiny_target).config.vocab_size


def test_init_fine_tunes_with_extra_input(tiny_target, tiny_corpus, tmp_path, capsys):
    """--init goes on from a saved target or draft; --extra-input adds documents to --input's."""
    extra = tmp_path / 'extra.jsonl'
    extra.write_text(json.dumps({'text': '<|turn>user\nGo to the sink.<turn|>\n'}) + '\n')
    out = tmp_path / 'tuned'
    assert main(['target', '--init', str(tiny_target), '--input', str(tiny_corpus / 'textwrap.py'),
                 '--extra-input', str(extra), '--eval-input', str(STDLIB / 'glob.py'), '--steps', '1',
                 '--out', str(out), '--run-dir', str(tmp_path / 'run'), *TINY]) == 0
    assert '--extra-input: 1 documents' in capsys.readouterr().out
    report = json.loads((out / 'training.json').read_text())
    assert report['shape'] == '2x32x64' and report['initialised_from']['steps'] == 3
    assert report['held_out_perplexity_before']['code'] > 1
    assert main(['draft', '--target', str(out), '--init', str(out), '--input', str(tiny_corpus),
                 '--extra-input', str(extra), '--steps', '1', '--out', str(tmp_path / 'draft'),
                 '--run-dir', str(tmp_path / 'run-draft'), *TINY]) == 0
    assert json.loads((tmp_path / 'draft' / 'training.json').read_text())['initialised_from']['path'] == str(out)


def test_assistant_trains_for_any_gemma4_target(tiny_models, tiny_corpus, tmp_path):
    """The conftest target has other head dims than the bundled shapes; the assistant must follow them."""
    from transformers import Gemma4AssistantForCausalLM

    out = tmp_path / 'assistant'
    assert main(['assistant', '--target', tiny_models.target, '--input', str(tiny_corpus), '--shape', '1x32x64',
                 '--steps', '2', '--greedy-windows', '2', '--greedy-prompt-len', '8', '--draft-steps', '3',
                 '--out', str(out), '--run-dir', str(tmp_path / 'run'), *TINY]) == 0
    assistant = Gemma4AssistantForCausalLM.from_pretrained(out)
    assert assistant.config.backbone_hidden_size == 64
    assert assistant.generation_config.num_assistant_tokens == 3
    assert (tmp_path / 'run' / 'greedy_windows.pt').exists()


def test_eagle3_head_trains_for_a_target_and_the_engine_drafts_with_it(tiny_models, tiny_corpus, tmp_path):
    from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest

    out = tmp_path / 'eagle3'
    assert main(['eagle3', '--target', tiny_models.target, '--input', str(tiny_corpus), '--shape', '1x48x96',
                 '--eval-input', str(STDLIB / 'glob.py'), '--steps', '3', '--greedy-windows', '2',
                 '--greedy-prompt-len', '8', '--depth', '3',
                 '--out', str(out), '--run-dir', str(tmp_path / 'run'), *TINY]) == 0
    report = json.loads((out / 'training.json').read_text())
    assert report['steps'] == 3 and len(report['held_out_draft_accuracy']['code']) == 3
    engine = Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='eagle3', eagle3_path=str(out),
                                             compile='eager', device='cpu'))
    result = engine.generate(GenerationRequest(prompt='def f(x):\n', max_new_tokens=12, num_draft_tokens=3))
    plain = engine.generate(GenerationRequest(prompt='def f(x):\n', max_new_tokens=12, drafter='none'))
    assert result.token_ids == plain.token_ids and result.stats.drafted_tokens > 0
    assert main(['eagle3', '--target', tiny_models.target, '--input', str(tiny_corpus), '--shape', '2x48x96',
                 '--steps', '1', '--out', str(tmp_path / 'bad'), '--run-dir', str(tmp_path / 'run2'), *TINY]) == 2


def test_assistant_training_forward_matches_inference(tiny_models):
    """Each query of the batched training forward equals the one-token call the engine makes at inference."""
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    from gemma_spec_ros.train.assistant import DraftSteps, assistant_steps, target_view

    target = AutoModelForCausalLM.from_pretrained(tiny_models.target).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(tiny_models.assistant).eval()
    ids = torch.randint(4, target.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        view = target_view(target, ids)
        batched = assistant_steps(assistant, view, ids, DraftSteps(3))
        for p in (1, 9, 30):   # inside and beyond the sliding window of 16
            kv = {kind: (k[..., :p, :], v[..., :p, :]) for kind, (k, v) in view.shared_kv.items()}
            hidden = view.hidden[:, p - 1:p]
            for j in range(3):
                inputs = torch.cat([target.get_input_embeddings()(ids[:, p + j:p + j + 1]), hidden], -1)
                out = assistant(inputs_embeds=inputs, position_ids=torch.tensor([[p]]), shared_kv_states=kv)
                torch.testing.assert_close(out.logits[0, 0], batched[j][0, p - 1], atol=1e-4, rtol=1e-4)
                hidden = out.last_hidden_state


def test_eval_drafter_reports_tau(tiny_target, tiny_corpus, tmp_path):
    assistant = tmp_path / 'assistant'
    assert main(['assistant', '--target', str(tiny_target), '--input', str(tiny_corpus), '--shape', '1x32x64',
                 '--steps', '1', '--greedy-windows', '0', '--out', str(assistant), '--run-dir',
                 str(tmp_path / 'run'), *TINY]) == 0
    report = tmp_path / 'eval.json'
    assert main(['eval-drafter', '--target', str(tiny_target), '--assistant', str(assistant),
                 '--drafters', 'mtp', 'ngram', '--max-k', '2', '--prompts-per-category', '1',
                 '--max-new-tokens', '6', '--prompt-chars', '120', '--threads', '1', '--out', str(report)]) == 0
    results = json.loads(report.read_text())['results']
    assert set(results) == {'code', 'docstring', 'extraction', 'free_text'}
    for category in results.values():
        for k in ('1', '2'):
            assert category['mtp'][k]['tau'] >= 1.0
            assert category['mtp'][k]['identical_to_plain'] and category['ngram'][k]['identical_to_plain']


def test_ordered_head_command_adds_a_sparse_head_the_engine_loads(tiny_models, tiny_corpus, tmp_path):
    from transformers import Gemma4AssistantForCausalLM

    from gemma_spec_ros.engine.runtime.model import checkpoints

    out = tmp_path / 'ordered'
    assert main(['ordered-head', '--target', tiny_models.target, '--assistant', tiny_models.assistant,
                 '--input', str(tiny_corpus), '--eval-input', str(STDLIB / 'glob.py'), '--centroids', '16',
                 '--top-k', '4', '--greedy-windows', '2', '--greedy-prompt-len', '8', '--held-out-windows', '1',
                 '--seq-len', '32', '--draft-steps', '2', '--epochs', '2', '--kmeans-iterations', '2',
                 '--greedy-cache', str(tmp_path / 'greedy.pt'), '--threads', '1', '--device', 'cpu',
                 '--storage-dtype', 'float32', '--out', str(out)]) == 0
    assistant = Gemma4AssistantForCausalLM.from_pretrained(out)
    original = Gemma4AssistantForCausalLM.from_pretrained(tiny_models.assistant)
    config = assistant.config
    assert config.use_ordered_embeddings and (config.num_centroids, config.centroid_intermediate_top_k) == (16, 4)
    ordering = assistant.masked_embedding.token_ordering
    assert sorted(ordering.tolist()) == list(range(config.get_text_config().vocab_size))
    torch.testing.assert_close(assistant.pre_projection.weight, original.pre_projection.weight)  # only the head
    report = json.loads((out / 'training.json').read_text())['ordered_head']
    assert report['head_rows_read'] == 16 + 4 * config.get_text_config().vocab_size // 16
    assert 0 <= report['held_out_agreement']['code']['same_as_full_head'] <= 1
    assert checkpoints.load_assistant(str(out), torch.device('cpu'), torch.float32).masked_embedding is not None
    assert (tmp_path / 'greedy.pt').exists()


def test_greedy_windows_are_reused_only_when_made_the_same_way(tiny_models, tiny_corpus, tmp_path, capsys):
    common = ['assistant', '--target', tiny_models.target, '--input', str(tiny_corpus), '--shape', '1x32x64',
              '--steps', '1', '--greedy-windows', '2', '--greedy-prompt-len', '8', '--greedy-cache',
              str(tmp_path / 'greedy.pt'), '--out', str(tmp_path / 'out'), '--run-dir', str(tmp_path / 'run'), *TINY]
    assert main(common) == 0
    assert main(common) == 0
    assert 'greedy windows: 2 of the 2 in' in capsys.readouterr().out
    assert main([*common, '--seed', '3']) == 0   # other windows: made again
    assert 'greedy windows: 2 of the 2 in' not in capsys.readouterr().out


def test_eval_planner_reports_phrasings_and_thinking_apart(tiny_target, tmp_path, capsys):
    out = tmp_path / 'planner.json'
    assert main(['eval-planner', '--target', str(tiny_target), '--conversations', '4', '--max-calls', '1',
                 '--threads', '1', '--out', str(out)]) == 0
    report = json.loads(out.read_text())
    groups = report['exact_by_group']
    assert set(groups) == {'trained phrasings', 'unseen phrasings', 'thinking', 'no thinking'}
    for pair in (('trained phrasings', 'unseen phrasings'), ('thinking', 'no thinking')):
        assert sum(groups[name]['conversations'] for name in pair) == report['conversations'] == 4
    assert 'exact by group: trained phrasings' in capsys.readouterr().out


@pytest.mark.parametrize('argv, message', [
    (['--novel-share', '1.5'], '--novel-share must be within 0 and 1'),
    (['--kind-weights', 'fly=1'], "--kind-weights: unknown request kind 'fly'"),
])
def test_planner_corpus_refuses_bad_mixes_naming_the_flag(argv, message, tmp_path, capsys):
    assert main(['planner-corpus', '--conversations', '2', '--out', str(tmp_path / 'c.jsonl'), *argv]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / 'c.jsonl').exists()


@pytest.mark.parametrize('argv, message', [
    (['target', '--input', '/no/such/corpus', '--steps', '1'], 'does not exist'),
    (['target', '--shape', '8x256', '--steps', '1'], 'LAYERSxHIDDENxINTERMEDIATE'),
    (['assistant', '--target', '/no/such/model'], 'no tokenizer'),
    (['target', '--steps', '0'], 'must be positive'),
])
def test_bad_input_gives_clear_error(argv, message, tiny_corpus, capsys, tmp_path):
    if '--input' not in argv and argv[0] == 'target':
        argv = [*argv, '--input', str(tiny_corpus)]
    assert main([*argv, '--run-dir', str(tmp_path), '--out', str(tmp_path / 'out')]) == 2
    assert message in capsys.readouterr().err


def test_resume_without_checkpoint_is_refused(tiny_corpus, tmp_path, capsys):
    assert main(['target', '--input', str(tiny_corpus), '--shape', '1x32x64', '--steps', '2', '--resume',
                 '--run-dir', str(tmp_path / 'empty'), '--out', str(tmp_path / 'out'), *TINY]) == 2
    assert 'no checkpoint' in capsys.readouterr().err


def test_assistant_trains_for_multimodal_target_with_per_layer_inputs(tiny_corpus, tmp_path):
    """Real Gemma 4 checkpoints load as Gemma4ForConditionalGeneration and use per-layer inputs (PLE)."""
    from transformers import AutoTokenizer, Gemma4AssistantForCausalLM, Gemma4Config, Gemma4ForConditionalGeneration

    from gemma_spec_ros.train.shapes import ModelShape, text_config

    text = text_config(ModelShape(2, 64, 128, sliding_window=8), 4096)
    text.hidden_size_per_layer_input, text.vocab_size_per_layer_input = 16, 4096
    torch.manual_seed(0)
    target = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=None,
                                                         audio_config=None))
    target.save_pretrained(tmp_path / 'target')
    AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / 'models' / 'tokenizer').save_pretrained(
        tmp_path / 'target')
    assert main(['assistant', '--target', str(tmp_path / 'target'), '--input', str(tiny_corpus), '--shape',
                 '1x32x64', '--steps', '2', '--greedy-windows', '2', '--greedy-prompt-len', '8',
                 '--out', str(tmp_path / 'assistant'), '--run-dir', str(tmp_path / 'run'), *TINY]) == 0
    assistant = Gemma4AssistantForCausalLM.from_pretrained(tmp_path / 'assistant')
    assert assistant.config.get_text_config().hidden_size_per_layer_input == 0
