"""gmpo.compute_advantages / compute_loss by hand, against loops over the paper's product form, against TRL 1.16's
own GMPOTrainer._compute_loss (trl.experimental.gmpo), then end-to-end runs."""

import dataclasses
import math
import os
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_snib import STALE, assert_stale_updates_agree

import gmpo
import grpo

ARGS = gmpo.Args(num_generations=2)


def test_defaults_and_there_are_no_other_switches():
    args = gmpo.Args()
    assert (args.epsilon, args.epsilon_high, args.beta) == (0.4, 0.4, 0.0)  # section 4: (e^-0.4, e^0.4); no KL
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(gmpo.Args)} - shared == {"beta", "epsilon", "epsilon_high"}


def test_zscore_advantages_are_grpos():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    torch.testing.assert_close(gmpo.compute_advantages(rewards, replace(ARGS, num_generations=4)),
                               grpo.compute_advantages(rewards, grpo.Args(num_generations=4)))


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: every weight is exp(0) = 1, the loss -(1/B) sum_i A_i, and its gradient -(1/B) A_i / L_i
    on the valid tokens of row i: GRPO's (sequence mean of token means) at ratio 1."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([1.0, -2.0, 0.5])
    loss, metrics = gmpo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    assert metrics["policy/seq_ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -torch.tensor([[1.0 / 2, 1.0 / 2, 0.0], [-2.0 / 3, -2.0 / 3, -2.0 / 3], [0.5, 0.0, 0.0]]) / 3
    torch.testing.assert_close(grad, expected)
    grpo_loss = grpo.compute_loss(logp, logp.detach(), None, A, mask, grpo.Args(num_generations=1, beta=0.0))[0]
    torch.testing.assert_close(torch.autograd.grad(grpo_loss, logp)[0], expected)


def test_a_token_is_clipped_in_log_space_on_the_side_its_advantage_pushes():
    """d = (0.6, 0.1): with A > 0 the first token's log-ratio is held at 0.4 (no gradient), the weight is
    exp((0.4 + 0.1) / 2); with A < 0 it is not clipped (PPO's min keeps the pessimistic side) and both tokens keep
    their gradient, weight exp(0.35) / 2 each."""
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[0.6, 0.1]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2)
    loss, metrics = gmpo.compute_loss(logp, old, None, torch.tensor([1.0], dtype=torch.float64), mask, ARGS)
    assert loss.item() == pytest.approx(-math.exp(0.25))
    assert metrics["policy/clip_frac_high"].item() == 0.5
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0],
                               torch.tensor([[0.0, -math.exp(0.25) / 2]], dtype=torch.float64))
    loss, metrics = gmpo.compute_loss(logp, old, None, torch.tensor([-1.0], dtype=torch.float64), mask, ARGS)
    assert loss.item() == pytest.approx(math.exp(0.35)) and metrics["policy/clip_frac"].item() == 0.0
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0],
                               torch.full((1, 2), math.exp(0.35) / 2, dtype=torch.float64))


# Against the paper's product form, and micro-batches


def reference_loss(logp, old, ref, A, mask, args, tis=None):
    """The GMPO objective as written: (1/B) sum_i sgn(A_i) prod_t |min(r_t A_i, clip(r_t, e^-eps, e^eps_high) A_i)|
    ^ (1/L_i), token by token with torch scalars (minus beta times the row's mean k3)."""
    B, T = logp.shape
    total, rows = 0.0, 0
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        if not valid:
            continue
        a, product = A[i], 1.0
        for t in valid:
            r = torch.exp(logp[i, t] - old[i, t])
            r_clip = torch.clamp(r, math.exp(-args.epsilon), math.exp(args.epsilon_high))
            product = product * torch.abs(torch.minimum(r * a, r_clip * a)) ** (1 / len(valid))
        term = torch.sign(a) * product
        if tis is not None:
            term = term * sum(tis[i, t] for t in valid) / len(valid)
        if args.beta > 0:
            term = term - args.beta * sum(torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1
                                          for t in valid) / len(valid)
        total, rows = total + term, rows + 1
    return -total / rows


def random_batch(seed=0, B=8, T=5, spread=0.5):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread  # some |d_t| beyond 0.4
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])  # row 6 removed (no valid token)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    A = gmpo.compute_advantages(torch.rand(B, dtype=torch.float64), replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
def test_matches_the_papers_objective_and_micro_batches_sum_to_the_full_batch(beta, with_tis):
    args = replace(ARGS, num_generations=4, beta=beta)
    logp, old, ref, A, mask, tis = random_batch()
    tis = tis if with_tis else None
    loss, metrics = gmpo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected = reference_loss(logp, old, ref, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    assert 0 < metrics["policy/clip_frac"] < 1  # some tokens clipped, not all
    stats = gmpo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_rows"]
    assert stats.per_row_values() == {} and stats.num_rows.item() == 7
    micro = sum(gmpo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                  tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    logp, old, ref, A, mask, _ = random_batch(seed=3, spread=0.1)  # inside the bounds: smooth there
    args = replace(ARGS, num_generations=4, beta=0.04)
    assert torch.autograd.gradcheck(lambda x: gmpo.compute_loss(x, old, ref, A, mask, args)[0],
                                    (logp.detach().requires_grad_(),))


# Against TRL 1.16's own code


def trl_gmpo_loss(logp, old, ref, A, mask, epsilon, epsilon_high, beta):
    """trl.experimental.gmpo.GMPOTrainer._compute_loss itself, on a stand-in trainer whose forward returns `logp`
    (one process, no accumulation)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns on every import from trl.experimental
    from trl.experimental.gmpo import GMPOTrainer

    accelerator = SimpleNamespace(num_processes=1, reduce=lambda x, reduction="sum": x, gather=lambda x: x)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, epsilon_low=epsilon, epsilon_high=epsilon_high, beta=beta,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=accelerator,
        _metrics=defaultdict(lambda: defaultdict(list)))
    B, T = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": A,
              "old_per_token_logps": old, "ref_per_token_logps": ref}
    return GMPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_equals_trls_gmpo_loss_and_gradient(beta):
    """TRL's GMPO averages over all B rows (a row without valid tokens would count); the batch here has none, as
    TRL's trainer never builds one. TRL applies no sampler-mismatch weight: compared without TIS."""
    logp, old, ref, A, mask, _ = random_batch(seed=2)
    mask[6, 0] = 1  # no removed row
    args = replace(gmpo.Args(), num_generations=4, beta=beta)
    ours = gmpo.compute_loss(logp, old, ref, A, mask, args)[0]
    theirs = trl_gmpo_loss(logp, old, ref, A, mask.float(), args.epsilon, args.epsilon_high, beta)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])
    assert ((logp - old).abs() > 0.4).any()  # some tokens beyond the bounds: the comparison covers the clip


# End to end


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    flags = STALE + ["--epsilon", "0.001", "--epsilon_high", "0.001"]  # bounds tight enough to clip tokens
    assert_stale_updates_agree(in_toy_workdir, "gmpo.py", "gmpo", flags, lambda m: m["policy/clip_frac"] > 0.05)


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(gmpo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                            "--run_name", "gmpo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("gmpo"), evals


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = gmpo.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)
