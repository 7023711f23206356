"""ipo.compute_advantages / compute_loss by hand, against prime-rl's own `ipo_loss_fn` (a verbatim copy below:
prime-rl cannot be installed here) driven as prime-rl's `compute_loss` drives it, on float64 batches with padding, a
removed row, zero-advantage rows and extreme ratios, then an end-to-end run."""

import dataclasses
import math
import types
from dataclasses import dataclass, field, replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from torch import Tensor

import grpo
import ipo
import landscape

ARGS = ipo.Args(num_generations=2)


# prime-rl's code, verbatim: PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/loss.py at commit
# 559b44772e471d1538537b8805cc77f3824a5e64 (main, 2026-08-21): `LossInputs` and `LossOutputs` (their jaxtyping
# annotations `Float[Tensor, " seq"]` / `Bool[...]` written `Tensor`), `_safe_mean`,
# `compute_importance_ratio_and_mismatch_kl` and `ipo_loss_fn`. PR #3418 renamed `ipo_threshold` to `eps` and PR
# #3526 moved the same lines into `IPOLoss.loss`; PR #3586 set the defaults eps 0.3, kl_tau 0.


@dataclass
class LossInputs:
    """Inputs for computing loss on a single sample.

    ``loss_mask`` already selects the tokens that belong to the receiving
    component — the component loss functions never re-derive eligibility.
    ``loss_weights`` is the component's per-token weight stream (None means
    1.0 everywhere).
    """

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    loss_weights: Tensor | None = field(default=None)


