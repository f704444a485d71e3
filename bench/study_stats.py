"""The study's statistics, on plain lists of numbers: Student's t intervals, the exact sign test, a
percentile bootstrap from a fixed seed, the F-test of two variances, the seeds a t-interval's
width or a t-test's power needs, paired figures of a list of differences, and reading a curve
between its points (compute is never extrapolated).

The t quantile, the noncentral t of the power and the F distribution come from scipy.stats
(`pip install 'ibpo[study]'`); the sign test and the bootstrap are written here (math, random).
It knows nothing of runs or arms (study_compare pairs them).
"""

from __future__ import annotations

import math
import random
import statistics
import sys

BOOTSTRAP_SEED, BOOTSTRAP_REPS = 20261201, 10_000


def _stats():
    try:
        from scipy import stats
    except ImportError:
        sys.exit("study.py: the report's statistics need scipy. Fix: pip install 'ibpo[study]'")
    return stats


def t_critical(df: int) -> float:
    """Student's t two-sided 95% quantile with df degrees of freedom; NaN below 1."""
    return float(_stats().t.ppf(0.975, df)) if df >= 1 else math.nan


def sd(values: list[float]) -> float:
    """The sample standard deviation; NaN for fewer than two values."""
    return statistics.stdev(values) if len(values) > 1 else math.nan


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean; one value gives an interval of NaN."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t_critical(len(values) - 1) * sd(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def f_test_greater(sd_a: float, n_a: int, sd_b: float, n_b: int) -> float:
    """One-sided p that sample a's variance exceeds sample b's only by chance: P(F > s_a^2/s_b^2)
    with (n_a - 1, n_b - 1) degrees of freedom (normal samples)."""
    return float(_stats().f.sf((sd_a / sd_b) ** 2, n_a - 1, n_b - 1))


def sign_test(diffs: list[float]) -> float:
    """Exact two-sided sign test of median 0; ties (zero differences) are left out."""
    pos, neg = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n = pos + neg
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(pos, neg) + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap_ci(diffs: list[float], reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED):
    """Percentile bootstrap 95% interval of the mean, from a fixed RNG seed (reproducible)."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(statistics.fmean(rng.choices(diffs, k=n)) for _ in range(reps))
    return means[int(0.025 * reps)], means[min(reps - 1, int(0.975 * reps))]


def seeds_for_half_width(spread: float, half: float = 0.05, most: int = 100_000) -> float:
    """The fewest seeds n whose paired t 95% interval, t(0.975, n - 1) x spread / sqrt(n), is
    at most +-half wide at this spread (the sd of the paired differences); NaN without one."""
    if not spread > 0:
        return math.nan
    n = 2
    while t_critical(n - 1) * spread / math.sqrt(n) > half:
        n += 1
        if n > most:
            return math.nan
    return float(n)


def t_power(n: int, spread: float, delta: float) -> float:
    """The power of the two-sided paired t-test at 0.05 with n pairs to find a true mean
    difference `delta` at this spread: P(|T| > t(0.975, n - 1)) for T noncentral t with n - 1
    degrees of freedom and noncentrality delta sqrt(n) / spread."""
    stats, df = _stats(), n - 1
    crit, shift = t_critical(df), delta * math.sqrt(n) / spread
    return float(stats.nct.sf(crit, df, shift) + stats.nct.cdf(-crit, df, shift))


def seeds_for_power(
    spread: float, delta: float = 0.05, power: float = 0.8, most: int = 100_000
) -> float:
    """The fewest seeds for the paired t-test to find a difference of `delta` with this power;
    NaN without one."""
    if not spread > 0:
        return math.nan
    n = 2
    while t_power(n, spread, delta) < power:
        n += 1
        if n > most:
            return math.nan
    return float(n)


def paired_stats(diffs: list[float]) -> dict:
    """The figures of one list of paired differences: mean, paired t and bootstrap 95%
    intervals, seeds higher / lower / tied and the exact sign test."""
    low, high = bootstrap_ci(diffs)
    _, t_low, t_high = mean_ci(diffs)
    return {
        "diffs": diffs,
        "mean": statistics.fmean(diffs),
        "t_ci": [t_low, t_high],
        "bootstrap_ci": [low, high],
        "wins": sum(d > 0 for d in diffs),
        "losses": sum(d < 0 for d in diffs),
        "ties": sum(d == 0 for d in diffs),
        "sign_p": sign_test(diffs),
    }


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """y at x on the piecewise-linear curve through `points` (x ascending, as compute spent
    only grows). Where several points share x (no compute between two evaluations) the last
    wins: the most trained. x outside the curve is an error: compute is never extrapolated."""
    xs = [p[0] for p in points]
    if not points or x < xs[0] or x > xs[-1]:
        raise ValueError(f"compute {x} is outside the curve's {xs[:1]}..{xs[-1:]}")
    at = [y for px, y in points if px == x]
    if at:
        return at[-1]
    i = next(i for i, px in enumerate(xs) if px > x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def at_equal_compute(a: list, b: list, fraction: float = 1.0) -> tuple[float, float, float]:
    """(budget, accuracy of a, accuracy of b) at `fraction` of the largest compute both curves
    reach: the cheaper run is read at its last evaluation (fraction 1), the other between the
    two evaluations around that budget."""
    budget = fraction * min(a[-1][0], b[-1][0])
    return budget, interpolate(a, budget), interpolate(b, budget)


def mean_known(values) -> float:
    """The mean of the values that are not None; NaN without one."""
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else math.nan
