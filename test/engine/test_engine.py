"""The engine on tiny random Gemma 4 models: greedy parity with transformers, streaming, stops, cancel, seeds."""

import math
import random
import threading
import time

import pytest
import torch
from conftest import ON_TEST_DEVICE, TEST_COMPILE, TEST_DEVICE, corrupt_after

from gemma_spec_ros.engine import CancelToken, Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.engine.decoding.stream import IncrementalDetokenizer, StopStrings

CODE_PROMPT = 'def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n'
STORY_PROMPT = 'The robot picked up the red cube and'
LONG = 72  # new tokens: several times the fixtures' sliding_window (16)


@pytest.fixture(scope='module')
def ordered_engine(tiny_models):
    return Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='mtp',
                                           assistant_path=tiny_models.assistant_ordered, compile=TEST_COMPILE,
                                           **ON_TEST_DEVICE))


def ids_of(engine, prompt):
    return engine.tokenizer(prompt).input_ids


@pytest.mark.parametrize('path', ['fast', 'transformers'])
@pytest.mark.parametrize(('drafter', 'k'), [('none', 0)] + [(drafter, k) for drafter in ('ngram', 'lookahead', 'draft',
                                                                                         'mtp') for k in range(1, 9)])
def test_greedy_parity_with_transformers(request, reference, path, drafter, k):
    # the fast path (lean forward, static cache) and engine.compile off (transformers' forward, DynamicCache)
    tiny_engine = request.getfixturevalue('tiny_engine' if path == 'fast' else 'tiny_engine_off')
    prompt = CODE_PROMPT if drafter in ('ngram', 'lookahead') else STORY_PROMPT
    expected = reference(ids_of(tiny_engine, prompt), LONG)
    result = tiny_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=LONG, drafter=drafter,
                                                    num_draft_tokens=k))
    assert result.token_ids == expected
    assert result.stats.drafter == drafter and not result.warnings


@pytest.mark.parametrize('drafter', ['ngram', 'lookahead', 'draft', 'mtp'])
def test_greedy_parity_adaptive_k(tiny_engine, reference, drafter):
    expected = reference(ids_of(tiny_engine, CODE_PROMPT), LONG)
    for _ in range(2):  # the second request starts from the controller's learned state
        result = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=LONG, drafter=drafter))
        assert result.token_ids == expected


def test_ngram_accepts_on_repetitive_prompt(tiny_engine, reference):
    result = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=LONG, drafter='ngram',
                                                    num_draft_tokens=4))
    stats = result.stats
    assert stats.accepted_tokens > 0 and stats.tau > 1.0
    by_length = stats.rounds_by_draft_length  # n-gram rounds draft what the prompt matches: 0..K
    assert len(by_length) <= 5 and sum(by_length) == stats.target_passes - 1
    assert sum(k * rounds for k, rounds in enumerate(by_length)) == stats.drafted_tokens


@pytest.mark.parametrize('k', [1, 3, 8])
def test_agreeing_drafter_accepts_everything(agreeing_engine, reference, k):
    expected = reference(ids_of(agreeing_engine, STORY_PROMPT), LONG)
    result = agreeing_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=LONG,
                                                        num_draft_tokens=k))
    assert result.token_ids == expected
    stats = result.stats
    assert stats.acceptance_rate == 1.0 and stats.per_position_acceptance == [1.0] * k
    assert stats.target_passes == 1 + math.ceil((LONG - 1) / (k + 1))
    assert stats.tau == pytest.approx((LONG - 1) / (stats.target_passes - 1))
    by_length = stats.rounds_by_draft_length  # every round drafts K but the last, which the token budget may cut
    assert sum(by_length) == stats.target_passes - 1 and by_length[k] >= sum(by_length) - 1
    assert sum(n * rounds for n, rounds in enumerate(by_length)) == stats.drafted_tokens


