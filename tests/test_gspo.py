"""gspo.compute_advantages / compute_loss against hand-computed values and gradients, then end-to-end runs."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_train import SMALL, assert_same_gradient, sgd_gradient

import grpo
import gspo

ARGS = gspo.Args(num_generations=2)


def test_defaults_are_the_papers_and_there_are_no_other_switches():
    args = gspo.Args()
    assert (args.epsilon, args.epsilon_high, args.beta) == (3e-4, 4e-4, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(gspo.Args)} - shared == {"beta", "epsilon", "epsilon_high"}


def test_zscore_advantages_by_hand():
    # group 1: rewards (1, 0, 0, 0): mean 0.25, unbiased std 0.5; group 2: all equal -> 0
    A = gspo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3]), replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6))


def reference(logp, old, ref, A, mask, args, tis=None):
    """Loss and d loss / d logp with loops over tokens, straight from the objective of docs/estimators/gspo.md."""
    B, T = logp.shape
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        L, a = len(valid), float(A[i])
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in valid) / L)  # geometric mean of token ratios
        s_clip = min(max(s, 1 - args.epsilon), 1 + args.epsilon_high)
        w = sum(float(tis[i, t]) for t in valid) / L if tis is not None else 1.0  # mean TIS weight of the row
        d = {t: float(ref[i, t] - logp[i, t]) for t in valid}  # Python floats: the loops use no tensor math
        kl = {t: math.exp(d[t]) - d[t] - 1 for t in valid} if args.beta else {}
        loss -= (min(s * a, s_clip * a) * w - args.beta * sum(kl.values()) / L) / B
        d_surrogate = a if s * a <= s_clip * a else 0.0  # the min keeps the unclipped branch, or s is in range
        for t in valid:  # d s / d logp_t = s / L (the gradient flows through the mean)
            grad[i][t] = -d_surrogate * w * s / L / B
            if args.beta:
                grad[i][t] += args.beta * (1 - math.exp(d[t])) / L / B
    return loss, torch.tensor(grad, dtype=torch.float64)


def random_batch(seed=0, B=8, T=6, spread=0.02):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([6, 1, 3, 4, 2, 6, 5, 1])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T) unequal lengths, right-padded
    A = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.7, -0.3], dtype=torch.float64)[:B]
    tis = torch.rand(B, T, dtype=torch.float64) * 2 * mask
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("with_tis", [False, True])
def test_loss_and_gradient_match_the_loops(beta, with_tis):
    logp, old, ref, A, mask, tis = random_batch()
    args = replace(ARGS, beta=beta, epsilon=0.01, epsilon_high=0.015)
    tis = tis if with_tis else None
    loss, metrics = gspo.compute_loss(logp=logp, old_logp=old, ref_logp=ref if beta else None, advantages=A,
                                      mask=mask, args=args, tis_weights=tis)
    expected_loss, expected_grad = reference(logp.detach(), old, ref, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert 0 < metrics["policy/clip_frac"].item() < 1  # the batch exercises both branches of the clip
    assert metrics["loss/policy"].item() == loss.item() and not metrics["loss/policy"].requires_grad
    assert ("policy/kl" in metrics) == (beta > 0)


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])  # lengths 2, 3 and 1
    return logp, mask, torch.tensor([1.0, -2.0, 0.5])


def test_on_policy_ratio_is_one_and_the_gradient_is_grpos():
    logp, mask, A = on_policy_batch()
    loss, metrics = gspo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    for key in ("policy/seq_ratio_mean", "policy/seq_ratio_min", "policy/seq_ratio_max"):
        assert metrics[key].item() == 1.0
    assert metrics["policy/clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)  # s_i = 1: -(1/B) sum_i A_i
    (grad,) = torch.autograd.grad(loss, logp)
    # d loss / d logp[i, t] = -A_i / (B * L_i) on valid tokens, the policy gradient
    expected = torch.tensor([[-1 / 6, -1 / 6, 0.0], [2 / 9, 2 / 9, 2 / 9], [-0.5 / 3, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected)
    grpo_args = grpo.Args(num_generations=3, beta=0.0, epsilon=ARGS.epsilon, epsilon_high=ARGS.epsilon_high)
    grpo_loss, _ = grpo.compute_loss(logp, logp.detach(), None, A, mask, grpo_args)
    torch.testing.assert_close(grad, torch.autograd.grad(grpo_loss, logp)[0])


def test_a_sequence_outside_the_range_on_the_pessimistic_side_gets_no_gradient():
    # two tokens per row, token log-ratios (3e-3, -1e-3) or (-3e-3, 1e-3): mean +-1e-3, s = exp(+-1e-3)
    up, down = [3e-3, -1e-3], [-3e-3, 1e-3]
    delta = torch.tensor([up, up, down, down], dtype=torch.float64)  # (4, 2)
    old = torch.full((4, 2), -1.0, dtype=torch.float64)
    logp = (old + delta).requires_grad_()
    A = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss, metrics = gspo.compute_loss(logp, old, None, A, torch.ones(4, 2), replace(ARGS, num_generations=4))
    s_up, s_down = math.exp(1e-3), math.exp(-1e-3)
    # min(s A, clip(s) A): 1.0004 | -s_up | s_down | -(1 - 3e-4)
    assert loss.item() == pytest.approx(-(1.0004 - s_up + s_down - 0.9997) / 4, rel=1e-9)
    (grad,) = torch.autograd.grad(loss, logp)
    # rows 0 (s > 1 + eps_high, A > 0) and 3 (s < 1 - eps, A < 0) are clipped: zero gradient;
    # rows 1 and 2 keep -A s / (B L) on every token, whatever the sign of each token's own log-ratio
    expected = torch.tensor([[0.0, 0.0], [s_up / 8, s_up / 8], [-s_down / 8, -s_down / 8], [0.0, 0.0]])
    torch.testing.assert_close(grad, expected.double())
    assert metrics["policy/clip_frac"].item() == 0.5
    assert metrics["policy/seq_ratio_max"].item() == pytest.approx(s_up)
    assert metrics["policy/seq_ratio_min"].item() == pytest.approx(s_down)


def test_clip_fraction_counts_tokens_of_clipped_completions():
    # GSPO's Figure 4 reports the fraction of clipped tokens: a clipped 3-token completion next to an
    # unclipped 1-token one is 3/4 of the tokens
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.01, 0.01, 0.01], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    _, metrics = gspo.compute_loss(logp, old, None, torch.tensor([1.0, -1.0]), mask, replace(ARGS, num_generations=2))
    assert metrics["policy/clip_frac_high"].item() == pytest.approx(0.75)
    assert metrics["policy/clip_frac_low"].item() == 0.0 and metrics["policy/clip_frac"].item() == pytest.approx(0.75)


def test_k3_kl_is_a_mean_over_each_sequence_then_over_sequences():
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5, -1.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    k = lambda d: math.exp(d) - d - 1  # noqa: E731
    loss, metrics = gspo.compute_loss(logp, logp.detach(), ref, torch.zeros(2), mask, replace(ARGS, beta=0.1))
    assert loss.item() == pytest.approx(0.1 * ((k(-0.5) + k(0.5) + 0) / 3 + k(-1.0)) / 2)
    assert "policy/kl" in metrics


def test_tis_weights_scale_each_sequence_by_their_token_mean():
    logp, mask, A = on_policy_batch()
    w = torch.tensor([[0.5, 2.0, 9.0], [1.0, 1.0, 1.0], [3.0, 7.0, 7.0]])
    loss, _ = gspo.compute_loss(logp, logp.detach(), None, A, mask, ARGS, tis_weights=w)
    assert loss.item() == pytest.approx(-(1 * (0.5 + 2.0) / 2 + (-2) * 1.0 + 0.5 * 3.0) / 3)


def test_micro_batches_sum_to_the_full_batch_loss_and_gradient():
    logp, old, ref, A, mask, tis = random_batch(seed=1)
    args = replace(ARGS, num_generations=4, beta=0.04, epsilon=0.01, epsilon_high=0.015)
    loss, _ = gspo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    stats = gspo.batch_stats(A, mask, args)
    assert stats.per_row_values() == {} and [f.name for f in dataclasses.fields(stats)] == ["num_rows"]
    assert stats.num_rows.dim() == 0 and stats.num_rows.item() == 8
    micro = sum(gspo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, tis_weights=tis[s], stats=stats)[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


@pytest.mark.slow
@pytest.mark.precondition
def test_micro_batch_size_does_not_change_the_gradient(in_toy_workdir):
    grads = {mb: sgd_gradient(in_toy_workdir, f"gspo_micro{mb}", SMALL + ["--micro_batch_size", str(mb)],
                              script="gspo.py") for mb in (1, 16)}
    assert_same_gradient(grads[1], grads[16])


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    # run name not "learns": test_train.py's run would share the session's folder (metrics.jsonl appends)
    run = run_script(gspo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                            "--run_name", "gspo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("gspo"), evals


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = gspo.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)
