"""Is an estimator's final accuracy different from GRPO's over a few seeds? An exact two-sided permutation test
on the difference of the means: every way of splitting the pooled seeds into two groups of the same sizes, the
share of splits whose difference is at least as far from 0 as the observed one. It assumes nothing about the
distribution of a run's accuracy, and it says plainly what a few seeds can show: with 3 runs a side there are 20
splits, so no difference, however large, gets p below 0.1 (smallest_p), and p reaches 0.1 only when every run of one
side ends above every run of the other. How large a difference that takes, for runs whose accuracy varies normally
around each side's mean: separation_chance and shift_for_chance."""

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


def paired_p(differences: list[float]) -> float:
    """Two-sided exact sign-flip p-value of the mean of paired differences (seed for seed: one estimator's run
    minus the other's on the same seed): every way of flipping the signs, the share whose mean is at least as far
    from 0 as the observed one. With n pairs the smallest it can give is 2 / 2^n (every difference of one sign)."""
    if not differences:
        raise ValueError("paired_p needs at least one pair")
    observed = abs(statistics.mean(differences))
    scale = max(1.0, max(abs(x) for x in differences))
    at_least = 0
    for signs in itertools.product((1, -1), repeat=len(differences)):
        flipped = abs(statistics.mean(s * x for s, x in zip(signs, differences)))
        at_least += flipped >= observed - 1e-12 * scale
    return at_least / 2 ** len(differences)


def smallest_p(n: int, m: int) -> float:
    """The smallest p-value permutation_p can return with n and m runs: the two groups fully apart."""
    return permutation_p([float(i) for i in range(n)], [float(n + i) for i in range(m)])


def separation_chance(n: int, m: int, shift: float, points: int = 4001) -> float:
    """The chance that each of n runs ends above each of m runs when the runs' results are normal with one standard
    deviation, the n runs' mean `shift` of them above the m runs': P(min of n > max of m), the integral over x of the
    density of the n runs' minimum at x times the chance that all m runs are below x (trapezoids on +-10 around both
    means). At shift 0 it is 1 / C(n + m, n): every order of the pooled runs is equally likely."""
    unit = statistics.NormalDist()
    low, high = min(0.0, shift) - 10, max(0.0, shift) + 10
    width = (high - low) / (points - 1)
    total = 0.0
    for i in range(points):
        x = low + i * width
        minimum = n * unit.pdf(x - shift) * (1 - unit.cdf(x - shift)) ** (n - 1)  # the density of the n runs' least
        value = minimum * unit.cdf(x) ** m
        total += value * (0.5 if i in (0, points - 1) else 1.0)
    return total * width


def shift_for_chance(n: int, m: int, chance: float) -> float:
    """The difference of means, in standard deviations of one run, at which n runs all end above m runs with the
    given chance (bisection on separation_chance, which grows with the shift)."""
    low, high = 0.0, 20.0
    for _ in range(50):
        middle = (low + high) / 2
        if separation_chance(n, m, middle) < chance:
            low = middle
        else:
            high = middle
    return (low + high) / 2
