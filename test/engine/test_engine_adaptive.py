"""Adaptive K and the profit gate on simulated measurements (no models)."""

import pytest

from gemma_spec_ros.engine.control import SpeculationController, TargetCost
from gemma_spec_ros.engine.control.gate import PROBE_ROUNDS
from gemma_spec_ros.engine.stats import expected_tokens


def simulate(controller, cost, alpha_of_round, rounds, step_seconds, verify_seconds):
    """Feed the controller rounds whose drafts are accepted with probability-free, fixed prefix lengths."""
    decisions = []
    for index in range(rounds):
        decision = controller.decide()
        k = decision.num_draft_tokens
        alpha = alpha_of_round(index)
        accepted = min(k, int(round(alpha * k)))  # deterministic stand-in for acceptance
        cost.record(k + 1, verify_seconds(k + 1))
        controller.record(k, accepted, k * step_seconds)
        decisions.append(decision)
    return decisions


def test_expected_tokens_formula():
    assert expected_tokens([0.0] * 4, 4) == 1.0
    assert expected_tokens([1.0] * 4, 4) == 5.0
    for alpha in (0.3, 0.5, 0.9):
        assert expected_tokens([alpha] * 8, 5) == pytest.approx((1 - alpha ** 6) / (1 - alpha))
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_target_cost_interpolates_and_extrapolates():
    cost = TargetCost(9)
    assert cost.seconds(3) is None
    cost.record(1, 1.0)
    cost.record(5, 2.0)
    assert cost.seconds(3) == pytest.approx(1.5)
    assert cost.seconds(9) == pytest.approx(3.0)  # along the last slope
    assert cost.seconds(1) == 1.0


def test_target_cost_starts_from_a_calibrated_curve_and_keeps_learning():
    cost = TargetCost(9)
    cost.record(1, 1.0)  # a first pass, before the calibration
    cost.calibrate({1: 1.0, 3: 1.2, 5: 1.4})
    assert cost.seconds(3) == pytest.approx(1.2) and cost.seconds(4) == pytest.approx(1.3)
    cost.record(5, 2.8)  # the machine got twice as slow
    cost.record(3, 2.4)
    assert cost.seconds(5) / cost.seconds(3) == pytest.approx(1.4 / 1.2, rel=0.05) and cost.load > 1.2
    cost.record(3, 240.0)  # a stall against the calibrated curve
    assert cost.seconds(3) < 3.0


def test_target_cost_leaves_a_stall_out_but_follows_a_lasting_slowdown():
    cost = TargetCost(9)
    for _ in range(5):
        cost.record(1, 1.0)
        cost.record(5, 2.0)
    cost.record(5, 1000.0)  # a compile on first use, or the process descheduled
    assert cost.seconds(5) == pytest.approx(2.0) and cost.seconds(1) == pytest.approx(1.0)
    for _ in range(10):  # the machine is 10x slower from now on
        cost.record(1, 10.0)
        cost.record(5, 20.0)
    assert cost.seconds(1) == pytest.approx(10.0, rel=0.05)
    assert cost.seconds(5) / cost.seconds(1) == pytest.approx(2.0, rel=0.05)


def test_target_cost_measures_a_size_again_after_its_first_pass():
    cost = TargetCost(9)
    cost.record(1, 50.0)  # the first pass of the run compiled its step: no estimate yet to call it a stall
    cost.record(1, 1.0)
    cost.record(3, 1.5)
    assert cost.seconds(1) == pytest.approx(1.0) and cost.seconds(3) == pytest.approx(1.5)


def test_a_drafting_or_loop_stall_leaves_the_controller_s_costs_alone():
    cost = TargetCost(9)
    controller = SpeculationController(8, cost, profit_gate=True, probe_interval=4)

    def speculative_round(draft_seconds, round_seconds):
        cost.record(5, 2.0)
        controller.record(4, 4, draft_seconds, round_seconds=round_seconds)

    cost.record(1, 1.0)
    controller.record(0, 0, 0.0, round_seconds=1.0)
    for _ in range(20):
        speculative_round(0.4, 2.5)
    per_token, break_even = controller.draft_token_seconds, controller.break_even_tau(4)
    speculative_round(400.0, 402.5)  # the drafter's first call of a new shape compiled
    speculative_round(0.4, 300.0)    # the loop was descheduled
    assert controller.draft_token_seconds == pytest.approx(per_token, rel=0.05)
    assert controller.break_even_tau(4) == pytest.approx(break_even, rel=0.05)


