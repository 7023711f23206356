"""dro.compute_advantages / compute_loss by hand, against verl 0.9.1's own `compute_policy_loss_dro` (loss_mode "dro",
the first verl release on PyPI that ships it; 0.8.0 has none), loaded from its wheel as tests/test_reinforcepp.py
loads 0.5.0's, on float64 batches with padding, a removed row and extreme log-ratios, then an end-to-end run."""

import dataclasses
import math
import types
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_reinforcepp import load_verl_core_algos

import dro
import grpo
import landscape

ARGS = dro.Args(num_generations=2)
VERL_DRO = "0.9.1"


@pytest.fixture(scope="session")
def verl_0_9_core_algos(tmp_path_factory):
    """verl 0.9.1's core_algos (its `compute_policy_loss_dro` and `agg_loss`), from the wheel."""
    return load_verl_core_algos(tmp_path_factory, VERL_DRO)


def test_defaults_and_there_are_no_other_switches():
    args = dro.Args()
    # verl's dro_beta has no default (required > 0): 0.05 is its own test's; no KL to the reference (use_kl_loss off)
    assert (args.tau, args.beta) == (0.05, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(dro.Args)} - shared == {"beta", "tau"}


def test_advantages_are_the_reward_less_the_group_mean_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    A = dro.compute_advantages(rewards, replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))


def test_loss_and_gradient_by_hand():
    """Two tokens moved by delta = 0.5 and -1: the loss -(1/n) sum [A logp - tau/2 delta^2], its gradient
    -(1/n) (A - tau delta): the penalty pulls each token back toward old_logp, whatever A's sign."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.5, -1.0], [0.0, 0.0]], dtype=torch.float64)
    mask, A = torch.tensor([[1, 1], [1, 0]]), torch.tensor([2.0, -1.0], dtype=torch.float64)
    args = replace(ARGS, tau=0.1)
    loss, metrics = dro.compute_loss(logp, old, None, A, mask, args)
    expected = -(2.0 * -1.0 - 0.05 * 0.25 + 2.0 * -2.0 - 0.05 * 1.0 + -1.0 * -0.5) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -torch.tensor([[2.0 - 0.05, 2.0 + 0.1], [-1.0, 0.0]], dtype=torch.float64) / 3)
    assert metrics["dro/squared_log_ratio"].item() == pytest.approx(1.25 / 3)


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: the penalty and its gradient are 0; the gradient is -A_i / n on every valid token, GRPO's
    --loss_agg token-mean gradient with DRO's advantages."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask, A = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]]), torch.tensor([1.0, -2.0, 0.5])
    loss, metrics = dro.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["dro/squared_log_ratio"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [2.0, 2.0, 2.0], [-0.5, 0.0, 0.0]]) / 6
    torch.testing.assert_close(grad, expected)
    token_mean_args = landscape.Args(num_generations=1, beta=0.0, loss_agg="token-mean")
    token_mean = landscape.compute_loss(logp, logp.detach(), None, A, mask, token_mean_args)[0]
    torch.testing.assert_close(torch.autograd.grad(token_mean, logp)[0], expected)


def test_tis_scales_only_the_policy_term_and_the_k3_kl_joins_the_token_mean():
    logp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old, ref = logp.detach() - 0.2, logp.detach() + 0.3
    mask, A = torch.tensor([[1, 1], [1, 0]]), torch.tensor([1.0, -1.0], dtype=torch.float64)
    tis = torch.tensor([[0.5, 2.0], [1.5, 0.0]], dtype=torch.float64)
    args = replace(ARGS, beta=0.1, tau=0.2)
    loss, metrics = dro.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    k3, quad = math.exp(0.3) - 0.3 - 1, 0.1 * 0.04
    expected = -(-1.0 * 0.5 - 1.0 * 2.0 + 2.0 * 1.5 - 3 * quad - 3 * 0.1 * k3) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["policy/kl"].item() == pytest.approx(k3)


def random_batch(seed=0, B=12, T=6):
    """float64; unequal lengths, right padding (garbage log-probs there), row 10 removed (no valid token), a group of
    equal rewards (A = 0), log-ratios up to +-40 on a few tokens."""
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.5 - 1).clamp(max=0)  # (B, T)
    old = logp + torch.randn(B, T, dtype=torch.float64) * 0.5  # (B, T)
    old[0, 1], old[3, 2] = logp[0, 1] - 40.0, logp[3, 2] + 40.0  # extreme ratios e^40 and e^-40
    lengths = torch.tensor([6, 1, 3, 4, 2, 5, 0, 6, 3, 6, 0, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    logp = torch.where(mask > 0, logp, torch.full_like(logp, 3.0)).requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    A = dro.compute_advantages(rewards, replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, A, mask, tis


@pytest.mark.peer
@pytest.mark.parametrize("tau", [0.05, 0.5])
def test_equals_verls_dro_loss_and_gradient(verl_0_9_core_algos, tau):
    """verl's compute_policy_loss_dro with loss_agg_mode token-mean (one process: batch_num_tokens None, dp_size 1)
    on the same tensors, A broadcast over the tokens: loss and gradient to 1e-12."""
    logp, old, A, mask, _ = random_batch(seed=2)
    ours, _ = dro.compute_loss(logp, old, None, A, mask, replace(ARGS, num_generations=4, tau=tau))
    config = types.SimpleNamespace(policy_loss=types.SimpleNamespace(dro_beta=tau), global_batch_info={})
    theirs, metrics = verl_0_9_core_algos.compute_policy_loss_dro(old, logp, A[:, None].expand_as(logp),
                                                                  mask.double(), "token-mean", config)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-12, atol=1e-15)
    assert ((logp - old).abs()[mask > 0] > 39).sum() == 2  # the extremes are in the comparison
    with pytest.raises(ValueError, match="dro_beta must be a positive"):  # verl refuses tau 0
        verl_0_9_core_algos.compute_policy_loss_dro(old, logp, A[:, None].expand_as(logp), mask.double(),
                                                    "token-mean", types.SimpleNamespace(
                                                        policy_loss=types.SimpleNamespace(dro_beta=0.0)))


@pytest.mark.parametrize("beta, with_tis", [(0.0, False), (0.04, True)])
def test_micro_batches_sum_to_the_full_batch_loss_and_gradient(beta, with_tis):
    logp, old, A, mask, tis = random_batch(seed=3)
    ref = logp.detach() + 0.2
    tis = tis if with_tis else None
    args = replace(ARGS, num_generations=4, beta=beta)
    loss, _ = dro.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    stats = dro.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"] and stats.num_tokens.item() == mask.sum()
    slices = [slice(0, 1), slice(1, 4), slice(4, 9), slice(9, 12)]
    micro = sum(dro.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                 tis_weights=None if tis is None else tis[s])[0] for s in slices)
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    logp, old, A, mask, tis = random_batch(seed=4)
    args = replace(ARGS, num_generations=4, beta=0.04, tau=0.5)
    ref = logp.detach() + 0.1
    assert torch.autograd.gradcheck(lambda x: dro.compute_loss(x, old, ref, A, mask, args, tis_weights=tis)[0],
                                    (logp.detach().requires_grad_(),))


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(dro, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                           "--run_name", "dro_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("dro"), evals
