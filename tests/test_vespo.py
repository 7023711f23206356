"""vespo.compute_advantages / compute_loss by hand, against loops from the paper's kernel, against TRL 1.16's own
GRPOTrainer._compute_loss (loss_type="vespo", get_gamma_weights), then an end-to-end run."""

import dataclasses
import math
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from peers import trl_grpo_loss

import grpo
import landscape
import vespo

ARGS = vespo.Args(num_generations=2)
LOG_FLOOR = math.log(1e-8)


def test_defaults_and_there_are_no_other_switches():
    args = vespo.Args()
    # the authors' recipe (recipe/vespo/run/sync/vespo_N_8.sh) and TRL 1.16's GRPOConfig vespo_* defaults; no KL
    assert (args.k_pos, args.lambda_pos, args.k_neg, args.lambda_neg, args.beta) == (2.0, 3.0, 3.0, 2.0, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(vespo.Args)} - shared == {"beta", "k_pos", "lambda_pos", "k_neg",
                                                                         "lambda_neg"}


def test_zscore_advantages_are_grpos():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    A = vespo.compute_advantages(rewards, replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6))
    torch.testing.assert_close(A, grpo.compute_advantages(rewards, grpo.Args(num_generations=4)))


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])  # lengths 2, 3 and 1: 6 tokens
    return logp, mask, torch.tensor([1.0, -2.0, 0.5])


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: w = 1 and phi(1) = e^lambda 1^k e^-lambda = 1 for both signs, so the loss is
    -sum A_i logp_t / n and its gradient the token-mean policy gradient, -A_i / n on every valid token (GRPO's token
    mean at ratio 1)."""
    logp, mask, A = on_policy_batch()
    loss, metrics = vespo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert metrics["vespo/phi_mean"].item() == 1.0 and metrics["vespo/log_w_mean"].item() == 0.0
    assert metrics["vespo/phi_min"].item() == 1.0 and metrics["vespo/phi_max"].item() == 1.0
    assert loss.item() == pytest.approx(-(1.0 * (-3.0) - 2.0 * (-1.5) + 0.5 * (-0.1)) / 6)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [2.0, 2.0, 2.0], [-0.5, 0.0, 0.0]]) / 6
    torch.testing.assert_close(grad, expected)
    token_mean = landscape.compute_loss(logp, logp.detach(), None, A, mask, landscape.Args(num_generations=1, beta=0.0,
                                                                                   loss_agg="token-mean"))[0]
    torch.testing.assert_close(torch.autograd.grad(token_mean, logp)[0], expected)


def test_the_gamma_kernel_by_hand_on_the_sequence_ratio_not_its_mean():
    """Row 0 (A = 1): token log-ratios ln 2 and 0, so w = 2 (a product: GSPO's geometric mean would be sqrt 2) and
    phi = e^3 2^2 e^-6 = 4 e^-3. Row 1 (A = -1): w = 1/2, phi = e^2 (1/2)^3 e^-1 = e / 8. Row 2 (A = 0.5): w = 2/3,
    the mode of the positive kernel, phi = e^3 (2/3)^2 e^-2 = 4e/9 > 1. The gradient is -phi_i A_i / n, whatever
    the token's own ratio; phi carries none."""
    old = torch.zeros(3, 2, dtype=torch.float64)
    logp = torch.tensor([[math.log(2), 0.0], [math.log(0.5), 0.0], [math.log(2 / 3), 0.0]],
                        dtype=torch.float64).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    A = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    loss, metrics = vespo.compute_loss(logp, old, None, A, mask, ARGS)
    phi = [4 * math.exp(-3), math.e / 8, 4 * math.e / 9]
    n = 5
    expected_loss = -(phi[0] * 1.0 * math.log(2) + phi[1] * -1.0 * math.log(0.5) + phi[2] * 0.5 * math.log(2 / 3)) / n
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -torch.tensor([[phi[0], phi[0]], [-phi[1], 0.0], [0.5 * phi[2], 0.5 * phi[2]]], dtype=torch.float64) / n
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    assert metrics["vespo/phi_max"].item() == pytest.approx(4 * math.e / 9, rel=1e-12)
    assert metrics["vespo/phi_min"].item() == pytest.approx(4 * math.exp(-3), rel=1e-12)


def test_tis_weights_join_the_sequence_ratio_not_the_loss():
    """Token TIS weights (2, 1/2, 0 at padding) multiply w: log w = log r + log 2 + log 1/2 = log r; a weight 4 on one
    token makes w four times larger. Sequence mode: the row's weight (on each of its tokens) enters once."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[math.log(0.5), 0.0, 0.0]], dtype=torch.float64).requires_grad_()
    mask = torch.tensor([[1, 1, 0]])
    A = torch.tensor([1.0], dtype=torch.float64)
    phi = lambda w: math.exp(3 + 2 * math.log(w) - 3 * w)  # noqa: E731  the positive kernel
    cases = [([2.0, 0.5, 0.0], "token", 0.5), ([4.0, 1.0, 0.0], "token", 2.0), ([4.0, 4.0, 0.0], "sequence", 2.0)]
    for weights, mode, w in cases:
        tis = torch.tensor([weights], dtype=torch.float64)
        loss, _ = vespo.compute_loss(logp, old, None, A, mask, replace(ARGS, tis_mode=mode), tis_weights=tis)
        assert loss.item() == pytest.approx(-phi(w) * math.log(0.5) / 2, rel=1e-12), (weights, mode)


def test_extreme_ratios_are_clamped_and_phi_stays_finite():
    """A token log-ratio of 30 counts 20; a sequence log-ratio above 20 is 20 (phi = e^(3 + 40 - 3 e^20) = 0); one
    below log 1e-8 is log 1e-8 (phi = e^3 1e-16 e^(-3e-8)); a masked TIS weight (0) floors its log at log 1e-8."""
    old = torch.zeros(4, 2, dtype=torch.float64)
    logp = torch.tensor([[30.0, -15.0], [15.0, 10.0], [-15.0, -10.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(4, 2)
    A = torch.ones(4, dtype=torch.float64)
    tis = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    phi, log_w = vespo.gamma_weights(logp - old, A, mask, ARGS, tis)
    torch.testing.assert_close(log_w, torch.tensor([5.0, 20.0, LOG_FLOOR, LOG_FLOOR], dtype=torch.float64))
    kernel = lambda lw: math.exp(3 + 2 * lw - 3 * math.exp(lw))  # noqa: E731
    torch.testing.assert_close(phi, torch.tensor([kernel(5.0), 0.0, kernel(LOG_FLOOR), kernel(LOG_FLOOR)],
                                                 dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.isfinite(phi).all() and phi[3] < 3e-15


# Against loops straight from the kernel's definition, and micro-batches


def reference(logp, old, ref, A, mask, args, tis=None):
    """Loss and d loss / d logp with Python floats: log w_i = clamp(sum_t clamp(delta_t, -20, 20) + sum_t clamp(log
    rho_t, log 1e-8, 20), log 1e-8, 20) over valid tokens, phi_i = exp(lambda + k log w_i - lambda w_i) by the sign of
    A_i, L = -(1/n) sum_{i,t} [phi_i A_i logp_t - beta kl_t]."""
    B, T = logp.shape
    n = sum(int(mask[i, t]) for i in range(B) for t in range(T))
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        log_w = sum(min(max(float(logp[i, t] - old[i, t]), -20.0), 20.0) for t in valid)
        if tis is not None:
            log_w += sum(min(max(math.log(float(tis[i, t])) if tis[i, t] > 0 else -math.inf, LOG_FLOOR), 20.0)
                         for t in valid)
        log_w = min(max(log_w, LOG_FLOOR), 20.0)
        a = float(A[i])
        k, lam = (args.k_pos, args.lambda_pos) if a >= 0 else (args.k_neg, args.lambda_neg)
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        for t in valid:
            d = float(ref[i, t] - logp[i, t])
            loss -= (phi * a * float(logp[i, t]) - args.beta * (math.exp(d) - d - 1)) / n
            grad[i][t] = (-phi * a + args.beta * (1 - math.exp(d))) / n
    return loss, torch.tensor(grad, dtype=torch.float64)


def random_batch(seed=0, B=8, T=6, spread=0.5):
    """Right-padded rows of unequal lengths, row 6 removed (no valid token); row 0 with a token log-ratio past 20 and
    row 4 with a sequence log-ratio under log 1e-8 (extreme ratios); TIS weights in (0.5, 1.5), one of them 0 (MIS)."""
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread
    old[0, 1] = logp[0, 1].detach() - 25.0  # r = e^25: clamped to e^20 per token
    old[4, :2] = logp[4, :2].detach() + 12.0  # log w = -24 + ...: floored at log 1e-8
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([6, 1, 3, 4, 2, 5, 0, 1])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    A = vespo.compute_advantages(torch.rand(B, dtype=torch.float64), replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    tis[3, 2] = 0.0  # a token masked by MIS
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("kernel", [(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 4.0, 6.0)])
def test_matches_the_kernels_definition_and_micro_batches_sum_to_the_full_batch(beta, with_tis, kernel):
    k_pos, lambda_pos, k_neg, lambda_neg = kernel
    args = replace(ARGS, num_generations=4, beta=beta, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                   lambda_neg=lambda_neg)
    logp, old, ref, A, mask, tis = random_batch()
    tis = tis if with_tis else None
    loss, metrics = vespo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected_loss, expected_grad = reference(logp.detach(), old, ref, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    torch.testing.assert_close(full_grad, expected_grad, rtol=1e-10, atol=1e-15)
    assert metrics["vespo/phi_min"] < 1e-5  # row 4's floored w
    stats = vespo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"] and stats.per_row_values() == {}
    assert stats.num_tokens.item() == 22
    micro = sum(vespo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                   tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


# Against TRL 1.16's own code


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("kernel", [(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 4.0, 6.0)])
def test_equals_trls_vespo_loss_and_gradient(beta, with_tis, kernel):
    """TRL's loss is a token sum over num_items_in_batch (the valid tokens), so a removed row counts nowhere and stays
    in the batch. TRL's vLLM ratio is 1 at padding (exp of a masked 0) and its logs are summed over every column; the
    project's weights are 0 there and their logs summed over valid tokens: the same w. The kernel's parameters are
    exact in float32, where TRL's torch.where on Python floats puts them."""
    logp, old, ref, A, mask, tis = random_batch(seed=2)
    k_pos, lambda_pos, k_neg, lambda_neg = kernel
    args = replace(vespo.Args(), num_generations=4, beta=beta, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                   lambda_neg=lambda_neg)
    ours = vespo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis if with_tis else None)[0]
    trl_tis = tis + (1 - mask) if with_tis else None  # vLLM's ratio at padding: exp(0) = 1
    theirs = trl_grpo_loss("vespo", logp, old, ref, A, mask.double(), beta, trl_tis, vespo_k_pos=k_pos,
                           vespo_lambda_pos=lambda_pos, vespo_k_neg=k_neg, vespo_lambda_neg=lambda_neg)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-12, atol=1e-15)
    assert (A > 0).any() and (A < 0).any() and mask[6].sum() == 0  # both kernels and a removed row


@pytest.mark.peer
def test_trls_gamma_weights_are_ours():
    """TRL's static get_gamma_weights on the extreme batch, row by row (rows with a valid token)."""
    from trl import GRPOTrainer

    logp, old, _, A, mask, tis = random_batch(seed=4)
    ours, _ = vespo.gamma_weights(logp - old, A, mask.double(), ARGS, tis)
    theirs = GRPOTrainer.get_gamma_weights(A[:, None], (logp - old).detach(), mask.double(), tis + (1 - mask))
    kept = mask.sum(-1) > 0
    torch.testing.assert_close(ours[kept], theirs[kept, 0], rtol=1e-12, atol=1e-300)
    assert ours.min() < 1e-10 and ours.max() > 1  # the floor and the kernel's bump above 1 are both in it


# End to end


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(vespo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                             "--run_name", "vespo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("vespo"), evals