def test_agreeing_drafter_sampled_proposals_are_accepted(agreeing_engine):
    # proposals sampled from the drafter's own processed distribution, which equals the target's here
    result = agreeing_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=40, temperature=0.9,
                                                        top_p=0.95, top_k=40, seed=11, num_draft_tokens=4))
    assert result.stats.acceptance_rate > 0.9 and result.stats.tau > 3.0


def test_ordered_embedding_assistant_parity(ordered_engine, reference):
    expected = reference(ids_of(ordered_engine, STORY_PROMPT), LONG)
    for k in (2, 5):
        result = ordered_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=LONG,
                                                           num_draft_tokens=k))
        assert result.token_ids == expected and result.stats.drafter == 'mtp'


@pytest.mark.parametrize('drafter', ['none', 'ngram', 'lookahead', 'draft', 'mtp'])
def test_seed_determinism_and_sampling_stats(tiny_engine, drafter):
    request = GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=40, temperature=0.8, top_p=0.9, top_k=50, seed=3,
                                drafter=drafter, num_draft_tokens=3)
    first, second = tiny_engine.generate(request), tiny_engine.generate(request)
    assert first.token_ids == second.token_ids and first.text == second.text
    other = tiny_engine.generate(GenerationRequest(**{**request.__dict__, 'seed': 4}))
    assert other.token_ids != first.token_ids
    stats = first.stats
    assert stats.new_tokens == 40 and stats.prompt_tokens == len(ids_of(tiny_engine, CODE_PROMPT))
    assert stats.tau == pytest.approx(39 / (stats.target_passes - 1))
    assert stats.process_peak_rss_bytes > 0 and stats.wall_time > 0 and stats.tokens_per_second > 0
    assert 0 <= stats.inter_token_latency_p50 <= stats.inter_token_latency_p95


def test_streaming_one_delta_per_round_and_text_matches(tiny_engine):
    deltas = []
    result = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=50, drafter='ngram',
                                                    num_draft_tokens=4), on_delta=deltas.append)
    assert len(deltas) == result.stats.target_passes  # prefill + one per verify round, never coalesced
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert ''.join(d.text for d in deltas) == result.text
    assert result.text == tiny_engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert deltas[-1].tokens_generated == 50 and result.finish_reason == 'length'
    assert any(len(d.token_ids) > 1 for d in deltas)


def test_cancel_from_the_stream_releases_the_engine(tiny_engine):
    cancel = CancelToken()
    deltas = []
    result = tiny_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=900, drafter='none'),
                                  on_delta=lambda delta: (deltas.append(delta), cancel.cancel()), cancel=cancel)
    assert result.finish_reason == 'cancelled' and len(deltas) <= 2
    assert result.token_ids == [t for d in deltas for t in d.token_ids]
    started = time.monotonic()
    result = tiny_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=2, drafter='none'))
    assert len(result.token_ids) == 2 and time.monotonic() - started < 5  # the lock was released quickly


def test_incremental_detokenizer_never_emits_broken_utf8(tiny_engine):
    text = 'Grüße, 日本の🤖 robots! Ünïcödé ✓'
    ids = tiny_engine.tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.encode()) // 4  # multi-byte chars span several byte-level tokens
    detokenizer = IncrementalDetokenizer(tiny_engine.tokenizer)
    pieces = [detokenizer.add([token]) for token in ids] + [detokenizer.flush()]
    assert all('\ufffd' not in piece for piece in pieces)
    assert ''.join(pieces) == text
    assert sum(1 for piece in pieces if piece == '') > 0  # held back while a character was incomplete


