"""
Continuous batching on tiny random Gemma 4 models: batched steps, and goals decoded together, lossless.

A goal inside a batch must yield what it yields alone: the same greedy tokens as transformers' plain decoding (with
every drafter and K, goals joining mid-way, a cancel mid-batch, across sliding-window boundaries), the same tokens
for a seed whatever shares its batch, and the target's distribution when sampled.
"""

import dataclasses
import threading
from collections import Counter

import pytest
import torch
from conftest import SLIDING_WINDOW, chi_squared_p_value, target_distribution

from gemma_spec_ros.engine import CancelToken, Engine, GenerationRequest
from gemma_spec_ros.engine.config_checks import check_config
from gemma_spec_ros.engine.control import GoalPassCost, TargetCost
from gemma_spec_ros.engine.drafters.base import Drafter, Proposal
from gemma_spec_ros.engine.runtime.model import checkpoints
from gemma_spec_ros.engine.runtime.model.forward import LeanAssistant, LeanGemma4
from gemma_spec_ros.engine.runtime.steps.rows import row_bucket, row_buckets

STORY_PROMPT = 'The robot picked up the red cube and'
CODE_PROMPT = 'def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n'
LONG = 4 * SLIDING_WINDOW + 8  # new tokens: the ring wraps several times
MAX_BATCH = 4


@pytest.fixture(scope='module')
def batch_engine(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, max_batch=MAX_BATCH))
    yield engine
    engine.close()


class Recorder:
    """The order in which goals streamed, to tell that they were decoded together."""

    def __init__(self):
        self.lock = threading.Lock()
        self.order: list[str] = []

    def on_delta(self, name):
        def record(delta):
            with self.lock:
                self.order.append(name)
        return record

    def interleaved(self, first: str, second: str) -> bool:
        """Whether a delta of second arrived between two deltas of first."""
        positions = [index for index, name in enumerate(self.order) if name == first]
        return any(name == second for name in self.order[positions[0]:positions[-1]])


def run_together(engine, requests: dict, recorder: Recorder, cancels: dict | None = None,
                 start_after: dict | None = None) -> dict:
    """Generate each named request in a thread of its own, all at once (or once another goal streamed n deltas)."""
    results, threads = {}, []

    def run(name):
        if start_after and name in start_after:
            waited_for, deltas = start_after[name]
            while recorder.order.count(waited_for) < deltas:
                threading.Event().wait(0.01)
        results[name] = engine.generate(requests[name], on_delta=recorder.on_delta(name),
                                        cancel=(cancels or {}).get(name))

    for name in requests:
        threads.append(threading.Thread(target=run, args=(name,)))
        threads[-1].start()
    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_row_buckets():
    assert row_buckets(2) == [1, 2] and row_buckets(4) == [1, 2, 4] and row_buckets(6) == [1, 2, 4, 6]
    assert [row_bucket(rows, 6) for rows in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def test_a_goal_pays_its_share_of_a_batched_pass():
    # a pass of q = 1 split among the goals; each later position among the goals whose rows reach it: the ones
    # that speculate as their controllers choose (partners) reach any, the others what they reached last round
    pass_cost = TargetCost(5)
    pass_cost.calibrate({1: 4.0, 2: 5.0, 3: 8.0, 4: 8.0, 5: 10.0})
    share = GoalPassCost(pass_cost)
    assert not share.measured(1)
    share.share(pass_cost, 4, 0, [2, 3, 5])
    assert share.measured(1) and share.relative()[1:] == pytest.approx([1.0, 1.25, 2.25, 2.25, 3.25])
    share.share(pass_cost, 4, 1, [1, 3])  # one partner, a plain goal, a goal that drafted 2
    assert share.relative()[1:] == pytest.approx([1.0, 4 / 3, 7 / 3, 7 / 3 + 0, 7 / 3 + 1])
    share.share(pass_cost, 4, 0, [1, 1, 1])  # among plain goals: every later position alone
    assert share.relative()[1:] == pytest.approx([1.0, 2.0, 5.0, 5.0, 7.0])
    share.share(pass_cost, 1, 0, [])  # alone: the whole pass
    assert share.relative()[1:] == [4.0, 5.0, 8.0, 8.0, 10.0]
    share.record_pass(3)
    assert share.last_seconds == share.seconds(3) == 8.0 * pass_cost.load


def test_batched_step_matches_single_sequence_steps(tiny_models):
    # rows of different lengths, padded, in slots of different lengths, across the sliding window, with rollbacks
    model = checkpoints.load_causal_lm(tiny_models.target, 'target', torch.device('cpu'), torch.float32)
    lean = LeanGemma4(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (1, length), generator=generator) for length in (3, 25, 11)]
    singles = [lean.new_cache(256, 5) for _ in prompts]
    slotted = lean.new_slotted_cache(4, 256, 5)
    with torch.inference_mode():
        for index, prompt in enumerate(prompts):
            lean.prefill(prompt, singles[index], 0, 1)
            lean.prefill(prompt, slotted.slots[index], 0, 1)
        for round_index in range(40):
            widths = [1 + (round_index + index) % 5 for index in range(len(prompts))]
            width = max(widths)
            input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
            starts = [slotted.slots[index].length for index in range(len(prompts))]
            expected = []
            for index, cache in enumerate(singles):
                tokens = torch.randint(3, 1000, (1, widths[index]), generator=generator)
                positions = torch.arange(cache.length, cache.length + widths[index])
                expected.append(lean.step(tokens, positions, cache, cache.length + widths[index], 0).logits[0])
                cache.advance(cache.length, widths[index])
                input_ids[index, :widths[index]] = tokens[0]
            positions = torch.tensor(starts)[:, None] + torch.arange(width)
            logits = lean.step_rows(input_ids, positions, slotted, max(starts) + width, width).logits
            for index, cache in enumerate(singles):
                slot = slotted.slots[index]
                slot.advance(starts[index], width)
                slot.crop(-(width - widths[index]))  # the padding is dropped like rejected drafts
                torch.testing.assert_close(logits[index, :widths[index]], expected[index], rtol=1e-4, atol=1e-4)
                if round_index % 4 == index:  # a rejected draft: both roll back one token
                    cache.crop(-1)
                    slot.crop(-1)
    assert min(cache.length for cache in singles) > 3 * SLIDING_WINDOW


