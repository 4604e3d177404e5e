"""
A drafter that fails mid-batch (injected) on tiny random models: its goals fall back, every goal ends exact.

engine.max_batch 4, four greedy goals decoded together. With every goal in the batch, a goal's own drafter (n-gram)
raises on its third proposal, or the draft rows a model drafter's goals share (MTP, draft model) raise on their third
step for both of its goals: the goals it drafted for finish with plain decoding and a DRAFTER_FALLBACK warning, the
others go on speculating, and every goal's tokens are transformers' plain greedy decoding (Rounds.call_drafter and
fall_back, BatchScheduler._propose). The model drafter's next goal drafts again, exact.
"""

import dataclasses
import threading
import time
from collections import Counter

import pytest

from gemma_spec_ros.engine import Engine, GenerationRequest
from gemma_spec_ros.engine.drafters.draft_model import DraftModelRows
from gemma_spec_ros.engine.drafters.mtp import MtpRows
from gemma_spec_ros.engine.drafters.ngram import NgramDrafter
from gemma_spec_ros.engine.types import WarningKind

MAX_BATCH = 4
FAILING_CALL = 3   # the drafter raises on its third proposal
CODE_PROMPT = 'def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n'
PROMPTS = {'failing': CODE_PROMPT, 'story': 'The robot picked up the red cube and',
           'code': 'def mul(a, b):\n    return a * b\n\ndef mul(a, b):\n', 'then': 'The robot picked up the cube then'}
NEW_TOKENS = {'failing': 40, 'story': 36, 'code': 32, 'then': 28}


@pytest.fixture(scope='module')
def batch_engine(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, max_batch=MAX_BATCH))
    yield engine
    engine.close()


def run_together(engine, requests: dict) -> tuple[dict, list[str]]:
    """Generate each named request in a thread of its own, all at once; the results and the order they streamed."""
    results, errors, order, lock = {}, {}, [], threading.Lock()

    def run(name):
        def on_delta(delta):
            with lock:
                order.append(name)
        try:
            results[name] = engine.generate(requests[name], on_delta=on_delta)
        except Exception as error:  # noqa: BLE001 (reported below: no goal may fail)
            errors[name] = error

    threads = [threading.Thread(target=run, args=(name,)) for name in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads), 'a goal never ended'
    assert errors == {}
    return results, order


def decoded_together(order: list[str], first: str, second: str) -> bool:
    """Whether a delta of second streamed between two deltas of first (or the other way round)."""
    def between(a, b):
        positions = [index for index, name in enumerate(order) if name == a]
        return any(name == b for name in order[positions[0]:positions[-1]])
    return between(first, second) or between(second, first)


def in_full_batch(engine) -> bool:
    """Whether every slot of the batch holds a goal now (the fault is injected then: mid-batch)."""
    return len(engine.batch.goal_statuses()) == MAX_BATCH


class UntilFull:
    """
    Slow each round down until the batch has once held every goal.

    On a loaded machine the first goal could finish before the last thread submits its goal; a drafter calls this
    at each proposal, so the early rounds wait a little (admission runs between rounds) and the fault still lands
    mid-batch. Greedy tokens do not depend on timing.
    """

    def __init__(self, engine, pause_s: float = 0.2, limit_s: float = 60.0):
        self.engine, self.pause_s, self.limit_s, self.full = engine, pause_s, limit_s, False
        self.started = time.monotonic()

    def __call__(self) -> None:
        self.full = self.full or in_full_batch(self.engine)
        if not self.full and time.monotonic() - self.started < self.limit_s:
            time.sleep(self.pause_s)


def fallbacks(result) -> list[str]:
    return [warning for warning in result.warnings if warning.kind is WarningKind.DRAFTER_FALLBACK]


