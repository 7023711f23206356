"""sapo.compute_advantages / compute_loss by hand, against loops from the paper's objective, against TRL 1.16's own
GRPOTrainer._compute_loss (loss_type="sapo"), then end-to-end runs."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from peers import trl_grpo_loss
from test_snib import STALE, assert_stale_updates_agree

import grpo
import sapo

ARGS = sapo.Args(num_generations=2)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_defaults_and_there_are_no_other_switches():
    args = sapo.Args()
    assert (args.tau_pos, args.tau_neg, args.beta) == (1.0, 1.05, 0.0)  # the paper's temperatures; no KL
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(sapo.Args)} - shared == {"beta", "tau_pos", "tau_neg"}


def test_zscore_advantages_are_grpos():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    torch.testing.assert_close(sapo.compute_advantages(rewards, replace(ARGS, num_generations=4)),
                               grpo.compute_advantages(rewards, grpo.Args(num_generations=4)))


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: every gate is sigmoid(0) = 1/2, the loss -(1/B) sum_i 2 A_i / tau_i, and the gradient's
    weight 4 p (1 - p) r = 1: -(1/B) A_i / L_i on the valid tokens of row i, GRPO's gradient at ratio 1."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([1.0, -2.0, 0.5])
    loss, metrics = sapo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert loss.item() == pytest.approx(-(2 * 1.0 / 1.0 + 2 * -2.0 / 1.05 + 2 * 0.5 / 1.0) / 3)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["policy/gate_weight_mean"].item() == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -torch.tensor([[1.0 / 2, 1.0 / 2, 0.0], [-2.0 / 3, -2.0 / 3, -2.0 / 3], [0.5, 0.0, 0.0]]) / 3
    torch.testing.assert_close(grad, expected)
    grpo_loss = grpo.compute_loss(logp, logp.detach(), None, A, mask, grpo.Args(num_generations=1, beta=0.0))[0]
    torch.testing.assert_close(torch.autograd.grad(grpo_loss, logp)[0], expected)


def test_the_gate_decays_smoothly_where_ppo_clips_and_faster_for_negative_advantages():
    """r = (2, 1.1): PPO's clip (0.2) zeroes the first token's gradient for A > 0; SAPO weights it by
    4 p (1 - p) r with p = sigmoid(tau (r - 1)). For A < 0, tau_neg = 1.05 > tau_pos: a smaller weight at r = 2."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    ratios = torch.tensor([[2.0, 1.1]], dtype=torch.float64)
    logp = ratios.log().requires_grad_()
    mask = torch.ones(1, 2)
    for a, tau in ((1.0, 1.0), (-1.0, 1.05)):
        loss, metrics = sapo.compute_loss(logp, old, None, torch.tensor([a], dtype=torch.float64), mask, ARGS)
        p = [sigmoid(tau * (r - 1)) for r in (2.0, 1.1)]
        assert loss.item() == pytest.approx(-a * (4 / tau) * (p[0] + p[1]) / 2, rel=1e-12)
        weight = [4 * q * (1 - q) for q in p]
        torch.testing.assert_close(torch.autograd.grad(loss, logp)[0],
                                   torch.tensor([[-a * weight[0] * 2.0 / 2, -a * weight[1] * 1.1 / 2]],
                                                dtype=torch.float64))
        assert metrics["policy/gate_weight_min"].item() == pytest.approx(weight[0], rel=1e-12)
    assert 4 * sigmoid(1.05) * (1 - sigmoid(1.05)) < 4 * sigmoid(1.0) * (1 - sigmoid(1.0))  # tau_neg decays faster
    ppo = grpo.compute_loss(logp, old, None, torch.tensor([1.0], dtype=torch.float64), mask,
                            grpo.Args(num_generations=1, beta=0.0))[0]
    assert torch.autograd.grad(ppo, logp)[0][0, 0] == 0  # PPO: that token's gradient is gone


