"""Draft sizing: speculate only where it pays for its measured cost (never slower than plain)."""
from spekit.costs import StepCosts, best_widths, expected_gain, prior_cost


def test_no_draft_when_nothing_is_accepted_or_nothing_matches():
    assert best_widths([(0.0, 0.0, 8)], lambda n: 1.0 if n == 1 else 1.2) == 0
    assert best_widths([(0.9, 0.9, 0)], lambda n: 1.0) == 0
    assert best_widths([], lambda n: 1.0) == 0


def test_long_drafts_when_copies_run_long_and_short_when_verification_is_dear():
    cheap = best_widths([(0.9, 0.95, 16)], lambda n: 1.0 + 0.02 * (n - 1))
    dear = best_widths([(0.9, 0.95, 16)], lambda n: 1.0 + 0.4 * (n - 1))
    assert cheap == 16 and 0 < dear < cheap


def test_one_width_for_a_batch_weighs_every_row():
    cost = lambda n: 1.0 + 0.3 * (n - 1)                      # noqa: E731
    alone = best_widths([(0.8, 0.8, 8)], cost)
    with_idle_rows = best_widths([(0.8, 0.8, 8)] + [(0.0, 0.0, 0)] * 7, cost)
    assert alone > 0 and with_idle_rows == 0                   # one hopeful row does not make 7 others wait


def test_expected_gain_and_costs():
    assert expected_gain(0.5, 1.0, 0) == 1.0 and expected_gain(0.5, 1.0, 3) == 2.5
    costs = StepCosts()
    assert costs.relative(1, 4) == prior_cost(4) and costs.relative(1, 1) == 1.0
    for seconds in (0.010, 0.011, 0.500, 0.010):               # a hiccup does not move the median
        costs.record(1, 1, seconds)
    for seconds in (0.015, 0.015, 0.016):
        costs.record(1, 4, seconds)
    assert abs(costs.relative(1, 4) - 1.5) < 0.1
    assert costs.relative(2, 4) == prior_cost(4, 2)            # another batch size has its own figures
