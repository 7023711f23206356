"""cispo.compute_advantages / compute_loss by hand, against loops from the paper's equation, against TRL 1.16's own
GRPOTrainer._compute_loss (loss_type="cispo"), then end-to-end runs."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from peers import trl_grpo_loss
from test_snib import STALE, assert_stale_updates_agree

import cispo
import grpo
import landscape

ARGS = cispo.Args(num_generations=2)


def test_defaults_and_there_are_no_other_switches():
    args = cispo.Args()
    # MiniMax-M1: no lower bound on the IS weight, no KL; the cap 5 = 1 + 4 of ScaleRL and TRL's recommendation
    assert (args.epsilon, args.epsilon_high, args.beta) == (1.0, 4.0, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(cispo.Args)} - shared == {"beta", "epsilon", "epsilon_high"}


def test_zscore_advantages_are_grpos():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    A = cispo.compute_advantages(rewards, replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6))
    torch.testing.assert_close(A, grpo.compute_advantages(rewards, grpo.Args(num_generations=4)))


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])  # lengths 2, 3 and 1: 6 tokens
    return logp, mask, torch.tensor([1.0, -2.0, 0.5])


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: every weight is 1, the loss is -sum A_i logp_t / n and its gradient the token-mean policy
    gradient, -A_i / n on every valid token (GRPO's token-mean gradient at ratio 1)."""
    logp, mask, A = on_policy_batch()
    loss, metrics = cispo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(-(1.0 * (-3.0) - 2.0 * (-1.5) + 0.5 * (-0.1)) / 6)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [2.0, 2.0, 2.0], [-0.5, 0.0, 0.0]]) / 6
    torch.testing.assert_close(grad, expected)
    token_mean = landscape.compute_loss(logp, logp.detach(), None, A, mask, landscape.Args(num_generations=1, beta=0.0,
                                                                                   loss_agg="token-mean"))[0]
    torch.testing.assert_close(torch.autograd.grad(token_mean, logp)[0], expected)


def test_a_truncated_weight_keeps_its_tokens_gradient():
    """Where PPO's clip zeroes a token's gradient, CISPO keeps it, scaled by the truncated weight (eq. 4-5)."""
    old = torch.log(torch.tensor([[0.1, 0.5, 0.5, 0.5]], dtype=torch.float64))
    ratios = torch.tensor([[7.0, 1.1, 0.5, 1.0]], dtype=torch.float64)  # the first above the cap 5
    logp = (old + ratios.log()).requires_grad_()
    args = replace(ARGS, epsilon=0.2)  # and a lower bound 0.8, as verl's two-sided form allows
    for a in (1.0, -1.0):
        loss, metrics = cispo.compute_loss(logp, old, None, torch.tensor([a], dtype=torch.float64),
                                           torch.ones(1, 4), args)
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, -a * torch.tensor([[5.0, 1.1, 0.8, 1.0]], dtype=torch.float64) / 4)
        assert metrics["policy/clip_frac_high"].item() == 0.25 and metrics["policy/clip_frac_low"].item() == 0.25
        ppo = grpo.compute_loss(logp, old, None, torch.tensor([a], dtype=torch.float64), torch.ones(1, 4),
                                grpo.Args(num_generations=1, beta=0.0, epsilon=0.2, epsilon_high=4.0))[0]
        assert torch.autograd.grad(ppo, logp)[0][0, 0 if a > 0 else 2] == 0  # PPO: that token's gradient is gone


def test_k3_kl_joins_the_token_mean_and_tis_scales_only_the_policy_term():
    logp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old, ref = logp.detach() - 0.1, logp.detach() + 0.3
    mask, A = torch.tensor([[1, 1], [1, 0]]), torch.tensor([1.0, -1.0], dtype=torch.float64)
    tis = torch.tensor([[0.5, 2.0], [1.5, 0.0]], dtype=torch.float64)
    args = replace(ARGS, beta=0.1)
    loss, metrics = cispo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    w, k3 = math.exp(0.1), math.exp(0.3) - 0.3 - 1
    expected = -(w * 1.0 * (-1.0) * 0.5 + w * 1.0 * (-1.0) * 2.0 + w * -1.0 * (-2.0) * 1.5 - 3 * 0.1 * k3) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["policy/kl"].item() == pytest.approx(k3)
    (grad,) = torch.autograd.grad(loss, logp)
    d_k3 = 1 - math.exp(0.3)  # d k3 / d logp
    expected_grad = torch.tensor([[-w * 0.5 + 0.1 * d_k3, -w * 2.0 + 0.1 * d_k3], [w * 1.5 + 0.1 * d_k3, 0.0]]) / 3
    torch.testing.assert_close(grad, expected_grad.double())