@pytest.mark.parametrize('assistant', ['assistant', 'assistant_ordered'])
def test_batched_mtp_step_matches_single_steps(tiny_models, assistant):
    # each row drafts from its own slot of the target's slotted cache, as the single step does from that slot
    target = LeanGemma4(checkpoints.load_causal_lm(tiny_models.target, 'target', torch.device('cpu'), torch.float32))
    assistant_model = checkpoints.load_assistant(getattr(tiny_models, assistant), torch.device('cpu'), torch.float32)
    lean = LeanAssistant(assistant_model, target)
    generator = torch.Generator().manual_seed(1)
    slotted = target.new_slotted_cache(4, 256, 5)
    lengths = (7, 3 * SLIDING_WINDOW + 5, 20)
    with torch.inference_mode():
        for slot, length in enumerate(lengths):
            target.prefill(torch.randint(3, 1000, (1, length), generator=generator), slotted.slots[slot], 0, 1)
        token_ids = torch.randint(3, 1000, (4, 1), generator=generator)
        hidden = torch.randn((4, 1, target.hidden_size), generator=generator)
        positions = torch.tensor([[length] for length in lengths] + [[1]])
        rows = lean.step_rows(token_ids, hidden, positions, slotted, max(lengths) + 1)
        for slot, length in enumerate(lengths):
            single = lean.step(token_ids[slot:slot + 1], hidden[slot:slot + 1], positions[slot], slotted.slots[slot],
                               length + 1)
            torch.testing.assert_close(rows.logits[slot], single.logits[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(rows.hidden[slot], single.hidden[0], rtol=1e-4, atol=1e-4)


def test_engine_serves_several_goals_at_once(batch_engine, tiny_engine):
    assert batch_engine.capabilities.max_concurrent_goals == MAX_BATCH
    assert tiny_engine.capabilities.max_concurrent_goals == 1
    batched, single = batch_engine.status(), tiny_engine.status()
    assert batched.kv_cache_bytes >= single.kv_cache_bytes + MAX_BATCH * batched.kv_cache_slot_bytes  # slots too
    assert batched.kv_cache_slot_bytes == batch_engine.batch.rows.cache.slot_nbytes > 0 == single.kv_cache_slot_bytes


def test_the_slots_follow_from_the_kv_budget(tiny_engine_config, batch_engine):
    # engine.max_batch 0: as many slots as engine.batch_kv_budget_mb holds at engine.context_limit
    slot_mib = batch_engine.status().kv_cache_slot_bytes / 2 ** 20
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, max_batch=0, batch_kv_budget_mb=3.5 * slot_mib,
                                                    warmup='off'))
    try:
        status = engine.status()
        assert engine.capabilities.max_concurrent_goals == status.batch_slots == 3
        assert 3 * status.kv_cache_slot_bytes <= 3.5 * slot_mib * 2 ** 20
        assert status.kv_cache_bytes >= 3 * status.kv_cache_slot_bytes
        result = engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=6, drafter='none'))
        assert len(result.token_ids) == 6
    finally:
        engine.close()
    with pytest.raises(ValueError, match=r'batch_kv_budget_mb=.* holds 1 KV-cache slot\(s\) of .* a batch needs 2'):
        Engine.from_config(dataclasses.replace(tiny_engine_config, max_batch=0, batch_kv_budget_mb=1.5 * slot_mib))