def test_noisy_costs_keep_break_even_tau_at_least_one():
    cost = TargetCost(9)
    cost.record(1, 2.0)   # plain pass measured under load
    cost.record(4, 1.0)   # a longer verify pass measured when the machine was idle
    assert cost.seconds(4) == pytest.approx(2.0)
    assert cost.curve()[1:] == sorted(cost.curve()[1:])
    controller = SpeculationController(8, cost, profit_gate=True, probe_interval=4)
    controller.record(3, 3, 0.0)
    assert controller.break_even_tau(3) >= 1.0


def test_cheap_accurate_drafter_gets_long_drafts():
    cost = TargetCost(9)
    controller = SpeculationController(8, cost, profit_gate=True, probe_interval=8)
    decisions = simulate(controller, cost, lambda _: 0.95, 60, step_seconds=0.01,
                         verify_seconds=lambda n: 1.0 + 0.02 * n)
    assert decisions[0].num_draft_tokens == 0  # one plain round measures plain decoding first
    assert controller.speculating and decisions[-1].num_draft_tokens >= 6


def test_expensive_drafter_gets_short_drafts():
    cost = TargetCost(9)
    controller = SpeculationController(8, cost, profit_gate=True, probe_interval=8)
    decisions = simulate(controller, cost, lambda _: 0.7, 60, step_seconds=0.3, verify_seconds=lambda n: 1.0)
    assert controller.speculating and 1 <= decisions[-1].num_draft_tokens <= 3


def test_gate_pauses_probes_and_resumes():
    cost = TargetCost(9)
    controller = SpeculationController(8, cost, profit_gate=True, probe_interval=10)
    bad_until = 60
    decisions = simulate(controller, cost, lambda i: 0.0 if i < bad_until else 0.9, 120, step_seconds=0.2,
                         verify_seconds=lambda n: 1.0 + 0.1 * n)
    paused = decisions[20:bad_until]
    assert all(not d.speculating for d in paused)
    probes = [d for d in paused if d.num_draft_tokens > 0]
    assert 0 < len(probes) <= PROBE_ROUNDS * (len(paused) // 10 + 1)  # probes only every probe_interval rounds
    assert not controller.may_speculate_next() or controller.speculating
    assert decisions[-1].speculating and decisions[-1].num_draft_tokens > 0  # resumed after acceptance came back


def test_gate_off_always_speculates():
    cost = TargetCost(9)
    controller = SpeculationController(4, cost, profit_gate=False, probe_interval=10)
    decisions = simulate(controller, cost, lambda _: 0.0, 30, step_seconds=0.5, verify_seconds=lambda n: 1.0)
    assert all(d.num_draft_tokens >= 1 for d in decisions[1:])


def test_per_position_acceptance_limits_k():
    # the first draft is always right, later ones never: K = 1 is best even though mean acceptance is high
    cost = TargetCost(9)
    controller = SpeculationController(8, cost, profit_gate=True, probe_interval=8)
    for _ in range(3):
        simulate(controller, cost, lambda _: 0.0, 1, 0.01, lambda n: 1.0 + 0.05 * n)
    for _ in range(60):
        k = controller.decide().num_draft_tokens
        cost.record(k + 1, 1.0 + 0.05 * (k + 1))
        controller.record(k, min(k, 1), 0.05 * k)
    rates = controller.position_alpha()
    assert rates[0] > 0.9 and rates[1] < 0.2
    assert controller.best_k() == 1
    assert expected_tokens(rates, 4) < 2.3  # positions 3-4 were never judged: optimistic, but capped by position 2


def test_positions_learned_from_counts():
    controller = SpeculationController(6, TargetCost(7), profit_gate=True, probe_interval=8)
    for _ in range(200):
        controller.record(6, 3, 0.1)  # geometric-looking: judged 4, accepted 3 per round
    alpha = controller.alpha
    assert alpha == pytest.approx(0.75, abs=0.01)
    rates = controller.position_alpha()
    assert expected_tokens(rates, 3) == pytest.approx(4, abs=0.15)  # positions 1-3 always kept
    assert expected_tokens(rates, 5) < expected_tokens(rates, 3) + 0.2  # position 4 never