@dataclass
class LossOutputs:
    """Outputs from computing loss on a single sample."""

    loss: Tensor
    metrics: dict[str, Tensor]


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values over a boolean mask; returns 0 when mask is empty."""
    denom = torch.clamp_min(mask.sum(), 1)
    return values[mask].sum() / denom


def compute_importance_ratio_and_mismatch_kl(
    trainer_logprobs: Tensor, inference_logprobs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


def ipo_loss_fn(inputs: LossInputs, loss_config) -> LossOutputs:
    """IPO loss type: a symmetric trust region (mask tokens whose probability
    moved more than ``ipo_threshold`` in absolute terms), policy gradient via
    the importance ratio, and a squared-log-ratio KL regularizer."""
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask

    log_importance_ratio, importance_ratio, mismatch_kl = compute_importance_ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )

    abs_probs_diff = torch.abs(torch.exp(trainer_logprobs) - torch.exp(inference_logprobs))

    is_masked = abs_probs_diff > loss_config.ipo_threshold
    keep_mask = loss_mask & ~is_masked

    advantages = loss_config.adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + loss_config.kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()

    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),  # all trainable, masked tokens
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),  # all trainable, unmasked tokens
        "is_masked": _safe_mean(is_masked, loss_mask),
    }

    return LossOutputs(loss=loss, metrics=metrics)


# (end of the verbatim copy)


def prime_rl_loss(logp, old, A, mask, eps=0.3, kl_tau=0.0):
    """prime-rl's whole-step loss around `ipo_loss_fn`, as its pipeline builds it (not verbatim): the orchestrator
    gives each token its row's advantage and zeroes the rl weight of zero-advantage tokens
    (orchestrator/train_sink.py `_prune_zero_advantages`); the trainer's `compute_loss` calls the loss per sample
    on `loss_mask & (rl_weights != 0)`, skips a sample with no such token, and divides the sum by the global count
    of those tokens (`rl_scale`, trainer/rl/train.py)."""
    config = types.SimpleNamespace(ipo_threshold=eps, adv_tau=1.0, kl_tau=kl_tau)
    total, count = logp[0].sum() * 0.0, 0
    for i in range(logp.shape[0]):
        advantages = A[i].expand(logp.shape[1])
        rl_mask = mask[i].bool() & (advantages != 0)
        count += int(rl_mask.sum())
        if bool(rl_mask.any()):
            total = total + ipo_loss_fn(LossInputs(logp[i], old[i], None, advantages, rl_mask), config).loss
    return total / max(count, 1)


def test_defaults_and_there_are_no_other_switches():
    args = ipo.Args()
    # prime-rl PR #3586: eps 0.3, the (log r)^2 term off; prime-rl has no reference KL
    assert (args.eps, args.kl_tau, args.beta) == (0.3, 0.0, 0.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(ipo.Args)} - shared == {"beta", "eps", "kl_tau"}


def test_advantages_are_the_reward_less_the_group_mean_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    A = ipo.compute_advantages(rewards, replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))  # no std


def test_by_hand_a_token_that_moved_more_than_eps_either_way_loses_its_policy_term():
    """Four tokens with old probabilities 0.5, 0.5, 0.5, 1e-6: up 0.2 (kept), up 0.4 (masked), down 0.35 (masked, a
    positive advantage does not save it), x1000 on a rare token (kept: it moved 0.001; PPO's clip would zero it).
    The kept tokens' gradient is the unclipped ratio times A."""
    old = torch.tensor([[0.5, 0.5, 0.5, 1e-6]], dtype=torch.float64).log()
    logp = torch.tensor([[0.7, 0.9, 0.15, 1e-3]], dtype=torch.float64).log().requires_grad_()
    mask = torch.ones(1, 4)
    for a in (1.0, -1.0):
        loss, metrics = ipo.compute_loss(logp, old, None, torch.tensor([a], dtype=torch.float64), mask, ARGS)
        assert loss.item() == pytest.approx(-a * (1.4 + 1000.0) / 4, rel=1e-12)
        (grad,) = torch.autograd.grad(loss, logp)  # d(r A)/d logp = r A
        torch.testing.assert_close(grad, -a * torch.tensor([[1.4, 0.0, 0.0, 1000.0]], dtype=torch.float64) / 4)
        assert metrics["policy/clip_frac"].item() == 0.5


def test_the_squared_log_ratio_covers_masked_tokens_and_tis_scales_only_the_policy_term():
    old = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64).log()
    logp = torch.tensor([[0.6, 0.9], [0.4, 0.5]], dtype=torch.float64).log().requires_grad_()
    mask, A = torch.tensor([[1, 1], [1, 0]]), torch.tensor([2.0, -1.0], dtype=torch.float64)
    tis = torch.tensor([[0.5, 3.0], [1.5, 0.0]], dtype=torch.float64)
    args = replace(ARGS, kl_tau=0.1)
    loss, _ = ipo.compute_loss(logp, old, None, A, mask, args, tis_weights=tis)
    l1, l2, l3 = math.log(1.2), math.log(1.8), math.log(0.8)  # the second token is masked (moved 0.4)
    expected = -(1.2 * 2.0 * 0.5 + 0.8 * -1.0 * 1.5 - 0.1 * (l1**2 + l2**2 + l3**2)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    expected_grad = -torch.tensor([[1.2 * 2.0 * 0.5 - 0.2 * l1, -0.2 * l2], [0.8 * -1.0 * 1.5 - 0.2 * l3, 0.0]]) / 3
    torch.testing.assert_close(grad, expected_grad.double())


def test_rows_of_zero_advantage_leave_the_loss_and_the_token_count():
    """prime-rl drops zero-advantage tokens before the trainer: a row with A = 0 leaves the denominator and, with
    --kl_tau, its (log r)^2 term too. The loss equals that of the batch without it."""
    logp, old, A, mask, _ = random_batch(seed=1)
    args = replace(ARGS, kl_tau=0.01)
    A = A.clone()
    A[2] = 0.0
    keep = [i for i in range(len(A)) if i != 2]
    assert ipo.batch_stats(A, mask, args).num_tokens.item() == mask[A != 0].sum().item() == 22  # rows 0, 1, 3, 8, 9, 11
    whole = ipo.compute_loss(logp, old, None, A, mask, args)[0]
    without = ipo.compute_loss(logp[keep], old[keep], None, A[keep], mask[keep], args)[0]
    assert whole.item() == pytest.approx(without.item(), rel=1e-12)
    assert torch.autograd.grad(whole, logp)[0][2].abs().sum().item() == 0.0


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: every ratio 1, nothing moved, the loss -sum A_i / n over the rows with A_i != 0 and the
    gradient -A_i / n on each of their tokens: GRPO's token-mean gradient on those rows."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([1.0, -2.0, 0.0])  # the third row leaves: n = 5
    loss, metrics = ipo.compute_loss(logp, logp.detach(), None, A, mask, ARGS)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    assert loss.item() == pytest.approx(-(2 * 1.0 + 3 * -2.0) / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]) / 5
    torch.testing.assert_close(grad, expected)
    token_mean_args = landscape.Args(num_generations=1, beta=0.0, loss_agg="token-mean")
    token_mean = landscape.compute_loss(logp[:2], logp[:2].detach(), None, A[:2], mask[:2], token_mean_args)[0]
    torch.testing.assert_close(torch.autograd.grad(token_mean, logp)[0], expected)