@pytest.mark.parametrize(('changes', 'message'), [
    ({'max_batch': 0}, r'max_batch=0 sizes the batch by engine.batch_kv_budget_mb'),
    ({'max_batch': 2, 'batch_kv_budget_mb': 100.0}, r'batch_kv_budget_mb=100.0 MiB applies only with .*max_batch=0'),
    ({'max_batch': 0, 'batch_kv_budget_mb': 100.0, 'backend': 'vllm'}, r'max_batch=0 .* is for the local backend'),
])
def test_batch_size_rules(tiny_engine_config, changes, message):
    with pytest.raises(ValueError, match=message):
        check_config(dataclasses.replace(tiny_engine_config, **changes))


@pytest.mark.parametrize('k', [0, 1, 3, 8])
def test_greedy_goals_in_a_batch_match_plain_decoding(batch_engine, reference, k):
    # different drafters, K (0: each goal's controller adapts it), prompts and lengths
    ids = batch_engine.tokenizer
    requests = {
        'story-none': GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=LONG, drafter='none'),
        'code-ngram': GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=LONG - 20, drafter='ngram',
                                        num_draft_tokens=k),
        'story-ngram': GenerationRequest(prompt=STORY_PROMPT + ' then', max_new_tokens=30, drafter='ngram',
                                         num_draft_tokens=k),
        'code-mtp': GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=20, drafter='mtp', num_draft_tokens=k),
        'code-lookahead': GenerationRequest(prompt=CODE_PROMPT + ' x', max_new_tokens=30, drafter='lookahead',
                                            num_draft_tokens=k),
        'story-draft': GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=20, drafter='draft',
                                         num_draft_tokens=k),
    }
    recorder = Recorder()
    results = run_together(batch_engine, requests, recorder)
    for name, request in requests.items():
        expected = reference(ids(request.prompt).input_ids, request.max_new_tokens)
        assert results[name].token_ids == expected, name
    for name in ('code-ngram', 'code-mtp', 'story-draft'):  # every drafter's goals were decoded in the batch
        assert recorder.interleaved('story-none', name) or recorder.interleaved(name, 'story-none'), name


def test_a_goal_joins_a_running_batch_and_a_cancel_leaves_the_others_exact(batch_engine, reference):
    ids = batch_engine.tokenizer
    requests = {
        'first': GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=LONG, drafter='none'),
        'joins': GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=40, drafter='ngram', num_draft_tokens=4),
        'cancelled': GenerationRequest(prompt=STORY_PROMPT + ' a', max_new_tokens=LONG, drafter='none'),
    }
    cancel = CancelToken()
    recorder = Recorder()
    original = recorder.on_delta

    def on_delta(name):
        record = original(name)

        def both(delta):
            record(delta)
            if name == 'cancelled' and recorder.order.count('cancelled') == 5:
                cancel.cancel()
        return both

    recorder.on_delta = on_delta
    results = run_together(batch_engine, requests, recorder, cancels={'cancelled': cancel},
                           start_after={'joins': ('first', 10)})
    assert results['first'].token_ids == reference(ids(STORY_PROMPT).input_ids, LONG)
    assert results['joins'].token_ids == reference(ids(CODE_PROMPT).input_ids, 40)
    assert recorder.interleaved('first', 'joins')
    cancelled = results['cancelled']
    assert cancelled.finish_reason == 'cancelled' and 5 <= len(cancelled.token_ids) < LONG
    expected = reference(ids(STORY_PROMPT + ' a').input_ids, LONG)
    assert cancelled.token_ids == expected[:len(cancelled.token_ids)]


