"""luspo.compute_advantages / compute_loss by hand, against loops from the paper's objective (GSPO's, scaled by
length), against TRL 1.16's own GRPOTrainer._compute_loss (loss_type="luspo", importance_sampling_level="sequence"),
then an end-to-end run."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from peers import trl_grpo_loss

import grpo
import gspo
import landscape
import luspo

ARGS = luspo.Args(num_generations=2)


def test_defaults_and_there_are_no_other_switches():
    args = luspo.Args()
    # TRL 1.16's GRPOConfig defaults (epsilon 0.2, epsilon_high = epsilon, beta 0): the authors' are not read here
    assert (args.epsilon, args.epsilon_high, args.beta) == (0.2, 0.2, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(luspo.Args)} - shared == {"beta", "epsilon", "epsilon_high"}


def test_zscore_advantages_are_grpos():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    A = luspo.compute_advantages(rewards, replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6))
    torch.testing.assert_close(A, grpo.compute_advantages(rewards, grpo.Args(num_generations=4)))


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])  # lengths 2, 3 and 1
    return logp, mask, torch.tensor([1.0, -2.0, 0.5])


def test_on_policy_loss_and_gradient_are_gspos_times_each_length():
    """s_i = 1: the loss is -(1/B) sum_i L_i A_i, and d loss / d logp_t = -A_i / B on every valid token (s_i / L_i
    times L_i): each token counts alike, whatever its completion's length; GSPO's is -A_i / (B L_i). That is also
    GRPO's --loss_agg token-sum-norm with max_completion_length 1."""
    logp, mask, A = on_policy_batch()
    loss, metrics = luspo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert metrics["policy/seq_ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(-(2 * 1.0 + 3 * -2.0 + 1 * 0.5) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0], [0.5, 0.0, 0.0]]) / 3
    torch.testing.assert_close(grad, expected)
    gspo_args = gspo.Args(num_generations=3, epsilon=0.2, epsilon_high=0.2)
    gspo_grad = torch.autograd.grad(gspo.compute_loss(logp, logp.detach(), None, A, mask, gspo_args)[0], logp)[0]
    torch.testing.assert_close(grad, gspo_grad * mask.sum(-1, keepdim=True))
    sum_norm = landscape.Args(num_generations=3, beta=0.0, loss_agg="token-sum-norm", max_completion_length=1)
    torch.testing.assert_close(torch.autograd.grad(landscape.compute_loss(logp, logp.detach(), None, A, mask,
                                                                      sum_norm)[0], logp)[0], expected)


def test_a_sequence_outside_the_range_on_the_pessimistic_side_gets_no_gradient():
    """Rows of 1 and 3 tokens with mean log-ratio +-0.3 (s = e^+-0.3, outside [0.8, 1.2]): clipped where A pushes
    further (A > 0 above, A < 0 below), kept otherwise with -A s / B on every token; the loss carries L_i."""
    old = torch.zeros(4, 3, dtype=torch.float64)
    up, down = 0.3, -0.3
    logp = torch.tensor([[up, 0, 0], [up, up, up], [down, down, down], [down, 0, 0]],
                        dtype=torch.float64).requires_grad_()
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss, metrics = luspo.compute_loss(logp, old, None, A, mask, replace(ARGS, num_generations=4))
    s_up, s_down = math.exp(up), math.exp(down)
    # min(s A, clip(s) A): 1.2 (clipped) | -s_up | s_down | -0.8 (clipped); times L_i = 1, 3, 3, 1
    assert loss.item() == pytest.approx(-(1.2 - 3 * s_up + 3 * s_down - 0.8) / 4, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[0.0, 0, 0], [s_up / 4] * 3, [-s_down / 4] * 3, [0.0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    assert metrics["policy/clip_frac"].item() == pytest.approx(2 / 8)  # the 2 tokens of the clipped rows


# Against loops straight from the objective, and micro-batches


def reference(logp, old, ref, A, mask, args, tis=None):
    """Loss and d loss / d logp with Python floats: L = -(1/B') sum_i [sum_t mask tis_t min(s_i A_i, clip(s_i) A_i)
    - beta sum_t mask kl_t], B' the rows with a valid token, s_i = exp(mean_t delta_t)."""
    B, T = logp.shape
    rows = [i for i in range(B) if any(mask[i, t] for t in range(T))]
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in rows:
        valid = [t for t in range(T) if mask[i, t]]
        L, a = len(valid), float(A[i])
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in valid) / L)
        s_clip = min(max(s, 1 - args.epsilon), 1 + args.epsilon_high)
        w = sum(float(tis[i, t]) for t in valid) if tis is not None else L  # sum_t tis_t, else L_i
        d = {t: float(ref[i, t] - logp[i, t]) for t in valid}
        kl = sum(math.exp(d[t]) - d[t] - 1 for t in valid) if args.beta else 0.0
        loss -= (min(s * a, s_clip * a) * w - args.beta * kl) / len(rows)
        slope = a if s * a <= s_clip * a else 0.0  # the unclipped branch, or s inside the range
        for t in valid:  # d s / d logp_t = s / L
            grad[i][t] = -slope * w * s / L / len(rows)
            if args.beta:
                grad[i][t] += args.beta * (1 - math.exp(d[t])) / len(rows)
    return loss, torch.tensor(grad, dtype=torch.float64)


def random_batch(seed=0, B=8, T=6, spread=0.3):
    """Right-padded rows of unequal lengths, row 6 removed (no valid token), row 0 with an extreme ratio (a token
    log-ratio of 30: s_0 = e^5), the others spread enough that both sides of the clip are hit."""
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread
    old[0, 2] = logp[0, 2].detach() - 30.0
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([6, 1, 3, 4, 2, 5, 0, 1])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    A = luspo.compute_advantages(torch.rand(B, dtype=torch.float64), replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
def test_matches_the_objective_and_micro_batches_sum_to_the_full_batch(beta, with_tis):
    args = replace(ARGS, num_generations=4, beta=beta, epsilon=0.1, epsilon_high=0.15)
    logp, old, ref, A, mask, tis = random_batch()
    tis = tis if with_tis else None
    loss, metrics = luspo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected_loss, expected_grad = reference(logp.detach(), old, ref, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    torch.testing.assert_close(full_grad, expected_grad, rtol=1e-10, atol=1e-15)
    assert 0 < metrics["policy/clip_frac"].item() < 1 and metrics["policy/seq_ratio_max"] > 100
    stats = luspo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_rows"] and stats.num_rows.item() == 7
    micro = sum(luspo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                   tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


# Against TRL 1.16's own code


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.15), (3e-4, 4e-4)])
def test_equals_trls_luspo_loss_and_gradient(beta, with_tis, eps):
    """TRL's LUSPO averages over all B rows, a removed row among them (its term is 0): ours over the rows with a
    valid token, so TRL's loss times B / B' is ours. TRL's vLLM ratio multiplies the per-token loss, as ours."""
    logp, old, ref, A, mask, tis = random_batch(seed=2)
    args = replace(luspo.Args(), num_generations=4, beta=beta, epsilon=eps[0], epsilon_high=eps[1])
    tis = tis if with_tis else None
    ours = luspo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)[0]
    theirs = trl_grpo_loss("luspo", logp, old, ref, A, mask.double(), beta, tis, epsilon_low=eps[0],
                           epsilon_high=eps[1], importance_sampling_level="sequence")
    B, kept = mask.shape[0], int((mask.sum(-1) > 0).sum())
    assert kept == B - 1  # row 6 removed
    theirs = theirs * B / kept
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-12, atol=1e-15)
    assert (A > 0).any() and (A < 0).any()


@pytest.mark.peer
def test_equals_trl_with_no_removed_row_without_rescaling():
    logp, old, ref, A, mask, tis = random_batch(seed=3)
    mask[6, :2] = 1  # no removed row: TRL's B is ours
    ours = luspo.compute_loss(logp, old, ref, A, mask, replace(luspo.Args(), num_generations=4), tis_weights=tis)[0]
    theirs = trl_grpo_loss("luspo", logp, old, ref, A, mask.double(), 0.0, tis, importance_sampling_level="sequence")
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-12, atol=1e-15)


# End to end


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(luspo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                             "--run_name", "luspo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("luspo"), evals
