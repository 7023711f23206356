"""landscape.py: the landscape paper's switches (sign advantages, PL / NL, token-sum-norm, token-mean) against
hand-computed values, a loop reference and TRL's loss types; with no switch it is grpo.py, to the bit."""

import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from peers import trl_grpo_loss

import grpo
import landscape

ARGS = landscape.Args(num_generations=2, beta=0.0, epsilon=0.2, epsilon_high=0.2, max_completion_length=4)


def test_sign_advantages():
    # means 1/3, 4 and 7: signs of the centred rewards, 0 for a group of equal rewards
    A = landscape.compute_advantages(torch.tensor([1.0, 0, 0, 2, 5, 5, 7, 7, 7]), replace(ARGS, num_generations=3,
                                                                                      advantage="sign"))
    torch.testing.assert_close(A, torch.tensor([1.0, -1, -1, -1, 1, 1, 0, 0, 0]))


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)  # (B=2, T=3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # lengths 2 and 3
    return logp, mask


def test_train_on_positive_and_negative_average_over_kept_rows():
    logp, mask = on_policy_batch()
    A = torch.tensor([1.0, -2.0])
    loss_pos, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, train_on="positive"))
    loss_neg, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, train_on="negative"))
    assert loss_pos.item() == pytest.approx(-1.0)  # only row 0, averaged over 1 kept row
    assert loss_neg.item() == pytest.approx(2.0)