def test_incremental_detokenizer_streams_what_the_tokenizers_decode_gives(tiny_engine):
    """A fast tokenizer is decoded through its Rust tokenizer directly: the same pieces as its decode() gives."""
    tokenizer = tiny_engine.tokenizer

    class DecodeOnly:  # not a fast tokenizer: IncrementalDetokenizer calls its decode()
        def decode(self, *args, **kwargs):
            return tokenizer.decode(*args, **kwargs)

    generator = random.Random(0)
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    ids = tokenizer('Grüße, 日本の🤖 robots!\n\tdef f(x):  return x', add_special_tokens=False).input_ids
    ids += [generator.choice(specials) if generator.random() < 0.1 else generator.randrange(len(tokenizer))
            for _ in range(300)]
    fast, reference = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(DecodeOnly())
    rounds, start = [], 0
    while start < len(ids):  # rounds of 1-4 tokens, as verify rounds bring them
        size = generator.randint(1, 4)
        rounds.append(ids[start:start + size])
        start += size
    assert [fast.add(r) for r in rounds] + [fast.flush()] == [reference.add(r) for r in rounds] + [reference.flush()]


def test_stop_strings_across_chunk_boundaries():
    stops = StopStrings(['STOP', 'halt!'])
    emitted = [stops.feed(piece) for piece in ['go ST', 'O', 'ne', ' ha', 'lt', '! tail']]
    assert ''.join(emitted) == 'go STOne ' and stops.stopped
    stops = StopStrings(['STOP'])
    assert stops.feed('abc S') == 'abc ' and stops.feed('T') == '' and stops.flush() == 'ST'


def test_stop_string_spanning_rounds(tiny_engine):
    deltas = []
    base = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=40, drafter='ngram',
                                                  num_draft_tokens=4), on_delta=deltas.append)
    # a stop string made of the end of one round's text and the start of the next
    offsets, position = [], 0
    for delta in deltas:
        position += len(delta.text)
        offsets.append(position)
    boundary = next(o for o in offsets[1:-1] if 2 <= o <= len(base.text) - 2 and base.text[o - 2:o + 2].strip())
    stop = base.text[boundary - 2:boundary + 2]
    seen = []
    result = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=40, drafter='ngram',
                                                    num_draft_tokens=4, stop=[stop]), on_delta=seen.append)
    assert result.finish_reason == 'stop'
    assert result.text == base.text[:base.text.find(stop)]
    assert ''.join(d.text for d in seen) == result.text


def test_cancel_from_another_thread(tiny_engine):
    cancel = CancelToken()
    first_delta = threading.Event()
    outcome = {}

    def run():
        outcome['result'] = tiny_engine.generate(
            GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=500, drafter='none'),
            on_delta=lambda delta: first_delta.set(), cancel=cancel)

    worker = threading.Thread(target=run)
    worker.start()
    assert first_delta.wait(60)
    cancel.cancel()
    worker.join(60)
    result = outcome['result']
    assert result.finish_reason == 'cancelled' and 0 < len(result.token_ids) < 500


def test_eos_stops_generation(tiny_engine, monkeypatch):
    plain = tiny_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=12, drafter='none'))
    # the rounds' stop ids: one token of the plain output becomes an EOS
    monkeypatch.setattr(tiny_engine._rounds, 'eos_ids', set(tiny_engine.eos_token_ids) | {plain.token_ids[5]})
    result = tiny_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=12, drafter='ngram'))
    assert result.finish_reason == 'stop' and result.token_ids == plain.token_ids[:plain.token_ids.index(
        plain.token_ids[5]) + 1]


def test_chat_messages_use_template(tiny_engine):
    messages = [{'role': 'user', 'content': 'pick up the cube'}]
    result = tiny_engine.generate(GenerationRequest(messages=messages, max_new_tokens=4, drafter='none'))
    text = tiny_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert result.stats.prompt_tokens == len(tiny_engine.tokenizer(text, add_special_tokens=False).input_ids)


def test_status_reports_controller(tiny_engine):
    tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=8))  # whatever ran before
    status = tiny_engine.status()
    assert status.target_id == 'target' and status.device == TEST_DEVICE and status.dtype == 'float32'
    assert status.drafter == 'ngram' and status.num_draft_tokens >= 1 and status.tau_lifetime >= 1.0


