"""Pacing: what a draft may cost and whether it pays. The engine asks one `Pacer` at two points of a step: before
proposing (`Pacer.budget`: how deep each row may draft, at what price) and after deciding (`Pacer.settle`: what the
step cost and returned); proposers read their `Budget` from the step context.

  priors.py      prior step costs per backend and precision (before anything is measured, and under sampling)
  step_costs.py  measured step costs (running medians by batch, width and context) and their ratios
  profiles.py    measured step costs kept between runs
  sizing.py      the draft length or tree size that gives the most tokens per unit of cost
  chains.py      per-row pacing of the chain drafters (acceptance, ceiling, drafting overhead, reading)
  odds.py        a row's odds of a chain draft's acceptance (the lookup and guessing drafters)
  trees.py       per-row pacing of the tree drafters (calibrated chances, rests, drafting overhead)
  governor.py    holds speculation back while it is slower than plain steps
  budget.py      a step's budget as the proposers see it
  pacer.py       the engine's side: budget, the step's clock, settle, calibration
"""
from .budget import Budget
from .pacer import Pacer, StepClock

__all__ = ["Budget", "Pacer", "StepClock"]