def test_k3_kl_joins_the_token_means_and_tis_scales_only_the_gated_term():
    logp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old, ref = logp.detach() - 0.1, logp.detach() + 0.3
    mask, A = torch.tensor([[1, 1], [1, 0]]), torch.tensor([1.0, -1.0], dtype=torch.float64)
    tis = torch.tensor([[0.5, 2.0], [1.5, 0.0]], dtype=torch.float64)
    loss, metrics = sapo.compute_loss(logp, old, ref, A, mask, replace(ARGS, beta=0.1), tis_weights=tis)
    r, k3 = math.exp(0.1), math.exp(0.3) - 0.3 - 1
    f_pos, f_neg = 4 / 1.0 * sigmoid(1.0 * (r - 1)), 4 / 1.05 * sigmoid(1.05 * (r - 1))
    expected = -((f_pos * 0.5 + f_pos * 2.0 - 2 * 0.1 * k3) / 2 + (-f_neg * 1.5 - 0.1 * k3)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["policy/kl"].item() == pytest.approx(k3)


# Against loops straight from the paper's objective, and micro-batches


def reference_loss(logp, old, ref, A, mask, args, tis=None):
    """The paper's objective, token by token with torch scalars: -(1/B) sum_i (1/|y_i|) sum_t f_i,t(r_i,t) A_i,
    f_i,t(x) = sigmoid(tau_i (x - 1)) 4 / tau_i (minus beta times the k3 KL, inside the token means)."""
    B, T = logp.shape
    total, rows = 0.0, 0
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        if not valid:
            continue
        tau = args.tau_pos if A[i] > 0 else args.tau_neg
        row = 0.0
        for t in valid:
            r = torch.exp(logp[i, t] - old[i, t])
            term = torch.sigmoid(tau * (r - 1)) * 4 / tau * A[i] * (1.0 if tis is None else tis[i, t])
            if args.beta > 0:
                term = term - args.beta * (torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1)
            row = row + term
        total, rows = total + row / len(valid), rows + 1
    return -total / rows


def random_batch(seed=0, B=8, T=5, spread=1.0):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread  # ratios far from 1: gates far from 1/2
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])  # row 6 removed (no valid token)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T) unequal lengths, right-padded
    A = sapo.compute_advantages(torch.rand(B, dtype=torch.float64), replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_matches_the_papers_objective_and_micro_batches_sum_to_the_full_batch(beta, with_tis, tau_pos, tau_neg):
    args = replace(ARGS, num_generations=4, beta=beta, tau_pos=tau_pos, tau_neg=tau_neg)
    logp, old, ref, A, mask, tis = random_batch()
    tis = tis if with_tis else None
    loss, metrics = sapo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected = reference_loss(logp, old, ref, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    assert metrics["policy/gate_weight_min"] < 0.5  # some gates far off-policy
    stats = sapo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_rows"]
    assert stats.per_row_values() == {} and stats.num_rows.item() == 7
    micro = sum(sapo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                  tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    """torch.autograd.gradcheck on the loss as a function of logp: the gate is smooth everywhere."""
    logp, old, ref, A, mask, tis = random_batch(seed=3)
    args = replace(ARGS, num_generations=4, beta=0.04)
    assert torch.autograd.gradcheck(lambda x: sapo.compute_loss(x, old, ref, A, mask, args, tis_weights=tis)[0],
                                    (logp.detach().requires_grad_(),))


# Against TRL 1.16's own code


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("tau_pos, tau_neg, rel, atol", [(0.5, 2.0, 1e-12, 1e-15), (1.0, 1.05, 1e-6, 1e-7)])
def test_equals_trls_sapo_loss_and_gradient(beta, with_tis, tau_pos, tau_neg, rel, atol):
    """TRL averages over all B rows (a row without valid tokens would count): the batch here has none, as TRL's
    trainer never builds one. TRL builds its temperatures with torch.where on Python floats, in float32: 1.05 is
    1.0499999523 there (5e-8 relative, 4e-8 on this loss); temperatures exact in float32 (0.5, 2.0) compare to 1e-12."""
    logp, old, ref, A, mask, tis = random_batch(seed=2)
    mask[6, 0] = 1  # no removed row
    tis = tis * mask if with_tis else None
    args = replace(sapo.Args(), num_generations=4, beta=beta, tau_pos=tau_pos, tau_neg=tau_neg)
    ours = sapo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)[0]
    theirs = trl_grpo_loss("sapo", logp, old, ref, A, mask.float(), beta, tis, sapo_temperature_pos=tau_pos,
                            sapo_temperature_neg=tau_neg)
    assert ours.item() == pytest.approx(theirs.item(), rel=rel, abs=atol)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=rel, atol=atol)
    assert (A > 0).any() and (A < 0).any()  # both temperatures are in the comparison


# End to end


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    """Two passes over each batch in two mini-batches, with temperatures high enough that the gates move off 1: the
    mean over rows has the optimizer batch's denominator, whatever the micro-batches and processes."""
    flags = STALE + ["--tau_pos", "200", "--tau_neg", "200"]
    assert_stale_updates_agree(in_toy_workdir, "sapo.py", "sapo", flags, lambda m: m["policy/gate_weight_mean"] < 0.99)


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(sapo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                            "--run_name", "sapo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("sapo"), evals


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = sapo.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)
