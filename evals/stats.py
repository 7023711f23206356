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
from dataclasses import dataclass


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


# The pre-registered study (docs/study-plan.md): a paired t interval of each claim's effect over
# seeds, its p-value
# against the claim's boundary, Holm's correction over the family of claims, and the seeds a chosen
# effect needs.
# Standard library only: the Student t distribution through the regularized incomplete beta
# function.


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz), on the side where it converges fast (x < (a + 1) / (a + b + 2), else 1 - I_{1-x}(b,
    a))."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - log_beta) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 400):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p (bisection; t_cdf grows with t)."""
    low, high = -1e4, 1e4
    for _ in range(200):
        middle = (low + high) / 2
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass
class PairedT:
    """A paired t summary of differences (one per seed): their mean, standard deviation, count, and
    the two-sided 95% confidence interval of the mean (mean +- t_{0.975, n-1} sd / sqrt n)."""

    mean: float
    sd: float
    n: int
    low: float
    high: float

    def p(self, boundary: float = 0.0) -> float:
        """Two-sided p-value of the paired t-test of "the mean difference equals `boundary`": below
        0.05 exactly when the 95% interval leaves `boundary` out."""
        if self.sd == 0.0:
            return 1.0 if self.mean == boundary else 0.0
        t = (self.mean - boundary) / (self.sd / math.sqrt(self.n))
        return 2.0 * (1.0 - t_cdf(abs(t), self.n - 1))


def paired_t(differences: list[float], level: float = 0.95) -> PairedT:
    """The mean of paired differences (seed for seed) with its t interval; at least two pairs."""
    if len(differences) < 2:
        raise ValueError("paired_t needs at least two pairs")
    n = len(differences)
    mean = statistics.mean(differences)
    sd = statistics.stdev(differences)
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return PairedT(mean, sd, n, mean - half, mean + half)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in their order: the k-th smallest times
    (m - k + 1), never below the one before it, at most 1. A claim whose adjusted p is under 0.05
    holds at family-wise 0.05."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def claim_p(summary: PairedT, low: float, high: float) -> float:
    """The p-value that decides a claim whose region is low < effect < high (either may be
    infinite): with the mean inside, the evidence that the whole interval is inside (the largest p
    against a finite boundary; 1 with none), with the mean outside, the evidence that the whole
    interval is outside (the p against the boundary it passed)."""
    if low < summary.mean < high:
        bounds = [b for b in (low, high) if math.isfinite(b)]
        return max((summary.p(b) for b in bounds), default=1.0)
    return summary.p(low if summary.mean <= low else high)


def verdict(summary: PairedT, low: float, high: float, adjusted_p: float, alpha=0.05) -> str:
    """One rule for every claim: "agree" when the Holm-adjusted claim_p is under alpha with the mean
    inside the claim's region, "disagree" when it is under alpha with the mean outside, else "cannot
    tell"."""
    if adjusted_p >= alpha:
        return "cannot tell"
    return "agree" if low < summary.mean < high else "disagree"


def paired_t_power(n: int, effect: float, sd: float, alpha=0.05, points=4001) -> float:
    """The chance that the two-sided paired t-test at level alpha rejects "no difference" with n
    pairs whose differences are normal with mean `effect` and standard deviation `sd`: the integral
    over the chi-square variable V of the test's denominator of P(|Z + lambda| > t_c sqrt(V / df)),
    lambda = effect sqrt n / sd (trapezoids)."""
    df = n - 1
    critical = t_quantile(1 - alpha / 2, df)
    shift = effect * math.sqrt(n) / sd
    unit = statistics.NormalDist()
    top = df + 40 * math.sqrt(2 * df) + 40
    width = top / (points - 1)
    log_norm = (df / 2) * math.log(2) + math.lgamma(df / 2)
    total = 0.0
    for i in range(1, points):  # the density is 0 at V = 0 for df > 2 and integrable for df = 1, 2
        v = i * width
        density = math.exp((df / 2 - 1) * math.log(v) - v / 2 - log_norm)
        cut = critical * math.sqrt(v / df)
        reject = unit.cdf(-cut - shift) + 1 - unit.cdf(cut - shift)
        total += density * reject * (0.5 if i == points - 1 else 1.0)
    return total * width


def seeds_needed(
    effect: float,
    sd: float,
    alpha=0.05,
    power=0.8,
    half_width=math.inf,
    largest=200,
) -> int:
    """The fewest pairs (seeds) whose paired t-test at level alpha finds `effect` with at least
    `power`, and whose expected 95% interval (t_{0.975, n-1} sd / sqrt n) is at most `half_width` on
    each side."""
    for n in range(2, largest + 1):
        wide = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
        if wide <= half_width and paired_t_power(n, effect, sd, alpha) >= power:
            return n
    raise ValueError(f"more than {largest} seeds needed")