def test_plain_generations_leave_the_lifetime_tau_alone(tiny_engine):
    speculative = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=16, drafter='ngram'))
    assert speculative.stats.drafter == 'ngram'
    before = tiny_engine.status()
    plain = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=16, drafter='none'))
    after = tiny_engine.status()
    assert plain.stats.tau == 1.0 and before.tau_lifetime >= 1.0
    assert [after.tau_lifetime, after.acceptance_rate_lifetime] == pytest.approx(
        [before.tau_lifetime, before.acceptance_rate_lifetime], nan_ok=True)  # NaN: nothing drafted yet


def test_cuda_timing_reads_an_event_only_once_it_completed():
    from gemma_spec_ros.engine.decoding.calibration import Stopwatch

    class Event:  # as torch.cuda.Event: elapsed_time raises until the end event has completed
        def __init__(self):
            self.completed = False

        def synchronize(self):
            self.completed = True

        def elapsed_time(self, end):
            if not end.completed:
                raise RuntimeError('Both events must be completed before calculating elapsed time.')
            return 250.0

    assert Stopwatch(torch.device('cuda')).seconds(Event(), Event()) == 0.25


def test_profit_gate_pauses_useless_drafter(tiny_models):
    engine = Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='draft',
                                             draft_model_path=tiny_models.draft, probe_interval=8,
                                             **ON_TEST_DEVICE))
    result = engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=60))
    status = engine.status()
    # random weights accept almost nothing: speculation must pause and most rounds run plain
    assert not status.speculating
    assert result.stats.mean_num_draft_tokens < 2 and result.stats.paused_rounds > 20
    assert status.break_even_tau > 1.0


def test_engine_times_its_verify_passes_when_it_loads(tiny_models):
    engine = Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='draft',
                                             draft_model_path=tiny_models.draft, max_draft_tokens=4,
                                             compile=TEST_COMPILE, **ON_TEST_DEVICE))
    curve = engine.calibrate_verify_costs(rounds=2)
    assert sorted(curve) == [1, 2, 3, 4, 5] and all(seconds > 0 for seconds in curve.values())
    # the controller starts from that curve: its first round drafts (no plain round to time plain decoding first),
    # the one round that leaves room for a draft among 3 new tokens
    result = engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=3))
    assert result.stats.drafted_tokens > 0


def test_multimodal_checkpoint_generates_through_language_model(tiny_models, tiny_engine, tmp_path):
    # real Gemma 4 checkpoints load as Gemma4ForConditionalGeneration; text goes through its language model
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    text = Gemma4ForCausalLM.from_pretrained(tiny_models.target)
    multimodal = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.config.to_dict())).eval()
    multimodal.model.language_model.load_state_dict(text.model.state_dict())
    multimodal.generation_config.eos_token_id = tiny_engine.tokenizer.eos_token_id
    multimodal.save_pretrained(tmp_path / 'multimodal')
    tiny_engine.tokenizer.save_pretrained(tmp_path / 'multimodal')
    engine = Engine.from_config(EngineConfig(target_path=str(tmp_path / 'multimodal'), drafter='mtp',
                                             assistant_path=tiny_models.assistant, **ON_TEST_DEVICE))
    expected = tiny_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=30, drafter='none'))
    for drafter in ('none', 'mtp'):
        result = engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=30, drafter=drafter,
                                                   num_draft_tokens=3))
        assert result.token_ids == expected.token_ids and result.stats.drafter == drafter


def test_ngram_proposals():
    from gemma_spec_ros.engine.drafters.base import DraftContext
    from gemma_spec_ros.engine.drafters.ngram import NgramDrafter
    from gemma_spec_ros.engine.logits.sampling import SamplingParams

    drafter = NgramDrafter(1, 3, torch.device('cpu'))
    drafter.start([])

    def propose(tokens, k):
        proposal = drafter.propose(DraftContext(tokens, torch.tensor(tokens[-1:]), SamplingParams(), None), k)
        return None if proposal is None else proposal.tokens.tolist()

    assert propose([5, 6, 7, 9, 5, 6], 2) == [7, 9]
    drafter.start([])
    assert propose([1, 2, 1, 2], 3) == [1, 2, 1]  # periodic continuation
    drafter.start([])
    assert propose([1, 2, 3], 2) is None
    assert propose([1, 2, 3, 4, 2], 3) == [3, 4, 2]  # index extended incrementally; latest match wins


