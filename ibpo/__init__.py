"""ibpo: verifiable-reward RL with QLoRA on consumer GPUs (Accelerate + PEFT).

IBPO here is Implicit Behavior Policy Optimization (arXiv 2604.13088 v2 / 2605.16302), not the
budget-constrained method of the same acronym.

`ibpo.train(...)` runs a recipe from Python (ibpo/api.py). It is imported on first use, so that
`import ibpo` (and every `import ibpo.<module>`, which runs this file first) stays light.
"""

__version__ = "0.1.0"
__all__ = ["__version__", "train"]


def __getattr__(name: str):
    if name in ("train", "TrainResult"):
        from ibpo.api import TrainResult, train  # the API imports torch and transformers

        return {"train": train, "TrainResult": TrainResult}[name]
    raise AttributeError(f"module 'ibpo' has no attribute {name!r}")
