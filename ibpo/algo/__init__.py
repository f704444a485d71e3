"""The algorithm: pure functions over tensors and host lists, in the order a step uses them.

  objectives.py      the surrogates, each objective registered beside its loss
                     (register_objective, OBJECTIVES), aggregation, KL estimators, the
                     rollout-vs-trainer importance weights, the resolved objective the step calls
  counterfactual.py  IBPO's repair math: which failed members are repaired against which
                     siblings, the repair request, phi, the edit masks
  advantages.py      group advantages, reward shaping, DAPO's length penalty, token advantages
  cancellation.py    the cancellation residual (how far a step is from exchangeable)
  mismatch.py        rollout-vs-trainer log-prob mismatch

These modules import torch, the standard library and rapidfuzz (edit alignments), and nothing
else of ibpo outside this folder (tests/test_layers.py): no config object, no model, no
generation. Reading a recipe into these functions' arguments is ibpo/recipe.py's; running the
model (rollouts, repair generations) is the step's (step.py, repair.py).
"""