def test_a_seeded_goal_gives_the_same_tokens_whatever_shares_its_batch(batch_engine):
    request = GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=40, temperature=0.9, top_k=40, seed=11,
                                drafter='ngram', num_draft_tokens=3)
    alone = batch_engine.generate(request).token_ids
    others = {'seeded': request}
    for index in range(MAX_BATCH - 1):
        others['other{}'.format(index)] = GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=30 + 7 * index,
                                                            temperature=1.0, seed=index, drafter='none')
    results = run_together(batch_engine, others, Recorder())
    assert results['seeded'].token_ids == alone
    assert len({tuple(result.token_ids) for result in results.values()}) == len(results)


class RepeatingDrafter(Drafter):
    """
    Propose one token k times (a deterministic proposal).

    Sampled verification accepts it with the target's probability and draws the recovered token from the rest.
    """

    name = 'ngram'

    def __init__(self, token: int):
        self.token = token

    def join_batch(self, target_rows) -> list:
        return []

    def for_batch(self, slot: int) -> 'RepeatingDrafter':
        return self

    def propose(self, context, k):
        return Proposal(torch.full((k,), self.token, dtype=torch.long), None)


class DearRepeatingDrafter(RepeatingDrafter):
    """A drafter that does not pay: slow, and its drafts are never the target's pick."""

    def propose(self, context, k):
        threading.Event().wait(0.003)
        return super().propose(context, k)


class OracleDrafter(RepeatingDrafter):
    """Propose the target's own greedy continuation of whichever sequence the goal is on: every draft is accepted."""

    name = 'draft'

    def __init__(self, sequences: list[list[int]]):
        self.sequences = sequences

    def propose(self, context, k):
        sequence = next(ids for ids in self.sequences if ids[:len(context.tokens)] == context.tokens)
        drafts = sequence[len(context.tokens):len(context.tokens) + k]
        return Proposal(torch.tensor(drafts, dtype=torch.long), None) if drafts else None


def test_a_goal_whose_drafter_does_not_pay_runs_plain_while_the_others_speculate(batch_engine, reference,
                                                                                  monkeypatch):
    # every goal adapts K with a controller of its own, on its share of the batched passes
    ids = batch_engine.tokenizer
    prompts = {'dear': STORY_PROMPT, 'oracle0': CODE_PROMPT, 'oracle1': STORY_PROMPT + ' then'}
    lengths = {'dear': 60, 'oracle0': 200, 'oracle1': 200}
    expected = {name: reference(ids(prompt).input_ids, lengths[name]) for name, prompt in prompts.items()}
    never_picked = next(token for token in range(3, 1000) if token not in expected['dear'])
    monkeypatch.setitem(batch_engine._drafters, 'ngram', DearRepeatingDrafter(never_picked))
    monkeypatch.setitem(batch_engine._drafters, 'draft', OracleDrafter(
        [ids(prompts[name]).input_ids + expected[name] for name in ('oracle0', 'oracle1')]))
    requests = {name: GenerationRequest(prompt=prompt, max_new_tokens=lengths[name],
                                        drafter='ngram' if name == 'dear' else 'draft')
                for name, prompt in prompts.items()}
    recorder = Recorder()
    results = run_together(batch_engine, requests, recorder)
    for name in requests:
        assert results[name].token_ids == expected[name], name
    dear = results['dear'].stats
    assert dear.accepted_tokens == 0 < dear.paused_rounds
    assert dear.rounds_by_draft_length[0] > dear.target_passes / 2  # probes aside, its rounds ran plain
    for name in ('oracle0', 'oracle1'):
        stats = results[name].stats
        assert stats.paused_rounds == 0 and stats.rounds_by_draft_length[0] == 0, name
        assert stats.accepted_tokens == stats.drafted_tokens and stats.mean_num_draft_tokens > 2, name
        assert recorder.interleaved('dear', name) or recorder.interleaved(name, 'dear'), name
    # the drafter's next goal takes over what its controller learned: it opens with a probe and stays plain
    again = batch_engine.generate(requests['dear']).stats
    assert sum(again.rounds_by_draft_length[1:]) < sum(dear.rounds_by_draft_length[1:]), (again, dear)


