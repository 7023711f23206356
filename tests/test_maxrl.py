"""maxrl.compute_advantages / compute_loss by hand, against loops from the definitions (float64): the paper's
mean-normalised advantage in the form of the authors' verl fork (`compute_maxrl_outcome_advantage`:
(R - mean) / (mean + 1e-6)) with prime-rl's rule for a group whose mean is <= 0 (`max_rl`: zero advantages); the
loss against verl 0.5.0's own `compute_policy_loss` (the loss the authors' fork keeps), then end-to-end runs.

The advantages are compared with loops, not with a peer's code: the authors' fork is not a released package and
prime-rl's `max_rl` is a method of its orchestrator's Algorithm class (its rollout objects, its config); both are
four lines, quoted in the docstring of reference_advantages below and in docs/estimators/maxrl.md."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_reinforcepp import verl_core_algos  # noqa: F401  the `peer` fixture: verl 0.5.0's core_algos.py
from test_snib import STALE, assert_stale_updates_agree
from test_train import SMALL, assert_same_gradient, sgd_gradient

import grpo
import landscape
import maxrl

ARGS = maxrl.Args(num_generations=4)


def test_defaults_and_there_are_no_other_switches():
    args = maxrl.Args()
    # verl's defaults, which the authors' verl fork keeps: clip_ratio 0.2, clip_ratio_c 3, use_kl_loss off
    assert (args.beta, args.epsilon, args.epsilon_high, args.clip_ratio_c) == (0.0, 0.2, 0.2, 3.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(maxrl.Args)} - shared == {"beta", "epsilon", "epsilon_high",
                                                                         "clip_ratio_c"}


def test_mean_normalised_advantages_by_hand():
    """Binary rewards, K successes of G = 4: (G - K) / K on a success, -1 on a failure (1 success: 3 and -1; 3
    successes: 1/3 and -1); a group without a success or with all successes: 0. Non-binary rewards (0.5, 1.5, 1, 1):
    mean 1, A = R - 1 over 1 + 1e-6."""
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0.5, 1.5, 1, 1], dtype=torch.float64)
    A = maxrl.compute_advantages(rewards, ARGS)
    d1, d3, d = 0.25 + 1e-6, 0.75 + 1e-6, 1 + 1e-6
    expected = [0.75 / d1, -0.25 / d1, -0.25 / d1, -0.25 / d1, 0.25 / d3, 0.25 / d3, -0.75 / d3, 0.25 / d3,
                0, 0, 0, 0, 0, 0, 0, 0, -0.5 / d, 0.5 / d, 0, 0]
    torch.testing.assert_close(A, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(A[:8], torch.tensor([3.0, -1, -1, -1, 1 / 3, 1 / 3, -1, 1 / 3], dtype=torch.float64),
                               rtol=1e-5, atol=0)
    # GRPO's z-score gives the 1-of-4 and 3-of-4 groups the same |A| pattern mirrored; MaxRL weights the rare success
    grpo_A = grpo.compute_advantages(rewards, grpo.Args(num_generations=4))
    assert grpo_A[0].item() == pytest.approx(-grpo_A[6].item()) and A[0] / -A[6] > 2.9
    negative = maxrl.compute_advantages(torch.tensor([-1.0, 0, 0, 0]), ARGS)  # mean < 0: prime-rl's zero
    assert negative.abs().max() == 0


def test_the_policy_gradient_is_the_successes_likelihood_over_their_count():
    """On-policy with binary rewards, sum_i A_i grad log pi(y_i) = (G / K) sum_{successes} grad log pi - sum_i grad
    log pi: the group's score terms weighted as the paper's estimator, (1/K) sum_{successes} times G, less the
    all-sample control variate. Checked on one token per row, where grad log pi(y_i) is row i's own coordinate."""
    rewards = torch.tensor([1.0, 0, 1, 0], dtype=torch.float64)  # K = 2 of G = 4
    A = maxrl.compute_advantages(rewards, ARGS)
    logp = torch.zeros(4, 1, dtype=torch.float64, requires_grad=True)
    loss, _ = maxrl.compute_loss(logp, logp.detach(), None, A, torch.ones(4, 1), ARGS)
    (grad,) = torch.autograd.grad(-loss * 4, logp)  # the token mean divides by the 4 tokens
    torch.testing.assert_close(grad.flatten(), (4 / 2) * rewards - 1, rtol=1e-5, atol=0)


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: every r_t = 1, nothing clipped, the loss -(1/n) sum_i L_i A_i and its gradient -A_i / n on
    every valid token: GRPO's --loss_agg token-mean gradient with MaxRL's advantages."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([3.0, -1.0, 0.5])
    loss, metrics = maxrl.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert loss.item() == pytest.approx(-(2 * 3.0 - 3 * 1.0 + 0.5) / 6)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -A[:, None] * mask / 6)
    theirs = landscape.compute_loss(logp, logp.detach(), None, A, mask, landscape.Args(num_generations=1, beta=0.0,
                                                                             loss_agg="token-mean"))[0]
    torch.testing.assert_close(torch.autograd.grad(theirs, logp)[0], grad)


