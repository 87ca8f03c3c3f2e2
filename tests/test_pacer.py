"""The pacer's two calls (spekit.pacing.Pacer): before proposing, `budget` says how deep each row may draft and
at what price; after deciding, `settle` takes what the step cost and returned. No model needed."""
import time

from spekit.pacing import Pacer
from spekit.pacing.governor import Governor
from spekit.pacing.priors import PRIOR, bucket, context_bucket, prior_cost
from spekit.pacing.step_costs import StepCosts

GOVERNOR_ALLOWS = Governor.allows        # the real one (conftest switches it off for the other tests)


def test_a_held_governor_gives_every_row_a_zero_budget_for_its_hold_then_the_rooms_again(monkeypatch):
    monkeypatch.setattr(Governor, "allows", GOVERNOR_ALLOWS)
    pacer = Pacer(StepCosts(), speculates=True)
    pacer.governor.held = 2
    rooms = [pacer.budget([8, 5], [10, 12], greedy=True, context=12).room for _ in range(3)]
    assert rooms == [[0, 0], [0, 0], [8, 5]]
    assert pacer.budget([8, 5], [10, 12], greedy=True, context=12, step=False).room == [8, 5]   # not a step
    pacer.governor.held = 2                                    # sampling: never held (off the clock)
    assert pacer.budget([8, 5], [10, 12], greedy=False, context=12).room == [8, 5]
    pacer.governed = False                                     # flat costs, a drafter's tau measured: never held
    assert pacer.budget([8, 5], [10, 12], greedy=True, context=12).room == [8, 5]


def test_a_static_batch_budgets_only_its_rows_furthest_from_their_end():
    pacer = Pacer(StepCosts(), speculates=True)
    budget = pacer.budget([8, 8, 8], [10, 10, 10], greedy=True, context=10, left=[4, 9, 2])
    assert budget.room == [0, 8, 0] and budget.counted() == [1]
    assert pacer.budget([8, 8, 8], [10, 10, 10], greedy=True, context=10).counted() == [0, 1, 2]   # a server's


def test_settle_records_what_the_step_cost_and_returned():
    """The clock's verification time becomes the measured cost of that width at that batch and context; settle
    gives the governor the step's tokens and seconds (greedy only); sampled steps are priced by the prior."""
    costs = StepCosts()
    pacer = Pacer(costs, speculates=True)
    budget = pacer.budget([8, 8], [100, 100], greedy=True, context=100)
    clock = pacer.clock(budget, context=100)
    time.sleep(0.002)
    clock.drafted()
    assert budget.draft_s >= 0.002
    time.sleep(0.002)
    clock.verified(width=4)
    assert costs.recent[(bucket(2), 4, context_bucket(100))][-1] == clock.verify_s >= 0.002
    clock.resume()
    pacer.settle(clock, depths=[3, 3], drafted=True, gained=[[1, 2, 3], [1]], most_left=(10, 9))
    tokens, seconds, steps, _ = pacer.governor.spec[(bucket(2), context_bucket(100))]
    assert (tokens, steps) == (4, 1) and seconds >= 0.004
    sampled = pacer.budget([8, 8], [100, 3000], greedy=False, context=3000)
    assert sampled.cost(4) == prior_cost(4, table=PRIOR) and sampled.plain_s is None
    assert sampled.row_cost(1)(16) == prior_cost(16, table=PRIOR, context=3000)


def test_a_chain_drafters_rows_are_sized_by_the_pacer_on_steps_only():
    pacer = Pacer(StepCosts(), speculates=True)
    pacer.begin(2, greedy=False, chain=(4, 8), draft_cost=0.0)
    assert pacer.budget([8, 8], [10, 10], greedy=False, context=10, step=False).widths is None
    widths = pacer.budget([8, 2], [10, 10], greedy=False, context=10).widths
    assert widths[0] > 0 and widths[1] <= 2
    pacer.select_rows([1])
    assert len(pacer.budget([8], [10], greedy=False, context=10).widths) == 1