class UnjoinableDrafter(RepeatingDrafter):
    """A drafter that fails when a goal takes a slot."""

    def for_batch(self, slot: int) -> 'RepeatingDrafter':
        raise RuntimeError('no drafter for slot {}'.format(slot))


def test_a_goal_that_fails_leaves_the_batch_serving(batch_engine, monkeypatch):
    monkeypatch.setitem(batch_engine._drafters, 'ngram', UnjoinableDrafter(5))
    with pytest.raises(RuntimeError, match='no drafter for slot'):
        batch_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=8, drafter='ngram'))
    result = batch_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=8, drafter='none'))
    assert len(result.token_ids) == 8 and result.finish_reason == 'length'


@pytest.mark.parametrize('drafter', ['repeating', 'mtp', 'draft'])
def test_sampled_goals_in_a_batch_follow_the_target_distribution(batch_engine, monkeypatch, drafter):
    temperature, top_k, length, samples = 2.0, 3, 3, 800
    prompt_ids = batch_engine.tokenizer('the the the cube the the').input_ids
    expected = target_distribution(batch_engine.target_lm.model, prompt_ids, temperature, top_k, length)
    likely_second = Counter()  # drafting the likeliest second token gets drafts accepted and rejected
    for outcome, probability in expected.items():
        likely_second[outcome[1]] += probability
    if drafter == 'repeating':  # in place of the n-gram drafter
        monkeypatch.setitem(batch_engine._drafters, 'ngram', RepeatingDrafter(likely_second.most_common(1)[0][0]))
    observed, drafted, accepted, lock = Counter(), [0], [0], threading.Lock()

    def sample(seeds):
        for seed in seeds:
            result = batch_engine.generate(GenerationRequest(
                prompt_ids=prompt_ids, max_new_tokens=length, temperature=temperature, top_k=top_k, seed=seed,
                drafter='ngram' if drafter == 'repeating' else drafter, num_draft_tokens=2))
            with lock:
                observed[tuple(result.token_ids)] += 1
                drafted[0] += result.stats.drafted_tokens
                accepted[0] += result.stats.accepted_tokens

    threads = [threading.Thread(target=sample, args=(range(start, samples, MAX_BATCH),))
               for start in range(MAX_BATCH)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert sum(observed.values()) == samples and drafted[0] > 0
    if drafter == 'repeating':  # the random models' sampled drafts are rarely accepted: this one's are
        assert 0 < accepted[0] < drafted[0]
    assert chi_squared_p_value(observed, expected) > 1e-3


def test_closing_the_engine_stops_its_scheduler(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, max_batch=2))
    assert len(engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=4, drafter='mtp')).token_ids) == 4
    scheduler = engine.batch._thread
    assert scheduler.is_alive()
    engine.close()
    assert not scheduler.is_alive()  # it let go of the engine
    with pytest.raises(RuntimeError, match='closed'):
        engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=4, drafter='none'))


def test_a_goal_arriving_while_others_run_starts_within_a_round(batch_engine):
    # each running goal streams one delta per round: the newcomer's first token comes before their second delta
    recorder = Recorder()
    running = {'run{}'.format(index): GenerationRequest(prompt=STORY_PROMPT + ' ' * index, max_new_tokens=LONG,
                                                        drafter='none') for index in range(MAX_BATCH - 1)}
    threads = [threading.Thread(target=batch_engine.generate, args=(request,),
                                kwargs={'on_delta': recorder.on_delta(name)}) for name, request in running.items()]
    for thread in threads:
        thread.start()
    while min(recorder.order.count(name) for name in running) < 3:
        threading.Event().wait(0.01)
    with recorder.lock:
        recorder.order.append('submitted')
    batch_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=4, drafter='none'),
                          on_delta=recorder.on_delta('newcomer'))
    for thread in threads:
        thread.join(120)
    order = recorder.order
    between = order[order.index('submitted'):order.index('newcomer')]
    assert all(between.count(name) <= 2 for name in running), between  # the round in progress, at most one more