def test_the_dual_clip_and_the_k3_kl():
    """A = -1, r = e^1.5 > c = 3: the token's loss is capped at 3 with no gradient; with beta 0.04 the k3 KL of each
    valid token joins the token mean (the policy term's TIS weight does not scale it)."""
    logp = torch.tensor([[1.5, 1.0]], dtype=torch.float64, requires_grad=True)
    old, mask = torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1, 1]])
    ref = logp.detach() + 0.3
    A = torch.tensor([-1.0], dtype=torch.float64)
    loss, metrics = maxrl.compute_loss(logp, old, ref, A, mask, ARGS)
    assert loss.item() == pytest.approx((3.0 + math.e) / 2, rel=1e-12) and metrics["policy/dual_clip_frac"] == 0.5
    tis = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    with_kl = maxrl.compute_loss(logp, old, ref, A, mask, replace(ARGS, beta=0.04), tis_weights=tis)[0]
    k3 = math.exp(0.3) - 0.3 - 1
    assert with_kl.item() == pytest.approx((3.0 * 0.5 + math.e * 2.0) / 2 + 0.04 * k3, rel=1e-12)


# Against loops straight from the definitions, and micro-batches


def reference_advantages(rewards, G):
    """Group by group: p = mean reward; A_i = (R_i - p) / (p + 1e-6) (the authors' verl fork:
    `scores[i] = (scores[i] - id2mean[index[i]]) / (id2mean[index[i]] + epsilon)`), 0 where p <= 0 (prime-rl:
    `zeros_like(rewards) if mean <= 0 else (rewards - mean) / mean`)."""
    out = []
    for i in range(len(rewards)):
        g = i // G
        p = sum(rewards[g * G: g * G + G]) / G
        out.append((rewards[i] - p) / (p + 1e-6) if p > 0 else rewards[i] * 0)
    return torch.stack(out)


def reference_loss(logp, old, ref, A, mask, args, tis=None):
    """verl's PPO token loss term by term with the dual clip, the k3 KL term, a mean over the valid tokens."""
    total, n = 0.0, 0
    B, T = logp.shape
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            s = torch.minimum(r * A[i], torch.clamp(r, 1 - args.epsilon, 1 + args.epsilon_high) * A[i])
            if A[i] < 0:
                s = torch.maximum(s, args.clip_ratio_c * A[i])
            s = s if tis is None else s * tis[i, t]
            if args.beta > 0:
                d = ref[i, t] - logp[i, t]
                s = s - args.beta * (torch.exp(d) - d - 1)
            total, n = total + s, n + 1
    return -total / n


