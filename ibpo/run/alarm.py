"""The rollout-mismatch alarm: a warning when the rollouts' behaviour log-probs say they did not
come from the policy being trained, and a stop above a second threshold.

Each step measures the KL between the backend's sampling distribution and the trainer's
(mismatch.py). Above WARN_KL this prints one warning naming the backend and the
likely causes, then again only when the mismatch has doubled since the last warning (so a run
that drifts keeps being told, without a line per step). Above rollout.mismatch_stop_kl the loop
saves a checkpoint and ends with status "mismatch" (exit code 5).

Not here: the measurement (algo/mismatch.py) or the correction (algo/objectives.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ibpo.config import Config

# The mismatch KL that warns: an honest rollout path stays well below it (docs/objectives.md).
WARN_KL = 0.005


def describe_backend(cfg: Config, device_type: str, folded: bool) -> str:
    """The generation path in words, as a warning names it."""
    if cfg.rollout.backend == "vllm":
        return "rollout.backend=vllm (a vLLM engine serving the adapter as a LoRA request)"
    base = "4-bit NF4" if cfg.model.quantization == "nf4" else "unquantised"
    if folded:
        how = "generate() on the dequantised base with the adapter folded in (CPU, 4-bit base)"
    else:
        how = f"generate() on the {base} base with the adapter on {device_type}"
    return f"rollout.backend=hf ({how})"


def _causes(backend: str) -> str:
    return (
        "the generation path may not apply the adapter (or applies another one), may serve "
        "stale weights from an earlier step, or samples in another dtype or with other kernels. "
        f"Backend: {backend}. rollout.top_p < 1 also shows here, as a steady gap"
    )


@dataclass
class MismatchAlarm:
    warn_kl: float  # 0 = never warn
    stop_kl: float | None  # None = never stop
    backend: str
    warned_at: float = 0.0  # the mismatch of the last warning

    @classmethod
    def for_run(cls, cfg: Config, device_type: str, folded: bool) -> MismatchAlarm:
        ro = cfg.rollout
        backend = describe_backend(cfg, device_type, folded)
        return cls(WARN_KL, ro.mismatch_stop_kl, backend)

    def check(self, metrics: dict[str, float], step: int, main: bool = True) -> str | None:
        """Warn (main process) when this step's mismatch calls for it; -> the stop message when
        the run must stop, else None."""
        kl = metrics.get("mismatch_kl")
        if kl is None:
            return None
        figures = (
            f"KL {kl:.4g}, mean |d log p| {metrics['mismatch_abs_mean']:.3g}, max "
            f"{metrics['mismatch_abs_max']:.3g}, {metrics['mismatch_share']:.1%} of tokens off "
            "by more than a factor of 2"
        )
        if self.stop_kl is not None and kl > self.stop_kl:
            return (
                f"stopped at step {step}: the rollouts do not come from the policy being trained "
                f"({figures}; rollout.mismatch_stop_kl={self.stop_kl:g}).\n  Likely causes: "
                f"{_causes(self.backend)}.\n  Fix the generation path, or raise "
                "rollout.mismatch_stop_kl (null = never stop); objective.importance_sampling="
                "truncate corrects a small, honest mismatch."
            )
        if self.warn_kl > 0 and kl > self.warn_kl and kl >= 2 * self.warned_at:
            self.warned_at = kl
            if main:
                print(
                    f"ibpo: warning: step {step}: rollout-vs-trainer mismatch above "
                    f"KL {self.warn_kl:g} ({figures}). Likely causes: "
                    f"{_causes(self.backend)}.",
                    file=sys.stderr,
                )
        return None
