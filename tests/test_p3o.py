"""p3o.compute_advantages / batch_stats / compute_loss against hand-computed values and gradients, then end-to-end
runs (micro-batch and process invariance with stale policies, learning on the toy task)."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_snib import STALE, assert_stale_updates_agree
from test_train import SMALL

import grpo
import p3o
from common.engines.rollout import HFEngine

ARGS = p3o.Args(num_generations=2)


def test_defaults_are_the_papers_and_there_are_no_other_switches():
    args = p3o.Args()
    assert (args.beta, args.entropy_coeff) == (0.0, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    # no clip; ess_scope is FeynRL's per-micro-batch ESS, a documented departure (default: the batch's)
    assert {f.name for f in dataclasses.fields(p3o.Args)} - shared == {"beta", "entropy_coeff", "ess_scope"}
    assert args.ess_scope == "batch"


def test_zscore_advantages_by_hand():
    # group 1: rewards (1, 0, 0, 0): mean 0.25, unbiased std 0.5; group 2: all equal -> 0
    A = p3o.compute_advantages(torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3]), replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6))


def spread_batch():
    """Lengths 2 and 1; valid ratios r = (2, 0.5 | 1), and log-ratios of 100 in the padding (exp would overflow)."""
    old = torch.tensor([[-1.0, -1.0, -50.0], [-2.0, -50.0, -50.0]])
    logp = (old + torch.tensor([[math.log(2.0), math.log(0.5), 100.0], [0.0, 100.0, 100.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logp, old, mask


ESS = 3.5**2 / (3 * (4 + 0.25 + 1))  # (sum r)^2 / (n sum r^2) = 7/9
KL_OLD = [math.log(2) + 0.5 - 1, math.log(0.5) + 2 - 1, 0.0]  # (logp - old) + exp(old - logp) - 1


def test_ess_is_one_on_policy_and_below_one_when_ratios_spread():
    logp, old, mask = spread_batch()
    _, on = p3o.compute_loss(logp, logp.detach(), None, torch.tensor([1.0, -1.0]), mask, ARGS)
    assert on["p3o/ess"].item() == 1.0 and on["p3o/capped_frac"].item() == 0.0
    _, off = p3o.compute_loss(logp, old, None, torch.tensor([1.0, -1.0]), mask, ARGS)
    assert ESS == pytest.approx(7 / 9)
    assert off["p3o/ess"].item() == pytest.approx(ESS)
    assert off["p3o/capped_frac"].item() == pytest.approx(2 / 3)  # r = 2 and r = 1 exceed 7/9
    assert off["p3o/behaviour_kl"].item() == pytest.approx(sum(KL_OLD) / 3)
    assert off["policy/ratio_mean"].item() == pytest.approx(3.5 / 3)


def test_off_policy_loss_and_gradient_by_hand():
    logp, old, mask = spread_batch()
    A = torch.tensor([1.0, -1.0])
    loss, _ = p3o.compute_loss(logp, old, None, A, mask, ARGS)
    weights = [7 / 9, 0.5, 7 / 9]  # stopgrad(min(r_t, ESS))
    lp = [logp[0, 0].item(), logp[0, 1].item(), logp[1, 0].item()]
    a = [1.0, 1.0, -1.0]
    expected = sum(-w * x * ai + (1 - ESS) * k for w, x, ai, k in zip(weights, lp, a, KL_OLD)) / 3
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d/d logp_t: -w_t A_i / n + (1 - ESS) (1 - exp(old - logp)) / n; nothing on padding
    d_kl = [1 - 0.5, 1 - 2.0, 0.0]
    g = [(-w * ai + (1 - ESS) * d) / 3 for w, ai, d in zip(weights, a, d_kl)]
    torch.testing.assert_close(logp.grad, torch.tensor([[g[0], g[1], 0.0], [g[2], 0.0, 0.0]]))


def test_ess_per_micro_batch_by_hand():
    """--ess_scope micro_batch: each micro-batch's ESS from its own tokens; the token mean stays the batch's."""
    logp, old, mask = spread_batch()  # row 0: r = (2, 0.5); row 1: r = 1
    A = torch.tensor([1.0, -1.0])
    args = replace(ARGS, ess_scope="micro_batch")
    stats = p3o.batch_stats(None, A, mask, args)  # no log-ratio: main makes no pass at the current weights
    assert stats.num_tokens.item() == 3 and stats.sum_r is None and stats.per_row_values() == {}
    ess0 = 2.5**2 / (2 * (4 + 0.25))  # (sum r)^2 / (n sum r^2) over row 0's two tokens = 25/34
    first, m0 = p3o.compute_loss(logp[:1], old[:1], None, A[:1], mask[:1], args, stats=stats)
    second, m1 = p3o.compute_loss(logp[1:], old[1:], None, A[1:], mask[1:], args, stats=stats)
    assert m0["p3o/ess"].item() == pytest.approx(ess0) and m1["p3o/ess"].item() == 1.0
    lp = [logp[0, 0].item(), logp[0, 1].item(), logp[1, 0].item()]
    expected0 = (-min(2, ess0) * lp[0] - min(0.5, ess0) * lp[1] + (1 - ess0) * (KL_OLD[0] + KL_OLD[1])) / 3
    assert first.item() == pytest.approx(expected0)
    assert second.item() == pytest.approx(lp[2] / 3)  # ESS 1: no trust region; A = -1, weight min(1, 1)
    (first + second).backward()
    d_kl = [1 - 0.5, 1 - 2.0]
    g = [(-min(r, ess0) + (1 - ess0) * d) / 3 for r, d in zip((2, 0.5), d_kl)]
    torch.testing.assert_close(logp.grad, torch.tensor([[g[0], g[1], 0.0], [1 / 3, 0.0, 0.0]]))
    # one micro-batch holding the whole batch is the default's full-batch loss
    whole, _ = p3o.compute_loss(logp, old, None, A, mask, args, stats=stats)
    assert whole.item() == pytest.approx(p3o.compute_loss(logp, old, None, A, mask, ARGS)[0].item())


def test_behaviour_kl_term_scales_with_one_minus_ess():
    logp, old, mask = spread_batch()
    loss, _ = p3o.compute_loss(logp, old, None, torch.zeros(2), mask, ARGS)  # A = 0: only the trust region is left
    assert loss.item() == pytest.approx((1 - ESS) * sum(KL_OLD) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[(1 - ESS) * 0.5 / 3, (1 - ESS) * -1.0 / 3, 0], [0, 0, 0]]))


def test_on_policy_gradient_is_minus_advantage_over_the_token_count():
    logp, _, mask = spread_batch()
    A = torch.tensor([1.0, -2.0])
    loss, metrics = p3o.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert loss.item() == pytest.approx(-(1.0 * (logp[0, 0] + logp[0, 1]) - 2.0 * logp[1, 0]).item() / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, -1 / 3, 0], [2 / 3, 0, 0]]))


def test_reference_kl_and_entropy_bonus_by_hand():
    logp, _, mask = spread_batch()
    ref = logp.detach() + torch.tensor([[0.5, -0.5, 0.0], [0.2, 0.0, 0.0]])  # ref - logp on valid tokens
    entropy = torch.tensor([[1.0, 2.0, 7.0], [0.5, 7.0, 7.0]], requires_grad=True)
    args = replace(ARGS, beta=0.1, entropy_coeff=0.01)
    loss, metrics = p3o.compute_loss(logp, logp.detach(), ref, torch.zeros(2), mask, args, entropy=entropy)
    kl = [math.exp(d) - d - 1 for d in (0.5, -0.5, 0.2)]  # (logp - ref) + exp(ref - logp) - 1
    assert loss.item() == pytest.approx((0.1 * sum(kl) - 0.01 * 3.5) / 3, rel=1e-5)
    assert metrics["policy/kl"].item() == pytest.approx(sum(kl) / 3)
    loss.backward()
    torch.testing.assert_close(entropy.grad, -0.01 * mask.float() / 3)
    g = [0.1 * (1 - math.exp(d)) / 3 for d in (0.5, -0.5, 0.2)]
    torch.testing.assert_close(logp.grad, torch.tensor([[g[0], g[1], 0], [g[2], 0, 0]]))


def test_entropy_bonus_needs_an_entropy_with_gradient():
    logp, _, mask = spread_batch()
    args = replace(ARGS, entropy_coeff=0.01)
    with pytest.raises(ValueError, match="the entropy.s gradient"):
        p3o.compute_loss(logp, logp.detach(), None, torch.zeros(2), mask, args)
    with pytest.raises(ValueError, match="the entropy.s gradient"):  # completion_logprobs' default: detached
        p3o.compute_loss(logp, logp.detach(), None, torch.zeros(2), mask, args, entropy=torch.ones(2, 3))
    p3o.compute_loss(logp, logp.detach(), None, torch.zeros(2), mask, ARGS, entropy=torch.ones(2, 3))  # coeff 0: fine


def test_tis_weights_scale_the_policy_term_per_token():
    logp, _, mask = spread_batch()
    A = torch.tensor([1.0, -2.0])
    tis = torch.tensor([[0.5, 2.0, 9.0], [3.0, 9.0, 9.0]])
    loss, _ = p3o.compute_loss(logp, logp.detach(), None, A, mask, ARGS, tis_weights=tis)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 3, -2.0 / 3, 0], [2.0 * 3.0 / 3, 0, 0]]))


# Against loops straight from docs/estimators/p3o.md's objective; micro-batches and processes


def reference_loss(logp, old, ref, A, mask, args, tis=None, entropy=None):
    """Loops over valid tokens with torch scalars (autograd then gives the reference gradient)."""
    B, T = logp.shape
    valid = [(i, t) for i in range(B) for t in range(T) if mask[i, t]]
    r = [math.exp((logp[i, t] - old[i, t]).item()) for i, t in valid]
    n = len(valid)
    ess = sum(r) ** 2 / (n * sum(x * x for x in r))
    kl = lambda x, y: (x - y) + torch.exp(torch.clamp(y - x, -10, 10)) - 1  # noqa: E731
    total = 0.0
    for (i, t), r_t in zip(valid, r):
        total = total - min(r_t, ess) * logp[i, t] * A[i] * (1.0 if tis is None else tis[i, t])
        total = total + (1 - ess) * kl(logp[i, t], old[i, t])
        if args.beta > 0:
            total = total + args.beta * kl(logp[i, t], ref[i, t])
        if args.entropy_coeff > 0:
            total = total - args.entropy_coeff * entropy[i, t]
    return total / n, ess


def random_batch(seed=0, B=8, T=5, spread=0.3):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 5, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T) unequal lengths, right-padded
    A = p3o.compute_advantages(torch.rand(B, dtype=torch.float64), replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    entropy = torch.rand(B, T, dtype=torch.float64, requires_grad=True)
    return logp, old, ref, A, mask, tis, entropy


@pytest.mark.parametrize("beta, entropy_coeff, with_tis", [(0.0, 0.0, False), (0.05, 0.01, True)])
def test_matches_reference_and_micro_batches_sum_to_full_batch(beta, entropy_coeff, with_tis):
    args = replace(ARGS, num_generations=4, beta=beta, entropy_coeff=entropy_coeff)
    logp, old, ref, A, mask, tis, entropy = random_batch()
    tis = tis if with_tis else None
    inputs = [logp, entropy] if entropy_coeff > 0 else [logp]
    loss, metrics = p3o.compute_loss(logp=logp, old_logp=old, ref_logp=ref, advantages=A, mask=mask, args=args,
                                     tis_weights=tis, entropy=entropy)
    full_grad = torch.autograd.grad(loss, inputs)
    expected, ess = reference_loss(logp, old, ref, A, mask, args, tis, entropy)
    assert metrics["p3o/ess"].item() == pytest.approx(ess) and ess < 0.95
    assert 0 < metrics["p3o/capped_frac"] < 1
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    for got, want in zip(full_grad, torch.autograd.grad(expected, inputs)):
        torch.testing.assert_close(got, want)

    # micro-batches with the mini-batch's sums; then two "processes", each summing its own half (the all-reduce)
    stats = p3o.batch_stats(logp.detach() - old, A, mask, args)
    halves = [p3o.batch_stats(logp[s].detach() - old[s], A[s], mask[s], args) for s in (slice(0, 4), slice(4, 8))]
    assert stats.per_row_values() == {}
    reduced = p3o.Stats(*(a + b for a, b in zip(dataclasses.astuple(halves[0]), dataclasses.astuple(halves[1]))))
    for stats in (stats, reduced):
        micro = sum(p3o.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, entropy=entropy[s],
                                     tis_weights=None if tis is None else tis[s], stats=stats)[0]
                    for s in [slice(0, 1), slice(1, 3), slice(3, 6), slice(6, 8)])
        assert micro.item() == pytest.approx(loss.item(), rel=1e-10)
        for got, want in zip(torch.autograd.grad(micro, inputs), full_grad):
            torch.testing.assert_close(got, want)


def test_extreme_log_ratios_stay_finite():
    logp, old, mask = spread_batch()
    logp = (old + torch.tensor([[60.0, -60.0, 100.0], [0.0, 100.0, 100.0]])).requires_grad_()  # r^2 > fp32 max
    loss, metrics = p3o.compute_loss(logp, old, None, torch.tensor([1.0, -1.0]), mask, ARGS)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert metrics["p3o/ess"].item() == pytest.approx(1 / 3, rel=1e-4)  # one ratio dominates: ESS -> 1/n


# End-to-end (toy task, CPU)


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    # stale enough that a per-micro-batch or per-process ESS would differ (the seed-0 toy at lr 0.003: ess 0.99865,
    # capped_frac 0.571, behaviour_kl 8.9e-4)
    assert_stale_updates_agree(
        in_toy_workdir, "p3o.py", "p3o", STALE,
        lambda m: m["p3o/ess"] < 0.9995 and m["p3o/capped_frac"] > 0.05 and m["p3o/behaviour_kl"] > 4e-4,
        micro_sizes=(1, 4))


@pytest.mark.slow
@pytest.mark.parametrize("source", ["trainer", "sampler"])
def test_old_logp_source_picks_the_trainers_pass_or_the_samplers_values(in_toy_workdir, monkeypatch, source):
    """The HF sampler's log-probs are the trainer's up to rounding; shifted by +0.1 here, the ratios show which
    the loop used as old_logp. FeynRL's setting: one optimizer step, the sampler's log-probs, ESS per micro-batch."""
    generate = HFEngine.generate

    def shifted(self, *args, **kwargs):
        completions, logps = generate(self, *args, **kwargs)
        return completions, [[x + 0.1 for x in row] for row in logps]

    monkeypatch.setattr(HFEngine, "generate", shifted)
    argv = SMALL + ["--old_logp_source", source, "--ess_scope", "micro_batch", "--run_name", f"p3o_old_{source}"]
    m = read_metrics(run_script(p3o, argv))[-1]
    if source == "trainer":  # on-policy: old_logp is the update's own forward; the sampler is 0.1 off
        assert m["policy/ratio_mean"] == 1.0 and m["p3o/ess"] == 1.0
        assert m["rollout/logp_gap_mean"] == pytest.approx(0.1, abs=1e-4)
    else:  # old_logp = the sampler's: r = exp(logp - sampler) = exp(-0.1) on every token, up to rounding
        assert m["policy/ratio_mean"] == pytest.approx(math.exp(-0.1), abs=1e-4)
        assert m["p3o/ess"] == pytest.approx(1.0, abs=1e-6)  # equal ratios: ESS 1
        assert m["rollout/logp_gap_mean"] == 0.0


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the paper's defaults: held-out greedy accuracy must rise."""
    argv = ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25", "--run_name", "p3o_learns"]
    run = run_script(p3o, argv)  # a run name of its own: the toy workdir is shared by the whole session
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("p3o"), evals


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = p3o.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)