def test_lookahead_drafts_from_the_text_and_from_the_target_predictions_of_its_passes():
    from gemma_spec_ros.engine.drafters.base import DraftContext
    from gemma_spec_ros.engine.drafters.lookahead import LookaheadDrafter
    from gemma_spec_ros.engine.logits.sampling import SamplingParams
    from gemma_spec_ros.engine.runtime import StepOutput

    drafter = LookaheadDrafter(1, 2, torch.device('cpu'), placeholders=frozenset({99}))
    drafter.start([])

    def propose(tokens, k):
        proposal = drafter.propose(DraftContext(tokens, torch.tensor(tokens[-1:]), SamplingParams(), None), k)
        return None if proposal is None else proposal.tokens.tolist()

    def pass_predicting(predicted, vocab=100):
        return StepOutput(torch.nn.functional.one_hot(torch.tensor([predicted]), vocab).float(), None)

    assert propose([1, 2, 3], 2) is None   # nothing seen after 3
    drafter.start([])
    assert propose([5, 6, 7, 5, 6], 3) == [7, 5, 6]   # the text's n-grams, walked: (5, 6) 7, (6, 7) 5, (7, 5) 6
    # the pass fed 6, 7, 5, 6; the target predicted 7, 8, 40, 41: 7 kept, 8 next, behind the cut 40 and 41
    drafter.observe(pass_predicting([7, 8, 40, 41]), num_fed=4, num_kept=2)
    # after the new last token 8 the pool knows nothing: the Jacobi guesses behind the cut
    assert propose([5, 6, 7, 5, 6, 7, 8], 2) == [40, 41]
    drafter.observe(pass_predicting([40, 42, 43]), num_fed=3, num_kept=2)
    # the first pass's rejected position taught (7, 5) -> 40, over the text's (7, 5) -> 6
    assert propose([5, 6, 7, 5, 6, 7, 8, 40, 42, 7, 5], 1) == [40]
    drafter.observe(pass_predicting([50]), num_fed=1, num_kept=1)   # a pass of another drafter: nothing pooled
    assert propose([5, 6, 7, 5, 6, 7, 8, 40, 42, 7, 5, 50], 2) is None
    drafter.start([])   # a new request forgets the pool
    assert propose([8, 40], 1) is None
    assert propose([8, 40, 99, 8], 2) == [40]   # never an image placeholder


def test_mtp_drafter_drops_rejected_kv(tiny_engine_off):
    from gemma_spec_ros.engine.runtime import StepOutput

    drafter = tiny_engine_off._drafters['mtp']  # transformers' path: the assistant gets the shared K/V
    keys = torch.arange(20.0).view(1, 1, 20, 1)
    out = StepOutput(None, torch.arange(5.0).view(1, 5, 1),
                     {'sliding_attention': (keys, keys), 'full_attention': (keys, keys)})
    drafter.observe(out, num_fed=5, num_kept=2)  # 1 draft accepted, 3 rejected
    assert drafter._hidden.flatten().tolist() == [1.0]
    for kv in drafter._shared_kv.values():
        assert kv[0].shape[2] == 17 and kv[0][0, 0, -1, 0] == 16.0