def test_a_row_with_zero_advantage_is_neither_positive_nor_negative():
    """PL keeps A > 0 and NL A < 0: a row of a group with equal rewards (A = 0) is in neither denominator."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0]], requires_grad=True)
    mask = torch.ones(3, 2)
    A = torch.tensor([1.0, 0.0, -2.0])
    loss_pos, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, train_on="positive"))
    loss_neg, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, train_on="negative"))
    assert loss_pos.item() == pytest.approx(-1.0)  # row 0 alone, not (row 0 + row 1) / 2
    assert loss_neg.item() == pytest.approx(2.0)


def test_token_sum_norm_divides_by_batch_times_max_length():
    logp, mask = on_policy_batch()
    A = torch.tensor([1.0, -2.0])
    loss, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, loss_agg="token-sum-norm"))
    assert loss.item() == pytest.approx(-(1 * 2 + (-2) * 3) / (2 * 4))


def test_token_mean_divides_by_the_batch_token_count():
    logp, mask = on_policy_batch()  # lengths 2 and 3: 5 tokens
    A = torch.tensor([1.0, -2.0])
    loss, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, loss_agg="token-mean"))
    assert loss.item() == pytest.approx(-(1 * 2 + (-2) * 3) / 5)  # every token weighs 1/5, not 1/(B L_i)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 5, -1 / 5, 0.0], [2 / 5, 2 / 5, 2 / 5]]))
    # PL keeps row 0 only: its 2 tokens are the denominator
    loss_pos, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, loss_agg="token-mean",
                                                                                 train_on="positive"))
    assert loss_pos.item() == pytest.approx(-1.0)
    stats = landscape.batch_stats(A, mask, replace(ARGS, train_on="positive"))
    assert (stats.num_rows.item(), stats.num_tokens.item()) == (1, 2) and stats.per_row_values() == {}


def reference_loss(logp, old, ref, A, mask, args):
    """Loops, straight from the objective of docs/estimators/landscape.md."""
    B, T = logp.shape
    keep = [bool(args.train_on == "all" or (args.train_on == "positive" and A[i] > 0)
                 or (args.train_on == "negative" and A[i] < 0)) for i in range(B)]
    total, tokens = 0.0, 0
    for i in range(B):
        if not keep[i]:
            continue
        L = sum(mask[i]).item()
        tokens += L
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
        norm = args.max_completion_length if args.loss_agg == "token-sum-norm" else L
        total += s if args.loss_agg == "token-mean" else s / norm
    return -float(total) / max(tokens if args.loss_agg == "token-mean" else sum(keep), 1)  # pytest.approx: no tensors


@pytest.mark.parametrize("train_on", ["all", "positive", "negative"])
@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "token-sum-norm"])
def test_matches_reference_and_micro_batches_sum_to_full_batch(train_on, loss_agg):
    torch.manual_seed(0)
    B, T = 8, 5
    args = replace(ARGS, num_generations=4, beta=0.04, epsilon_high=0.28, train_on=train_on, loss_agg=loss_agg,
                   max_completion_length=T)
    logp = (torch.randn(B, T) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T) * 0.3
    ref = logp.detach() + torch.randn(B, T) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 5, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    A = landscape.compute_advantages(torch.rand(B), args)
    loss, _ = landscape.compute_loss(logp=logp, old_logp=old, ref_logp=ref, advantages=A, mask=mask, args=args)
    assert loss.item() == pytest.approx(reference_loss(logp.detach(), old, ref, A, mask, args), rel=1e-5)
    (full_grad,) = torch.autograd.grad(loss, logp)

    stats = landscape.batch_stats(A, mask, args)
    halves = [landscape.batch_stats(A[s], mask[s], args) for s in (slice(0, 4), slice(4, 8))]
    assert halves[0].num_rows + halves[1].num_rows == stats.num_rows  # what the all-reduce adds up
    assert halves[0].num_tokens + halves[1].num_tokens == stats.num_tokens
    # Each process's sums go through `total`, the loop's all-reduce: two processes with these rows each double them.
    doubled = landscape.batch_stats(A, mask, args, total=lambda x: 2 * x)
    assert (doubled.num_rows, doubled.num_tokens) == (2 * stats.num_rows, 2 * stats.num_tokens)
    micro = sum(landscape.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats)[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


# Against TRL 1.16's own code


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_agg, trl_loss_type", [("seq-mean-token-mean", "grpo"), ("token-mean", "dapo"),
                                                     ("token-sum-norm", "dr_grpo")])
def test_equals_trls_grpo_loss_and_gradient(beta, loss_agg, trl_loss_type):
    """The three aggregations against TRL's loss types of the same meaning (`grpo`, `dapo`, `dr_grpo`), with a KL
    term or not, on a stale batch (ratios clipped both ways). Every row has a token: where one has none, landscape.py
    averages over the rows that have, TRL over all."""
    torch.manual_seed(3)
    B, T = 8, 5
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    mask = (torch.arange(T)[None] < torch.tensor([5, 1, 3, 4, 2, 5, 2, 1])[:, None]).long()  # (B, T)
    args = replace(landscape.Args(), num_generations=4, beta=beta, loss_agg=loss_agg, max_completion_length=T)
    A = landscape.compute_advantages(torch.rand(B, dtype=torch.float64), args)
    ours = landscape.compute_loss(logp, old, ref, A, mask, args)[0]
    theirs = trl_grpo_loss(trl_loss_type, logp, old, ref, A, mask.float(), beta, epsilon_high=args.epsilon_high,
                           max_completion_length=T)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])
    ratio = torch.exp(logp - old)[mask > 0]
    assert (ratio > 1 + args.epsilon_high).any() and (ratio < 1 - args.epsilon).any()  # both clips reached


def test_a_row_without_valid_tokens_leaves_the_denominator():
    """A removed row (mask all 0: --mask_truncated, an unfilled dynamic-sampling slot) is not counted in the
    denominator: the loss and the gradient are those of test_on_policy_loss_and_gradient_by_hand's two rows, not
    two thirds of them, and batch_stats counts 2 rows and 5 tokens."""
    logp, mask = on_policy_batch()
    logp = torch.cat([logp.detach(), torch.tensor([[-3.0, -1.0, -2.0]])]).requires_grad_()  # row 2: removed
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    A = torch.tensor([1.0, -2.0, 5.0])  # the removed row's advantage must not count either
    loss, _ = landscape.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    # r = 1 everywhere: loss = -(1/2) * (1 * 2/2 + (-2) * 3/3) = 0.5 over the 2 kept rows
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    expected = torch.tensor([[-1 / 4, -1 / 4, 0.0], [2 / 6, 2 / 6, 2 / 6], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    stats = landscape.batch_stats(A, mask, ARGS)
    assert (stats.num_rows.item(), stats.num_tokens.item()) == (2, 5)


@pytest.mark.parametrize("seed", [0, 1])
def test_without_a_switch_it_is_grpo_to_the_bit(seed):
    """The defaults are grpo.py's: the same advantages, statistics, loss, metrics and gradient, bit for bit, on a
    stale ragged batch with a KL term and a removed row."""
    torch.manual_seed(seed)
    B, T = 8, 5
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    mask = (torch.arange(T)[None] < torch.tensor([5, 1, 3, 0, 2, 5, 2, 1])[:, None]).long()  # row 3: removed
    ours_args = landscape.Args(num_generations=4, beta=0.04, max_completion_length=T)
    grpo_args = grpo.Args(num_generations=4, beta=0.04, max_completion_length=T)
    rewards = torch.rand(B, dtype=torch.float64)
    A = landscape.compute_advantages(rewards, ours_args)
    assert torch.equal(A, grpo.compute_advantages(rewards, grpo_args))
    assert landscape.batch_stats(A, mask, ours_args).num_rows == grpo.batch_stats(A, mask, grpo_args).num_rows
    ours, ours_metrics = landscape.compute_loss(logp, old, ref, A, mask, ours_args)
    theirs, grpo_metrics = grpo.compute_loss(logp, old, ref, A, mask, grpo_args)
    assert torch.equal(ours, theirs)
    assert ours_metrics.keys() == grpo_metrics.keys()
    assert all(torch.equal(ours_metrics[k], grpo_metrics[k]) for k in ours_metrics)
    assert torch.equal(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run of CL (--advantage sign; with no switch this is grpo.py's run): held-out greedy accuracy
    must rise by the bar of benchmarks/learning_bars.py's CL runs."""
    run = run_script(landscape, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25", "--advantage", "sign",
                                 "--run_name", "landscape_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("landscape"), evals