def random_batch(seed=0, B=12, T=6):
    """float64; unequal lengths, right padding (garbage log-probs there), row 10 removed (no valid token, A != 0), a
    group of equal rewards (rows 4-7: A = 0), probabilities moved both ways past eps, extreme ratios on rare tokens."""
    torch.manual_seed(seed)
    old = torch.log(torch.rand(B, T, dtype=torch.float64) * 0.9 + 0.05)  # (B, T)
    logp = old + torch.randn(B, T, dtype=torch.float64) * 0.8  # (B, T)  some past eps, both ways
    logp = logp.clamp(max=0.0)
    old[0, 1], logp[0, 1] = -60.0, -20.0  # ratio e^40 on a token of probability 2e-9: kept
    old[1, 0], logp[1, 0] = -3.0, -70.0  # ratio e^-67: moved 0.05, kept
    old[3, 2], logp[3, 2] = -80.0, -0.1  # ratio e^80, moved 0.9: masked
    lengths = torch.tensor([6, 1, 3, 4, 2, 5, 0, 6, 3, 6, 0, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    logp = torch.where(mask > 0, logp, torch.full_like(logp, -5.0)).requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    A = ipo.compute_advantages(rewards, replace(ARGS, num_generations=4))
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, A, mask, tis


@pytest.mark.peer
@pytest.mark.parametrize("eps, kl_tau", [(0.3, 0.0), (0.1, 1e-3), (0.5, 0.05)])
def test_equals_prime_rls_ipo_loss_and_gradient(eps, kl_tau):
    logp, old, A, mask, _ = random_batch(seed=2)
    args = replace(ARGS, num_generations=4, eps=eps, kl_tau=kl_tau)
    ours, metrics = ipo.compute_loss(logp, old, None, A, mask, args)
    theirs = prime_rl_loss(logp, old, A, mask, eps, kl_tau)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-12, atol=0)
    assert 0 < metrics["policy/clip_frac"] < 1  # some tokens masked, not all
    kept = (mask > 0) & (A != 0)[:, None]
    assert torch.exp(logp - old)[kept].max() > 1e17 and torch.exp(logp - old)[kept].min() < 1e-28  # extremes in


@pytest.mark.parametrize("kl_tau, beta", [(0.0, 0.0), (0.01, 0.04)])
@pytest.mark.parametrize("with_tis", [False, True])
def test_micro_batches_sum_to_the_full_batch_loss_and_gradient(kl_tau, beta, with_tis):
    logp, old, A, mask, tis = random_batch(seed=3)
    ref = logp.detach() + 0.2
    tis = tis if with_tis else None
    args = replace(ARGS, num_generations=4, kl_tau=kl_tau, beta=beta)
    loss, _ = ipo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    stats = ipo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"] and stats.per_row_values() == {}
    slices = [slice(0, 1), slice(1, 4), slice(4, 9), slice(9, 12)]
    micro = sum(ipo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                 tis_weights=None if tis is None else tis[s])[0] for s in slices)
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    """gradcheck of the loss as a function of logp (old_logp fixed), the extreme ratios brought back to 1 so that
    finite differences stay accurate, and no token within 1e-4 of eps (none crosses it)."""
    logp, old, A, mask, tis = random_batch(seed=4)
    args = replace(ARGS, num_generations=4, kl_tau=0.01)
    old = torch.where((logp.detach() - old).abs() < 5, old, logp.detach())  # (B, T)
    moved = (logp.detach().exp() - old.exp()).abs()  # (B, T)
    assert ((moved - args.eps).abs() > 1e-4).all() and ((moved > args.eps) & (mask > 0)).any()
    assert torch.autograd.gradcheck(lambda x: ipo.compute_loss(x, old, None, A, mask, args, tis_weights=tis)[0],
                                    (logp.detach().requires_grad_(),))


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset: held-out greedy accuracy must rise."""
    run = run_script(ipo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                           "--run_name", "ipo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("ipo"), evals