def test_concurrent_callers_are_serialized(tiny_engine):
    requests = [GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=20, drafter=drafter, num_draft_tokens=2)
                for drafter in ('none', 'ngram', 'draft', 'mtp')]
    expected = [tiny_engine.generate(request).token_ids for request in requests]
    results = [None] * len(requests)
    statuses = []

    def run(index):
        results[index] = tiny_engine.generate(requests[index]).token_ids
        statuses.append(tiny_engine.status())

    workers = [threading.Thread(target=run, args=(index,)) for index in range(len(requests))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert results == expected and len(statuses) == len(requests)


def test_draft_model_partial_acceptance_rolls_back(agreeing_engine, reference):
    # the draft model is the target, so its drafts are right; corrupting draft j makes exactly j of them accepted
    prompt_ids = ids_of(agreeing_engine, STORY_PROMPT)
    expected = reference(prompt_ids, LONG)
    drafter = agreeing_engine.drafter('draft')
    original = drafter.propose
    drafter.propose = lambda context, k: corrupt_after(original(context, k), len(context.tokens) % (k + 1))
    try:
        result = agreeing_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=LONG,
                                                            num_draft_tokens=4))
    finally:
        drafter.propose = original
    assert result.token_ids == expected
    assert 0.2 < result.stats.acceptance_rate < 0.9


def test_mtp_partial_acceptance_cuts_rejected_kv(tiny_engine_off, reference):
    # an oracle keeps the first j drafts right (after the assistant ran on the rolled-back K/V)
    from gemma_spec_ros.engine.drafters.base import Proposal

    tiny_engine = tiny_engine_off
    prompt_ids = ids_of(tiny_engine, STORY_PROMPT)
    expected = reference(prompt_ids, LONG)
    drafter = tiny_engine.drafter('mtp')
    original = drafter.propose
    seen_kv_lengths = []

    def oracle(context, k):
        proposal = original(context, k)
        seen_kv_lengths.append((len(context.tokens), drafter._shared_kv['full_attention'][0].shape[2]))
        done = len(context.tokens) - len(prompt_ids)
        keep = done % (k + 1)
        truth = torch.tensor(expected[done:done + k], device=proposal.tokens.device)
        return corrupt_after(Proposal(torch.cat([truth[:keep], proposal.tokens[keep:]]), None), keep)

    drafter.propose = oracle
    try:
        result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=LONG, drafter='mtp',
                                                        num_draft_tokens=4))
    finally:
        drafter.propose = original
    assert result.token_ids == expected
    assert 0.2 < result.stats.acceptance_rate < 0.9
    # the assistant sees full-attention K/V for exactly the tokens before the last one, never rejected drafts
    assert all(kv_length == num_tokens - 1 for num_tokens, kv_length in seen_kv_lengths)


@pytest.mark.parametrize('drafter', ['draft', 'mtp'])
@pytest.mark.parametrize('temperature', [0.0, 0.9])
def test_model_drafters_report_the_confidence_of_each_draft(tiny_engine, drafter, temperature):
    # greedy: the drafter's top probability; sampled: its probability of the drawn token
    from gemma_spec_ros.engine.control.cutoff import CUTOFFS
    from gemma_spec_ros.engine.drafters.base import DraftContext
    from gemma_spec_ros.engine.requests import SamplingParams

    model_drafter = tiny_engine.drafter(drafter)
    original = model_drafter.propose
    seen = []

    def propose(context: DraftContext, k):
        proposal = original(context, k)
        seen.append(proposal)
        return proposal

    model_drafter.propose = propose
    try:
        tiny_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=24, drafter=drafter,
                                               num_draft_tokens=3, temperature=temperature, seed=1))
    finally:
        model_drafter.propose = original
    assert seen
    for proposal in seen:
        confidences = proposal.confidences
        assert confidences.shape == proposal.tokens.shape and bool(((confidences > 0) & (confidences <= 1)).all())
        if proposal.draft_probs is not None:
            drawn = proposal.draft_probs.gather(-1, proposal.tokens[:, None])[:, 0]
            assert torch.allclose(confidences, drawn)
    assert (seen[0].draft_probs is None) == (SamplingParams(temperature).greedy)
    controller = tiny_engine.controller(drafter)
    uncut = controller.cutoffs.uncut
    assert uncut and all(len(r.drafted_under) == len(CUTOFFS) and 1 <= min(r.drafted_under)
                         and max(r.drafted_under) <= r.num_drafted for r in uncut)
