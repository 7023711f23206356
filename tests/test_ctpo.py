"""ctpo.compute_advantages / compute_loss against hand-computed values and gradients, then end-to-end runs."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_train import SMALL, assert_same_gradient, sgd_gradient

import ctpo
import grpo

ARGS = ctpo.Args(num_generations=2)


def test_defaults_are_the_papers_and_there_are_no_other_switches():
    args = ctpo.Args()
    assert (args.clip_low, args.clip_high, args.clip_c, args.clip_power, args.beta) == (0.025, 0.05, 0.05, 0.5, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(ctpo.Args)} - shared == {"beta", "clip_low", "clip_high", "clip_c",
                                                                        "clip_power"}


def test_zscore_advantages_by_hand():
    A = ctpo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3]), replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6))


def reference(logp, old, ref, A, mask, args, tis=None):
    """Loss and d loss / d logp with loops over tokens, straight from the objective of docs/estimators/ctpo.md."""
    B, T = logp.shape
    n = int(mask.sum())
    loss, grad, rhos = 0.0, [[0.0] * T for _ in range(B)], []
    for i in range(B):
        a, c, p = float(A[i]), 0.0, 0
        for t in range(T):
            if not mask[i, t]:
                continue
            p += 1  # 1-based position among the completion's tokens
            c += min(max(float(logp[i, t] - old[i, t]), -20.0), 20.0)  # c_t = sum_{k<=t} d_k
            log_rho = min(c, 10.0)
            rho = math.exp(log_rho)
            rhos.append(rho)
            b = p ** args.clip_power
            rho_clip = math.exp(min(max(log_rho, -args.clip_low * b), args.clip_high * b))
            l1, l2 = -a * rho, -a * rho_clip
            lt = max(l1, l2)
            # only the current token carries the gradient: d rho_t / d logp_t = rho_t (below the cap of 10);
            # l2 is constant wherever it differs from l1 (log rho_t outside the bounds)
            dl = -a * rho if (c < 10 and l1 >= l2) else 0.0
            if a < 0 and lt > -a * math.exp(args.clip_c * b):  # dual clip
                lt, dl = -a * math.exp(args.clip_c * b), 0.0
            w = float(tis[i, t]) if tis is not None else 1.0
            loss += w * lt / n
            grad[i][t] = w * dl / n
            if args.beta:
                d = float(ref[i, t] - logp[i, t])
                loss += args.beta * (math.exp(d) - d - 1) / n
                grad[i][t] += args.beta * (1 - math.exp(d)) / n
    return loss, torch.tensor(grad, dtype=torch.float64), sum(rhos) / len(rhos)


def random_batch(seed=0, B=8, T=12, spread=0.04):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread
    old[0, 2] = logp[0, 2].detach() - 30  # d_t is clamped to 20 and log rho_t to 10 from here on
    old[4, :2] = logp[4, :2].detach() + torch.tensor([-25.0, 20.0], dtype=torch.float64)  # d = (20, -20): c_2 = 0
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([12, 1, 7, 10, 2, 12, 5, 3])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T) unequal lengths, right-padded
    A = torch.tensor([-1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.7, -0.3], dtype=torch.float64)[:B]
    tis = torch.rand(B, T, dtype=torch.float64) * 2 * mask
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("clip_power", [0.5, 0.0])
def test_loss_and_gradient_match_the_loops(beta, with_tis, clip_power):
    logp, old, ref, A, mask, tis = random_batch()
    args = replace(ARGS, beta=beta, clip_power=clip_power)
    tis = tis if with_tis else None
    loss, metrics = ctpo.compute_loss(logp=logp, old_logp=old, ref_logp=ref if beta else None, advantages=A,
                                      mask=mask, args=args, tis_weights=tis)
    expected_loss, expected_grad, expected_ratio_mean = reference(logp.detach(), old, ref, A, mask, args, tis)
    # rel 1e-7: the bounds are computed from the float32 mask
    assert torch.isfinite(loss) and loss.item() == pytest.approx(expected_loss, rel=1e-7)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert metrics["policy/ratio_mean"].item() == pytest.approx(expected_ratio_mean, rel=1e-10)
    # the batch exercises every branch: unclipped, clipped, dual-clipped tokens
    assert 0 < metrics["policy/clip_frac"].item() < 1 and 0 < metrics["policy/dual_clip_frac"].item() < 1
    assert metrics["loss/policy"].item() == loss.item() and not metrics["loss/policy"].requires_grad
    assert ("policy/kl" in metrics) == (beta > 0)


def test_extreme_log_ratios_stay_finite_in_float32():
    old = torch.full((2, 8), -1.0)
    logp = (old + 25.0).requires_grad_()  # c_t reaches 200: exp would overflow float32 without the caps
    loss, metrics = ctpo.compute_loss(logp, old, None, torch.tensor([1.0, -1.0]), torch.ones(2, 8), ARGS)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().max() == 0
    assert metrics["policy/ratio_mean"].item() == pytest.approx(math.exp(10), rel=1e-5)


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])  # lengths 2, 3 and 1: 6 tokens
    return logp, mask, torch.tensor([1.0, -2.0, 0.5])


def test_on_policy_ratio_is_one_and_the_gradient_is_the_token_mean_policy_gradient():
    logp, mask, A = on_policy_batch()
    loss, metrics = ctpo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert metrics["policy/ratio_mean"].item() == 1.0
    assert metrics["policy/clip_frac"].item() == 0.0 and metrics["policy/dual_clip_frac"].item() == 0.0
    assert metrics["policy/cum_logratio_std"].item() == 0.0
    assert loss.item() == pytest.approx(-(1.0 * 2 - 2.0 * 3 + 0.5 * 1) / 6)  # rho_t = 1: -sum_t A_i / sum(mask)
    (grad,) = torch.autograd.grad(loss, logp)
    # d loss / d logp[i, t] = -A_i / sum(mask) on valid tokens
    expected = torch.tensor([[-1.0, -1.0, 0.0], [2.0, 2.0, 2.0], [-0.5, 0.0, 0.0]]) / 6
    torch.testing.assert_close(grad, expected)


def one_row_of_16(first_delta: float, a: float, clip_power: float):
    """One completion of 16 tokens whose only off-policy token is the first: c_t = first_delta at every t."""
    old = torch.full((1, 16), -1.0, dtype=torch.float64)
    delta = torch.zeros(1, 16, dtype=torch.float64)
    delta[0, 0] = first_delta
    logp = (old + delta).requires_grad_()
    loss, metrics = ctpo.compute_loss(logp, old, None, torch.tensor([a], dtype=torch.float64), torch.ones(1, 16),
                                      replace(ARGS, clip_power=clip_power))
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad[0], metrics


def test_clip_bounds_grow_like_the_position_to_the_clip_power():
    # A > 0, c_t = 0.16: upper bound 0.05 * sqrt(p) is 0.1 at p = 4 (clipped) and 0.2 at p = 16 (not clipped)
    _, grad, metrics = one_row_of_16(0.16, 1.0, clip_power=0.5)
    assert grad[3] == 0 and grad[15] == pytest.approx(-math.exp(0.16) / 16)
    assert (grad != 0).tolist() == [p > 10 for p in range(1, 17)]  # 0.05 sqrt(p) > 0.16 from p = 11 on
    assert metrics["policy/clip_frac_high"].item() == pytest.approx(10 / 16)
    _, grad, _ = one_row_of_16(0.16, 1.0, clip_power=0.0)  # fixed bound 0.05 at every position
    assert grad[3] == 0 and grad[15] == 0
    # A < 0, c_t = -0.06: lower bound 0.025 * sqrt(p) is 0.05 at p = 4 (clipped) and 0.1 at p = 16 (not clipped)
    _, grad, metrics = one_row_of_16(-0.06, -1.0, clip_power=0.5)
    assert grad[3] == 0 and grad[15] == pytest.approx(math.exp(-0.06) / 16)
    assert metrics["policy/clip_frac_low"].item() == pytest.approx(5 / 16)  # 0.025 sqrt(p) < 0.06 up to p = 5
    _, grad, _ = one_row_of_16(-0.06, -1.0, clip_power=0.0)
    assert grad[3] == 0 and grad[15] == 0
    # where every token is clipped the loss shows the bound itself: -A exp(0.05 sqrt(p)), twice as far out at 16 as at 4
    loss, _, _ = one_row_of_16(1.0, 1.0, clip_power=0.5)
    assert loss.item() == pytest.approx(-sum(math.exp(0.05 * math.sqrt(p)) for p in range(1, 17)) / 16)
    loss, _, _ = one_row_of_16(1.0, 1.0, clip_power=0.0)
    assert loss.item() == pytest.approx(-math.exp(0.05))


def test_dual_clip_caps_the_loss_of_negative_advantages():
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[1.0, 0.0]], dtype=torch.float64)).requires_grad_()  # c_t = 1: rho_t = e
    mask = torch.ones(1, 2)
    # A = -1: max(l1, l2) = e, capped at exp(0.05 * sqrt(p)); gradient zero
    loss, metrics = ctpo.compute_loss(logp, old, None, torch.tensor([-1.0], dtype=torch.float64), mask, ARGS)
    assert loss.item() == pytest.approx((math.exp(0.05) + math.exp(0.05 * math.sqrt(2))) / 2)
    assert torch.autograd.grad(loss, logp)[0].abs().max() == 0
    assert metrics["policy/dual_clip_frac"].item() == 1.0
    # a dual bound above e leaves the unclipped term, and its gradient -A rho_t / sum(mask)
    loss, metrics = ctpo.compute_loss(logp, old, None, torch.tensor([-1.0], dtype=torch.float64), mask,
                                      replace(ARGS, clip_c=2.0))
    assert loss.item() == pytest.approx(math.e)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.full((1, 2), math.e / 2, dtype=torch.float64))
    assert metrics["policy/dual_clip_frac"].item() == 0.0
    # A > 0 is never dual-clipped: the upper clip holds it at -A exp(0.05 sqrt(p))
    loss, metrics = ctpo.compute_loss(logp, old, None, torch.tensor([1.0], dtype=torch.float64), mask, ARGS)
    assert loss.item() == pytest.approx(-(math.exp(0.05) + math.exp(0.05 * math.sqrt(2))) / 2)
    assert metrics["policy/dual_clip_frac"].item() == 0.0


def test_position_bucket_metrics_by_hand():
    # row 0: 20 tokens, d_1 = 0.3 then d_17 = 0.5 (c_t = 0.3 for p <= 16, 0.8 after); row 1: 2 tokens at c_t = -0.2
    old = torch.full((2, 20), -1.0)
    delta = torch.zeros(2, 20)
    delta[0, 0], delta[0, 16], delta[1, 0] = 0.3, 0.5, -0.2
    mask = torch.zeros(2, 20)
    mask[0], mask[1, :2] = 1, 1
    _, metrics = ctpo.compute_loss(old + delta, old, None, torch.tensor([1.0, -1.0]), mask, ARGS)
    assert {k for k in metrics if k.startswith("ctpo/")} == {
        "ctpo/cum_logratio_std/pos_1-16", "ctpo/clip_frac/pos_1-16", "ctpo/fixed_clip_frac/pos_1-16",
        "ctpo/cum_logratio_std/pos_17-64", "ctpo/clip_frac/pos_17-64", "ctpo/fixed_clip_frac/pos_17-64"}
    c_early = [0.3] * 16 + [-0.2] * 2  # positions 1-16 of both rows
    c_late = [0.8] * 4

    def std(xs):
        mean = sum(xs) / len(xs)
        return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))

    assert metrics["ctpo/cum_logratio_std/pos_1-16"].item() == pytest.approx(std(c_early), rel=1e-5)
    assert metrics["ctpo/cum_logratio_std/pos_17-64"].item() == pytest.approx(0.0, abs=1e-6)
    assert metrics["policy/cum_logratio_std"].item() == pytest.approx(std(c_early + c_late), rel=1e-5)
    # A = 1 on row 0: clipped where 0.05 sqrt(p) < c_t (p < 36 at 0.3, every p <= 20 at 0.8);
    # A = -1 on row 1: clipped where -0.025 sqrt(p) > -0.2, both tokens
    assert metrics["ctpo/clip_frac/pos_1-16"].item() == pytest.approx(1.0)
    assert metrics["ctpo/clip_frac/pos_17-64"].item() == pytest.approx(1.0)
    # with a larger upper bound only row 1 and the late tokens of row 0 stay clipped
    _, metrics = ctpo.compute_loss(old + delta, old, None, torch.tensor([1.0, -1.0]), mask,
                                   replace(ARGS, clip_high=0.11))
    # 0.11 sqrt(p) < 0.3 up to p = 7: 7 early tokens of row 0 clipped, plus row 1's 2; 0.11 sqrt(20) < 0.8
    assert metrics["ctpo/clip_frac/pos_1-16"].item() == pytest.approx(9 / 18)
    assert metrics["ctpo/clip_frac/pos_17-64"].item() == pytest.approx(1.0)
    assert metrics["policy/clip_frac"].item() == pytest.approx(13 / 22)


def test_figure_1_fixed_clip_rate_is_the_window_half_to_five_on_the_same_ratios():
    """As the authors' plot script: a token counts as clipped by the fixed window when A > 0 and rho_t > 5, or
    A < 0 and rho_t < 0.5, whatever clip the run trained with."""
    assert ctpo.FIG1_FIXED_WINDOW == (0.5, 5.0)
    old = torch.full((3, 20), -1.0)
    delta = torch.zeros(3, 20)
    delta[0, 0], delta[0, 16] = 1.0, 0.7  # row 0, A = 1: c_t = 1.0 (< log 5 = 1.609) up to p = 16, then 1.7
    delta[1, 0] = -0.8  # row 1, A = -1: c_t = -0.8 < log 0.5 = -0.693 on its 2 tokens
    delta[2, 0] = 1.8  # row 2, A = -1: rho_t > 5, but a large ratio is not clipped for A < 0
    mask = torch.zeros(3, 20)
    mask[0], mask[1, :2], mask[2, :2] = 1, 1, 1
    A = torch.tensor([1.0, -1.0, -1.0])
    for clip_power in (0.5, 0.0):  # the same on an adaptive and on a fixed-bounds run
        _, metrics = ctpo.compute_loss(old + delta, old, None, A, mask, replace(ARGS, clip_power=clip_power))
        assert metrics["ctpo/fixed_clip_frac/pos_1-16"].item() == pytest.approx(2 / 20)  # row 1's 2 of 16 + 2 + 2
        assert metrics["ctpo/fixed_clip_frac/pos_17-64"].item() == pytest.approx(1.0)  # row 0's 4 late tokens
    # the adaptive rate on the same tokens: row 0 above 0.05 sqrt(p) everywhere, row 1 below -0.025 sqrt(p)
    _, metrics = ctpo.compute_loss(old + delta, old, None, A, mask, ARGS)
    assert metrics["ctpo/clip_frac/pos_1-16"].item() == pytest.approx(18 / 20)


def test_micro_batches_sum_to_the_full_batch_loss_and_gradient():
    logp, old, ref, A, mask, tis = random_batch(seed=1)
    args = replace(ARGS, num_generations=4, beta=0.04)
    loss, _ = ctpo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    stats = ctpo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"]
    assert stats.num_tokens.dim() == 0 and stats.per_row_values() == {}
    assert stats.num_tokens.item() == mask.sum().item()
    micro = sum(ctpo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, tis_weights=tis[s], stats=stats)[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


@pytest.mark.slow
@pytest.mark.precondition
def test_micro_batch_size_does_not_change_the_gradient(in_toy_workdir):
    grads = {mb: sgd_gradient(in_toy_workdir, f"ctpo_micro{mb}", SMALL + ["--micro_batch_size", str(mb)],
                              script="ctpo.py") for mb in (1, 16)}
    assert_same_gradient(grads[1], grads[16])


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    # run name not "learns": test_train.py's run would share the session's folder (metrics.jsonl appends)
    run = run_script(ctpo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                            "--run_name", "ctpo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("ctpo"), evals


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = ctpo.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)


def test_tool_tokens_are_neither_positions_nor_part_of_the_cumulative_ratio():
    """One row, A = 1, clip_power 1: model tokens at columns 0 and 3, a tool's output (mask 0) at columns 1-2 with
    log-ratios of -0.5 each. Over the model's tokens only: c = (0.01, 0.01 + 0.14) and p = (1, 2), so token 3's
    log-ratio 0.15 is above its bound clip_high * p = 0.1 and is clipped (value e^0.1, no gradient), token 0's 0.01 is
    inside 0.05. Loss = -(e^0.01 + e^0.1) / 2 over the 2 valid tokens; d loss / d logp_0 = -e^0.01 / 2. Counting the
    tool's columns, p_3 = 4 would leave 0.15 unclipped (e^0.15), and c_3 = -0.85 would give e^-0.85."""
    args = replace(ARGS, clip_power=1.0, clip_low=0.025, clip_high=0.05, clip_c=0.05, beta=0.0)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor([[0.01, -0.5, -0.5, 0.14]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 0, 0, 1]])
    loss, metrics = ctpo.compute_loss(logp, old, None, torch.tensor([1.0], dtype=torch.float64), mask, args)
    # rel 1e-7: the bounds are float32 (mask.float()), so e^0.1 is off by a factor e^1.5e-9.
    assert loss.item() == pytest.approx(-(math.exp(0.01) + math.exp(0.1)) / 2, rel=1e-7)
    assert metrics["policy/clip_frac_high"].item() == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-math.exp(0.01) / 2, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
