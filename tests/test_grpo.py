"""grpo.compute_advantages / compute_loss against hand-computed values and gradients."""

import math
from dataclasses import replace

import pytest
import torch
from peers import trl_grpo_loss

import grpo

ARGS = grpo.Args(num_generations=2, beta=0.0, epsilon=0.2, epsilon_high=0.2, max_completion_length=4)


def test_zscore_advantages_by_hand():
    # group 1: rewards (1, 0, 0, 0): mean 0.25, unbiased std 0.5; group 2: all equal -> 0
    A = grpo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3]), replace(ARGS, num_generations=4))
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6)
    torch.testing.assert_close(A, expected)


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)  # (B=2, T=3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # lengths 2 and 3
    return logp, mask


def test_on_policy_loss_and_gradient_by_hand():
    logp, mask = on_policy_batch()
    A = torch.tensor([1.0, -2.0])
    loss, _ = grpo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    # r = 1 everywhere: loss = -(1/2) * (1 * 2/2 + (-2) * 3/3) = 0.5
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    # d loss / d logp[i, t] = -A_i / (B * L_i) on valid tokens
    expected = torch.tensor([[-1 / 4, -1 / 4, 0.0], [2 / 6, 2 / 6, 2 / 6]])
    torch.testing.assert_close(logp.grad, expected)


def test_clipping_zeroes_the_gradient_only_on_the_pessimistic_side():
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_()
    A = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    loss, metrics = grpo.compute_loss(logp, old, None, A, mask, replace(ARGS, num_generations=4))
    # surrogate: min(1.5, 1.2)=1.2 | min(-1.5, -1.2)=-1.5 | min(0.5, 0.8)=0.5 | min(-0.5, -0.8)=-0.8
    assert loss.item() == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8) / 4)
    loss.backward()
    # gradient of -r*A/4 wrt logp is -r*A/4 where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([0.0, 1.5 / 4, -0.5 / 4, 0.0]))
    assert metrics["policy/clip_frac"].item() == pytest.approx(0.5)


def test_k3_kl_term():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5]])
    mask = torch.tensor([[1, 1]])
    args = replace(ARGS, beta=0.1, num_generations=1)
    loss, metrics = grpo.compute_loss(logp, logp.detach(), ref, torch.zeros(1), mask, args)
    kl = [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]
    assert loss.item() == pytest.approx(0.1 * sum(kl) / 2)
    assert metrics["policy/kl"].item() == pytest.approx(sum(kl) / 2)
    loss.backward()
    # d kl / d logp = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, 0.1 * torch.tensor([[1 - math.exp(-0.5), 1 - math.exp(0.5)]]) / 2)


def reference_loss(logp, old, ref, A, mask, args):
    """Loops, straight from the objective of docs/estimators/grpo.md."""
    B, T = logp.shape
    total, rows = 0.0, 0
    for i in range(B):
        L = sum(mask[i]).item()
        if L == 0:
            continue
        rows += 1
        s = 0.0
        for t in range(T):
            if mask[i, t]:
                r = math.exp(logp[i, t] - old[i, t])
                rc = min(max(r, 1 - args.epsilon), 1 + args.epsilon_high)
                term = min(r * A[i], rc * A[i])
                if args.beta > 0:
                    d = ref[i, t] - logp[i, t]
                    term -= args.beta * (math.exp(d) - d - 1)
                s += term
        total += s / L
    return -float(total) / max(rows, 1)  # pytest.approx: no tensors


def test_matches_reference_and_micro_batches_sum_to_full_batch():
    torch.manual_seed(0)
    B, T = 8, 5
    args = replace(ARGS, num_generations=4, beta=0.04, epsilon_high=0.28, max_completion_length=T)
    logp = (torch.randn(B, T) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T) * 0.3
    ref = logp.detach() + torch.randn(B, T) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 5, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    A = grpo.compute_advantages(torch.rand(B), args)
    loss, _ = grpo.compute_loss(logp=logp, old_logp=old, ref_logp=ref, advantages=A, mask=mask, args=args)
    assert loss.item() == pytest.approx(reference_loss(logp.detach(), old, ref, A, mask, args), rel=1e-5)
    (full_grad,) = torch.autograd.grad(loss, logp)

    stats = grpo.batch_stats(A, mask, args)
    halves = [grpo.batch_stats(A[s], mask[s], args) for s in (slice(0, 4), slice(4, 8))]
    assert halves[0].num_rows + halves[1].num_rows == stats.num_rows  # what the all-reduce adds up
    # Each process's sums go through `total`, the loop's all-reduce: two processes with these rows each double them.
    doubled = grpo.batch_stats(A, mask, args, total=lambda x: 2 * x)
    assert doubled.num_rows == 2 * stats.num_rows
    micro = sum(grpo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats)[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_tis_weights_scale_the_policy_term_per_token():
    logp, mask = on_policy_batch()
    A = torch.tensor([1.0, -2.0])
    w = torch.tensor([[0.5, 2.0, 9.0], [1.0, 1.0, 1.0]])
    loss, _ = grpo.compute_loss(logp, logp.detach(), None, A, mask, ARGS, tis_weights=w)
    assert loss.item() == pytest.approx(-(1 * (0.5 + 2.0) / 2 + (-2) * 3 / 3) / 2)


# Against TRL 1.16's own code


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_equals_trls_grpo_loss_and_gradient(beta):
    """GRPO against TRL's `grpo` loss type (what benchmarks/step_time.py --trl and benchmarks/trl_curve.py run TRL
    with), with a KL term or not, on a stale batch (ratios clipped both ways). Every row has a token: where one has
    none, grpo.py averages over the rows that have, TRL over all. The other aggregations: tests/test_landscape.py."""
    torch.manual_seed(3)
    B, T = 8, 5
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    mask = (torch.arange(T)[None] < torch.tensor([5, 1, 3, 4, 2, 5, 2, 1])[:, None]).long()  # (B, T)
    args = replace(grpo.Args(), num_generations=4, beta=beta, max_completion_length=T)
    A = grpo.compute_advantages(torch.rand(B, dtype=torch.float64), args)
    ours = grpo.compute_loss(logp, old, ref, A, mask, args)[0]
    theirs = trl_grpo_loss("grpo", logp, old, ref, A, mask.float(), beta, epsilon_high=args.epsilon_high,
                           max_completion_length=T)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])
    ratio = torch.exp(logp - old)[mask > 0]
    assert (ratio > 1 + args.epsilon_high).any() and (ratio < 1 - args.epsilon).any()  # both clips reached


def test_a_row_without_valid_tokens_leaves_the_denominator():
    """A removed row (mask all 0: --mask_truncated, an unfilled dynamic-sampling slot) is not counted in the
    denominator: the loss and the gradient are those of test_on_policy_loss_and_gradient_by_hand's two rows, not
    two thirds of them, and batch_stats counts 2 rows."""
    logp, mask = on_policy_batch()
    logp = torch.cat([logp.detach(), torch.tensor([[-3.0, -1.0, -2.0]])]).requires_grad_()  # row 2: removed
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    A = torch.tensor([1.0, -2.0, 5.0])  # the removed row's advantage must not count either
    loss, _ = grpo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    # r = 1 everywhere: loss = -(1/2) * (1 * 2/2 + (-2) * 3/3) = 0.5 over the 2 kept rows
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    expected = torch.tensor([[-1 / 4, -1 / 4, 0.0], [2 / 6, 2 / 6, 2 / 6], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    stats = grpo.batch_stats(A, mask, ARGS)
    assert stats.num_rows.item() == 2


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = grpo.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)