# Against loops straight from the paper's equations 4-5, and micro-batches


def reference_loss(logp, old, ref, A, mask, args, tis=None):
    """Equation 4 with eq. 5's weight, token by token with torch scalars: -(1/n) sum sg(r_hat) A logp (+ beta k3)."""
    B, T = logp.shape
    total, n = 0.0, 0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            r = math.exp((logp[i, t] - old[i, t]).item())
            r_hat = min(max(r, 1 - args.epsilon), 1 + args.epsilon_high)  # a float: no gradient through it
            term = r_hat * A[i] * logp[i, t] * (1.0 if tis is None else tis[i, t])
            if args.beta > 0:
                term = term - args.beta * (torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1)
            total, n = total + term, n + 1
    return -total / n


def random_batch(seed=0, B=8, T=5, spread=1.0):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread  # stale enough to truncate some weights
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])  # row 6 removed (no valid token)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T) unequal lengths, right-padded
    A = cispo.compute_advantages(torch.rand(B, dtype=torch.float64), replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("epsilon, epsilon_high", [(1.0, 4.0), (0.2, 0.28)])
def test_matches_the_papers_equation_and_micro_batches_sum_to_the_full_batch(beta, with_tis, epsilon, epsilon_high):
    args = replace(ARGS, num_generations=4, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high)
    logp, old, ref, A, mask, tis = random_batch()
    tis = tis if with_tis else None
    loss, metrics = cispo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected = reference_loss(logp, old, ref, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    assert 0 < metrics["policy/clip_frac"] < 1  # some weights truncated, not all
    stats = cispo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"]
    assert stats.per_row_values() == {} and stats.num_tokens.item() == mask.sum().item()
    slices = [slice(0, 1), slice(1, 4), slice(4, 8)]
    micro = sum(cispo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                   tis_weights=None if tis is None else tis[s])[0] for s in slices)
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    """torch.autograd.gradcheck on the loss as a function of logp (the truncated weight is a constant there)."""
    logp, old, ref, A, mask, tis = random_batch(seed=3, spread=0.3)
    args = replace(ARGS, num_generations=4, beta=0.04)
    log_ratio = logp.detach() - old  # old_logp moves with x: finite differences keep every weight where it is

    def loss_of(x):
        return cispo.compute_loss(x, x.detach() - log_ratio, ref, A, mask, args, tis_weights=tis)[0]

    assert torch.autograd.gradcheck(loss_of, (logp.detach().requires_grad_(),))


# Against TRL 1.16's own code


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
def test_equals_trls_cispo_loss_and_gradient(beta, with_tis):
    """TRL clamps the weight at `epsilon_high` itself (its recommended 5.0) with no lower bound: our defaults,
    epsilon 1 (lower bound 0) and 1 + epsilon_high = 5."""
    logp, old, ref, A, mask, tis = random_batch(seed=2)
    tis = tis if with_tis else None
    args = replace(cispo.Args(), num_generations=4, beta=beta)
    ours = cispo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)[0]
    theirs = trl_grpo_loss("cispo", logp, old, ref, A, mask.float(), beta, tis, epsilon_high=1 + args.epsilon_high)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])
    assert ((torch.exp(logp - old) > 5) & (mask > 0)).any()  # the cap is reached: the comparison covers it


# End to end


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    """Two passes over each batch in two mini-batches, with bounds tight enough that weights are truncated: the
    token mean's denominator is the optimizer batch's, whatever the micro-batches and processes."""
    flags = STALE + ["--epsilon", "0.01", "--epsilon_high", "0.01"]
    assert_stale_updates_agree(in_toy_workdir, "cispo.py", "cispo", flags,
                               lambda m: m["policy/clip_frac"] > 0.05 and m["policy/ratio_mean"] != 1.0)


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(cispo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                             "--run_name", "cispo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("cispo"), evals


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = cispo.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)
