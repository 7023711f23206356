"""Is an estimator's final accuracy different from GRPO's over a few seeds? An exact two-sided permutation test
on the difference of the means: every way of splitting the pooled seeds into two groups of the same sizes, the
share of splits whose difference is at least as far from 0 as the observed one. It assumes nothing about the
distribution of a run's accuracy, and it says plainly what a few seeds can show: with 3 runs a side there are 20
splits, so no difference, however large, gets p below 0.1 (smallest_p)."""

import itertools
import math
import statistics


def permutation_p(a: list[float], b: list[float]) -> float:
    """Two-sided exact permutation p-value of mean(a) - mean(b) (all C(n + m, n) splits; the observed split counts)."""
    pooled = list(a) + list(b)
    n = len(a)
    if n == 0 or len(b) == 0:
        raise ValueError("permutation_p needs at least one value on each side")
    total = sum(pooled)
    observed = abs(statistics.mean(a) - statistics.mean(b))
    scale = max(1.0, max(abs(x) for x in pooled))
    at_least = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        first = sum(pooled[i] for i in chosen)
        difference = abs(first / n - (total - first) / len(b))
        at_least += difference >= observed - 1e-12 * scale  # ties with the observed split count as extreme
    return at_least / math.comb(len(pooled), n)


def smallest_p(n: int, m: int) -> float:
    """The smallest p-value permutation_p can return with n and m runs: the two groups fully apart."""
    return permutation_p([float(i) for i in range(n)], [float(n + i) for i in range(m)])
