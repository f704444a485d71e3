"""ibpo: verifiable-reward RL with QLoRA on consumer GPUs (Accelerate + PEFT).

IBPO here is Implicit Behavior Policy Optimization (arXiv 2604.13088 v2 / 2605.16302), not the
budget-constrained method of the same acronym.
"""

__version__ = "0.1.0"