def test_a_goal_whose_drafter_fails_mid_batch_ends_exact_and_the_others_stay_exact(batch_engine, reference,
                                                                                    monkeypatch):
    # every goal drafts with the n-gram drafter at a pinned K (a proposal every round); only the failing goal's raises
    ids = {name: batch_engine.tokenizer(prompt).input_ids for name, prompt in PROMPTS.items()}
    assert all(ids[name][:len(ids['failing'])] != ids['failing'] for name in PROMPTS if name != 'failing')
    calls, propose, until_full = Counter(), NgramDrafter.propose, UntilFull(batch_engine)

    def failing_propose(self, context, k):
        until_full()
        name = next(name for name, prompt in ids.items() if context.tokens[:len(prompt)] == prompt)
        calls[name] += 1
        if name == 'failing' and in_full_batch(batch_engine):  # its third proposal with every goal in the batch
            calls['failing in a full batch'] += 1
            if calls['failing in a full batch'] == FAILING_CALL:
                calls['failing at the fault'] = calls[name]
                raise RuntimeError('injected drafter fault')
        return propose(self, context, k)

    monkeypatch.setattr(NgramDrafter, 'propose', failing_propose)
    requests = {name: GenerationRequest(prompt=PROMPTS[name], max_new_tokens=NEW_TOKENS[name], drafter='ngram',
                                        num_draft_tokens=3) for name in PROMPTS}
    results, order = run_together(batch_engine, requests)
    for name in PROMPTS:
        assert results[name].token_ids == reference(ids[name], NEW_TOKENS[name]), name
        assert results[name].finish_reason == 'length', name
    assert calls['failing at the fault'] == calls['failing'] >= FAILING_CALL  # then plain: its drafter never ran
    failed = results['failing']
    assert len(fallbacks(failed)) == 1 and 'injected drafter fault' in fallbacks(failed)[0]
    assert failed.stats.drafter == 'none' and failed.stats.rounds_by_draft_length[0] > 0
    for name in ('story', 'code', 'then'):
        assert results[name].warnings == [] and results[name].stats.drafter == 'ngram', name
        assert calls[name] > FAILING_CALL and results[name].stats.drafted_tokens > 0, name
        assert decoded_together(order, 'failing', name), name


@pytest.mark.parametrize(('model_drafter', 'rows'), [('mtp', MtpRows), ('draft', DraftModelRows)])
def test_a_shared_drafter_failure_mid_batch_falls_back_its_goals_and_its_next_goal_drafts(
        batch_engine, reference, monkeypatch, model_drafter, rows):
    # two goals draft with a model drafter (one step of its model for both rows at once), two with the n-gram one
    drafters = {'failing': model_drafter, 'story': model_drafter, 'code': 'ngram', 'then': 'ngram'}
    ids = {name: batch_engine.tokenizer(prompt).input_ids for name, prompt in PROMPTS.items()}
    steps, propose_rows, until_full = Counter(), rows.propose_rows, UntilFull(batch_engine)

    def failing_rows(self, row_requests, batch):
        until_full()
        steps['rows'] += 1
        if len(row_requests) == 2 and in_full_batch(batch_engine):  # its third step for both goals at once
            steps['both'] += 1
            if steps['both'] == FAILING_CALL:
                steps['at the fault'] = steps['rows']
                raise RuntimeError('injected fault of the shared draft rows')
        return propose_rows(self, row_requests, batch)

    monkeypatch.setattr(rows, 'propose_rows', failing_rows)
    requests = {name: GenerationRequest(prompt=PROMPTS[name], max_new_tokens=NEW_TOKENS[name], drafter=drafter,
                                        num_draft_tokens=2) for name, drafter in drafters.items()}
    results, order = run_together(batch_engine, requests)
    for name, drafter in drafters.items():
        result = results[name]
        assert result.token_ids == reference(ids[name], NEW_TOKENS[name]), name
        if drafter == model_drafter:   # its rows raised: plain decoding from then on
            assert len(fallbacks(result)) == 1 and 'shared draft rows' in fallbacks(result)[0], name
            assert result.stats.drafter == 'none', name
        else:
            assert result.warnings == [] and result.stats.drafter == 'ngram', name
            assert decoded_together(order, 'failing', name), name
    assert steps['at the fault'] == steps['rows'] >= FAILING_CALL  # then plain: the rows never ran for them again
    # the drafter serves its next goals: they draft, exact
    again = batch_engine.generate(requests['story'])
    assert again.token_ids == results['story'].token_ids and again.warnings == []
    assert again.stats.drafter == model_drafter and again.stats.drafted_tokens > 0