def random_batch(seed=0, B=8, T=5, spread=1.0):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])  # row 6 removed (no valid token)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float64)
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, rewards, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("epsilon, epsilon_high, c", [(0.2, 0.2, 3.0), (0.1, 0.28, 1.5)])
def test_matches_the_definitions_and_micro_batches_sum_to_the_full_batch(beta, with_tis, epsilon, epsilon_high, c):
    args = replace(ARGS, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, clip_ratio_c=c)
    logp, old, ref, rewards, mask, tis = random_batch()
    A = maxrl.compute_advantages(rewards, args)
    torch.testing.assert_close(A, reference_advantages(rewards, 4), rtol=1e-12, atol=0)
    tis = tis if with_tis else None
    loss, metrics = maxrl.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected = reference_loss(logp, old, ref, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    assert 0 < metrics["policy/clip_frac"] < 1 and metrics["policy/dual_clip_frac"] > 0
    stats = maxrl.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"]
    assert stats.per_row_values() == {} and stats.num_tokens.item() == 21
    micro = sum(maxrl.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                   tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    """torch.autograd.gradcheck on the loss as a function of logp (away from the clips' kinks)."""
    logp, old, ref, rewards, mask, tis = random_batch(seed=3, spread=0.02)
    A = maxrl.compute_advantages(rewards, ARGS)
    args = replace(ARGS, beta=0.04)
    assert torch.autograd.gradcheck(lambda x: maxrl.compute_loss(x, old, ref, A, mask, args, tis_weights=tis)[0],
                                    (logp.detach().requires_grad_(),))


@pytest.mark.peer
@pytest.mark.parametrize("epsilon, epsilon_high, c", [(0.2, 0.2, 3.0), (0.1, 0.28, 1.5)])
def test_equals_verls_policy_loss_and_gradient_given_the_advantages(verl_core_algos, epsilon,  # noqa: F811
                                                                    epsilon_high, c):
    """verl 0.5.0's compute_policy_loss (token-mean, dual clip) on MaxRL's advantages, as (B, T) tensors, beta 0
    (verl's default). verl's token mean divides by n + 1e-8."""
    logp, old, _, rewards, mask, _ = random_batch(seed=2)
    args = replace(ARGS, epsilon=epsilon, epsilon_high=epsilon_high, clip_ratio_c=c)
    A = maxrl.compute_advantages(rewards, args)
    ours, metrics = maxrl.compute_loss(logp, old, None, A, mask, args)
    theirs, _, _, lower = verl_core_algos.compute_policy_loss(
        old, logp, A[:, None] * mask, mask, cliprange=0.2, cliprange_low=epsilon, cliprange_high=epsilon_high,
        clip_ratio_c=c, loss_agg_mode="token-mean")
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-8)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-8, atol=1e-12)
    assert metrics["policy/dual_clip_frac"].item() == pytest.approx(lower.item(), rel=1e-6)


# End to end


@pytest.mark.slow
@pytest.mark.precondition
def test_micro_batch_size_does_not_change_the_on_policy_gradient(in_toy_workdir):
    grads = {mb: sgd_gradient(in_toy_workdir, f"maxrl_micro{mb}", SMALL + ["--micro_batch_size", str(mb)],
                              script="maxrl.py") for mb in (1, 16)}
    assert_same_gradient(grads[1], grads[16])


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    """Two passes over each batch in two mini-batches, a clip tight enough that tokens are clipped: the token mean
    has the optimizer batch's denominator, whatever the micro-batches and processes."""
    flags = STALE + ["--epsilon", "0.02", "--epsilon_high", "0.02"]
    assert_stale_updates_agree(in_toy_workdir, "maxrl.py", "maxrl", flags, lambda m: m["policy/clip_frac"] > 0.05)


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(maxrl, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                             "--run_name", "maxrl_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("maxrl"), evals


def test_mean_epsilon_is_1e_6_added_to_the_mean():
    """Rewards 2e-6 and 0: the group mean (1e-6) is the epsilon's size, so A = +-1e-6 / (1e-6 + 1e-6) = +-0.5; an
    epsilon of 1e-5 would give +-0.09. A group of mean 0 gets A = 0 (no success, no signal)."""
    rewards = torch.tensor([2e-6, 0.0, 0.0, 0.0], dtype=torch.float64)
    A = maxrl.compute_advantages(rewards, replace(ARGS, num_generations=2))
    torch.testing.assert_close(A, torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)


def test_a_group_whose_mean_reward_is_not_positive_gets_no_signal():
    """MaxRL's zero rule, 0 where mean_g R <= 0 (prime-rl's): a group of mean exactly 0 with a spread (rewards 1 and
    -1) would otherwise get A = +-1 / 1e-6, and a group of negative mean a sign-flipped advantage."""
    rewards = torch.tensor([1.0, -1.0, -1.0, -3.0, 2.0, 0.0])
    A = maxrl.compute_advantages(rewards, replace(ARGS, num_generations=2))
    torch.testing.assert_close(A, torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0]), rtol=1e-5, atol=0)
