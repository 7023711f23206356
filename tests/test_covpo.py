"""covpo.compute_advantages / batch_stats / compute_loss (Clip-Cov and KL-Cov) by hand, against loops from the
definitions (float64), and against verl 0.5.0's own `compute_policy_loss_clip_cov` / `compute_policy_loss_kl_cov` and
`compute_grpo_outcome_advantage` (`verl/trainer/ppo/core_algos.py`, loaded from the verl wheel by the `peer` fixture
of tests/test_reinforcepp.py), on identical tensors, then end-to-end runs.

verl calls its loss on one micro-batch of one process at a time, so its covariance selection is that micro-batch's;
covpo.py's is the optimizer batch's (batch_stats). The two agree when verl's micro-batch is the whole batch, the
setting of the `peer` tests: there the same torch seed gives Clip-Cov the same random draw (torch.randperm on the
global generator in both)."""

import dataclasses
import math
import os
import types
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_reinforcepp import verl_core_algos  # noqa: F401  the `peer` fixture: verl 0.5.0's core_algos.py
from test_snib import STALE, STALE_LR, assert_stale_updates_agree
from test_train import SMALL, assert_same_gradient, sgd_gradient

import covpo
import grpo
import landscape

ARGS = covpo.Args(num_generations=4)
CLIP, KL = replace(ARGS, cov_method="clip"), replace(ARGS, cov_method="kl")


def test_defaults_and_there_are_no_other_switches():
    args = covpo.Args()
    # verl 0.5.0 actor.yaml: clip_ratio 0.2, clip_cov_ratio 2e-4, clip_cov_lb 1, clip_cov_ub 5, kl_cov_ratio 2e-4;
    # ppo_kl_coef 1 (the authors' scripts, verl's function default; its actor.yaml says 0.1); no KL loss
    assert (args.cov_method, args.beta, args.epsilon, args.epsilon_high) == ("clip", 0.0, 0.2, 0.2)
    assert (args.clip_cov_ratio, args.clip_cov_lb, args.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert (args.kl_cov_ratio, args.ppo_kl_coef) == (2e-4, 1.0)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(covpo.Args)} - shared == {
        "beta", "epsilon", "epsilon_high", "cov_method", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
        "kl_cov_ratio", "ppo_kl_coef"}


def test_zscore_advantages_are_grpos():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3, 0.5, 1, 2, 0])
    torch.testing.assert_close(covpo.compute_advantages(rewards, ARGS),
                               grpo.compute_advantages(rewards, grpo.Args(num_generations=4)))


# By hand: two rows of two tokens, A = (1, -1), logp (-0.5, -2) and (-3, -1): mean A 0, mean logp -1.625, so the
# covariances C_t = (A - 0)(logp + 1.625) are 1.125, -0.375 (row 0) and 1.375, -0.625 (row 1).
HAND_LOGP = [[-0.5, -2.0], [-3.0, -1.0]]
HAND_A = [1.0, -1.0]
HAND_COV = [[1.125, -0.375], [1.375, -0.625]]


def hand_batch(shift=0.0):
    logp = torch.tensor(HAND_LOGP, dtype=torch.float64, requires_grad=True)
    return logp, logp.detach() - shift, torch.tensor(HAND_A, dtype=torch.float64), torch.ones(2, 2)


def test_kl_cov_penalises_the_top_covariance_tokens_by_hand():
    """k = 1/4 of the 4 tokens: the top one, (1, 0) with C = 1.375; k = 1/2: also (0, 0) with 1.125. With
    logp - old_logp = 0.1 on every token (r = e^0.1) the loss is -(1/4) sum [r A - kappa S |0.1|], and the gradient
    of a penalised token -(r A - kappa) / 4 (d|x|/dx = 1 for x > 0); no clip, however far r is."""
    logp, old, A, mask = hand_batch(shift=0.1)
    r = math.exp(0.1)
    for ratio, picked in ((0.25, [[0, 0], [1, 0]]), (0.5, [[1, 0], [1, 0]])):
        args = replace(KL, kl_cov_ratio=ratio)
        stats = covpo.batch_stats(logp.detach(), old, A, mask, args)
        assert stats.selected.long().tolist() == picked
        loss, metrics = covpo.compute_loss(logp, old, None, A, mask, args)
        S = torch.tensor(picked, dtype=torch.float64)
        assert loss.item() == pytest.approx(-(r * (1 + 1 - 1 - 1) - 1.0 * 0.1 * S.sum().item()) / 4, rel=1e-12)
        (grad,) = torch.autograd.grad(loss, logp)
        torch.testing.assert_close(grad, -(r * A[:, None] - 1.0 * S) / 4)
        assert metrics["covpo/selected_frac"].item() == S.mean().item() and metrics["policy/clip_frac"] == 0
    far = covpo.compute_loss(logp, logp.detach() - 2.0, None, A, mask, replace(KL, ppo_kl_coef=0.0))[0]
    assert abs(far.item()) < 1e-12  # r = e^2 on every token, A = +-1 on two each: no clip, the terms cancel
    (grad,) = torch.autograd.grad(far, logp)
    torch.testing.assert_close(grad, -math.exp(2.0) * A[:, None].expand(2, 2) / 4)


def test_clip_cov_drops_an_eligible_token_from_the_loss_by_hand():
    """On-policy (r = 1, nothing clipped), lb 1.2: only (1, 0) (C = 1.375) is in (lb, ub), and max(int(r n), 1) = 1
    token is dropped: its term and gradient leave the loss, the denominator keeps all 4 tokens. ub 1.3: no token is
    eligible and nothing is dropped; lb 1: (0, 0) and (1, 0) are, and the draw takes one of them."""
    logp, old, A, mask = hand_batch()
    loss, metrics = covpo.compute_loss(logp, old, None, A, mask, replace(CLIP, clip_cov_lb=1.2))
    assert loss.item() == pytest.approx(-(1 + 1 - 1) / 4) and metrics["covpo/selected_frac"].item() == 0.25
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0], [0.0, 1.0]], dtype=torch.float64) / 4)
    none = covpo.compute_loss(logp, old, None, A, mask, replace(CLIP, clip_cov_lb=1.2, clip_cov_ub=1.3))[1]
    assert none["covpo/selected_frac"].item() == 0
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        selected = covpo.batch_stats(logp.detach(), old, A, mask, CLIP).selected
        assert selected.sum() == 1
        seen.add(tuple(selected.nonzero()[0].tolist()))
    assert seen == {(0, 0), (1, 0)}


def test_clip_cov_leaves_alone_the_tokens_ppos_clip_already_holds():
    """Token (1, 0) (A < 0) with r = e^-0.5 < 1 - eps: PPO's clip keeps the constant (1 - eps) A, so verl's
    clip_by_origin excludes it from the draw; with lb 1.2 no other token is eligible and nothing is dropped."""
    logp, old, A, mask = hand_batch()
    old = old.clone()
    old[1, 0] += 0.5
    loss, metrics = covpo.compute_loss(logp, old, None, A, mask, replace(CLIP, clip_cov_lb=1.2))
    assert metrics["covpo/selected_frac"].item() == 0 and metrics["policy/clip_frac_low"].item() == 0.25
    assert loss.item() == pytest.approx(-(1 + 1 - 0.8 - 1) / 4)


# On-policy reductions


def on_policy_batch():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, -3.0, 0.0], [-2.0, -0.2, -1.0]],
                        dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    return logp, mask, torch.tensor([1.0, -2.0, 0.5, -0.5], dtype=torch.float64)


def test_on_policy_kl_cov_is_grpos_token_mean():
    """old_logp == logp: every r_t = 1 and every penalty |logp - old_logp| = 0 with gradient 0, whichever tokens the
    covariance picks: KL-Cov's loss and gradient are GRPO's --loss_agg token-mean, -A_i / n on every valid token."""
    logp, mask, A = on_policy_batch()
    theirs = landscape.compute_loss(logp, logp.detach(), None, A, mask, landscape.Args(num_generations=1, beta=0.0,
                                                                             loss_agg="token-mean"))[0]
    (expected,) = torch.autograd.grad(theirs, logp)
    for ratio in (2e-4, 0.5):
        ours, metrics = covpo.compute_loss(logp, logp.detach(), None, A, mask, replace(KL, kl_cov_ratio=ratio))
        assert metrics["covpo/selected_frac"] > 0 and ours.item() == pytest.approx(theirs.item(), rel=1e-12)
        torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], expected)


def test_on_policy_clip_cov_is_grpos_token_mean_less_the_dropped_tokens():
    """old_logp == logp: r_t = 1, nothing clipped; the loss is -(1/n) sum over the tokens not dropped of A_i, n all
    valid tokens: GRPO's token-mean gradient with the dropped tokens' entries zeroed (lb -5: every token eligible)."""
    logp, mask, A = on_policy_batch()
    args = replace(CLIP, clip_cov_ratio=0.3, clip_cov_lb=-5.0)
    torch.manual_seed(0)
    stats = covpo.batch_stats(logp.detach(), logp.detach(), A, mask, args)
    S = stats.selected
    assert S.sum() == int(0.3 * 10) == 3 and not (S & (mask == 0)).any()
    loss, _ = covpo.compute_loss(logp, logp.detach(), None, A, mask, args, stats=stats)
    keep = mask * ~S
    assert loss.item() == pytest.approx(-(A[:, None] * keep).sum().item() / 10, rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], -A[:, None] * keep / 10)


# Against loops straight from the definitions, and micro-batches


def reference_selection(logp, old, A, mask, args, seed):
    """The tokens the covariance picks, token by token: n valid tokens, their mean A and mean logp, C_t; Clip-Cov:
    the tokens with lb < C_t < ub that PPO's clip does not already hold (-A clip(r) > -A r), in row-major order,
    max(int(ratio n), 1) of them drawn by torch.randperm after torch.manual_seed(seed); KL-Cov: the
    max(int(ratio n), 1) largest C_t."""
    B, T = mask.shape
    tokens = [(i, t) for i in range(B) for t in range(T) if mask[i, t]]
    n = len(tokens)
    mean_a = sum(float(A[i]) for i, _ in tokens) / n
    mean_l = sum(float(logp[i, t]) for i, t in tokens) / n
    cov = {(i, t): (float(A[i]) - mean_a) * (float(logp[i, t]) - mean_l) for i, t in tokens}
    if args.cov_method == "kl":
        return set(sorted(tokens, key=lambda k: -cov[k])[: max(int(args.kl_cov_ratio * n), 1)])
    eligible = []
    for i, t in tokens:
        r = math.exp(float(logp[i, t] - old[i, t]))
        held = -float(A[i]) * min(max(r, 1 - args.epsilon), 1 + args.epsilon_high) > -float(A[i]) * r
        if not held and args.clip_cov_lb < cov[i, t] < args.clip_cov_ub:
            eligible.append((i, t))
    torch.manual_seed(seed)
    perm = torch.randperm(len(eligible)).tolist() if eligible else []
    return {eligible[j] for j in perm[: max(int(args.clip_cov_ratio * n), 1)]}


def reference_loss(logp, old, ref, A, mask, args, selected, tis=None):
    """Token by token: Clip-Cov -min(r A, clip(r) A) on the tokens not selected; KL-Cov -(r A - kappa |logp - old|)
    with the penalty on the selected ones; times the TIS weight; the k3 KL; summed and divided by the valid tokens."""
    total, n = 0.0, 0
    B, T = logp.shape
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            if args.cov_method == "clip":
                s = 0.0 if (i, t) in selected else torch.minimum(
                    r * A[i], torch.clamp(r, 1 - args.epsilon, 1 + args.epsilon_high) * A[i])
            else:
                s = r * A[i] - args.ppo_kl_coef * ((i, t) in selected) * torch.abs(logp[i, t] - old[i, t])
            s = s if tis is None else s * tis[i, t]
            if args.beta > 0:
                d = ref[i, t] - logp[i, t]
                s = s - args.beta * (torch.exp(d) - d - 1)
            total, n = total + s, n + 1
    return -total / n


def random_batch(seed=0, B=8, T=5, spread=0.5):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 1.5 - 1.5).requires_grad_()  # C_t of order 1: some in (1, 5)
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])  # row 6 removed (no valid token)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1], dtype=torch.float64)
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, covpo.compute_advantages(rewards, ARGS), mask, tis


CASES = [("clip", dict(clip_cov_ratio=0.15)), ("clip", dict(clip_cov_ratio=2e-4, clip_cov_lb=0.5)),
         ("clip", dict(clip_cov_ratio=0.15, epsilon=0.1, epsilon_high=0.28)), ("kl", dict(kl_cov_ratio=0.2)),
         ("kl", dict(kl_cov_ratio=2e-4, ppo_kl_coef=0.1))]


@pytest.mark.parametrize("method, flags", CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_tis", [False, True])
def test_matches_the_definitions_and_micro_batches_sum_to_the_full_batch(method, flags, beta, with_tis):
    args = replace(ARGS, cov_method=method, beta=beta, **flags)
    logp, old, ref, A, mask, tis = random_batch()
    tis = tis if with_tis else None
    torch.manual_seed(7)
    stats = covpo.batch_stats(logp.detach(), old, A, mask, args)
    S = stats.selected
    picked = {tuple(x) for x in S.nonzero().tolist()}
    assert picked == reference_selection(logp.detach(), old, A, mask, args, seed=7)
    assert 0 < len(picked) < mask.sum() and stats.num_tokens.item() == 21
    loss, metrics = covpo.compute_loss(logp, old, ref, A, mask, args, stats=stats, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected = reference_loss(logp, old, ref, A, mask, args, picked, tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    if method == "clip":
        assert 0 < metrics["policy/clip_frac"] < 1  # PPO's clip acts too
    slices = [slice(0, 1), slice(1, 4), slice(4, 8)]
    micro = sum(covpo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats.for_rows(s),
                                   tis_weights=None if tis is None else tis[s])[0] for s in slices)
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


@pytest.mark.parametrize("method", ["clip", "kl"])
def test_a_micro_batchs_own_selection_is_not_the_batchs(method):
    """Why the selection is a batch statistic: micro-batches that rank their own tokens (verl's way) pick other
    tokens than the whole batch (here KL-Cov's top 1 per micro-batch, 3 in all, against 1), and the loss changes."""
    args = replace(ARGS, cov_method=method, clip_cov_ratio=0.15, kl_cov_ratio=2e-4)
    logp, old, ref, A, mask, _ = random_batch()
    torch.manual_seed(7)
    stats = covpo.batch_stats(logp.detach(), old, A, mask, args)
    own = torch.cat([covpo.batch_stats(logp.detach()[s], old[s], A[s], mask[s], args).selected
                     for s in [slice(0, 4), slice(4, 8)]])
    assert not torch.equal(own, stats.selected)


def fake_processes(monkeypatch, mine: list, rank: list):
    """accelerate's gather, pad_across_processes and process index as two processes would see them: phase 1 records
    each process's stack (mine), phase 2 returns both, padded to the longer T, in process order."""
    import accelerate
    import accelerate.utils

    def pad(x, dim):
        return x

    def gather(x):
        if len(mine) < 2:
            mine.append(x)
            return x
        width = max(m.shape[1] for m in mine)
        return torch.cat([torch.nn.functional.pad(m, (0, 0, 0, width - m.shape[1])) for m in mine])

    monkeypatch.setattr(accelerate.utils, "gather", gather)
    monkeypatch.setattr(accelerate.utils, "pad_across_processes", pad)
    monkeypatch.setattr(accelerate, "PartialState", lambda: types.SimpleNamespace(process_index=rank[0]))


@pytest.mark.parametrize("method, flags", [("clip", dict(clip_cov_ratio=0.15)), ("kl", dict(kl_cov_ratio=0.2))])
def test_two_processes_select_what_the_whole_batch_selects(monkeypatch, method, flags):
    """Each process holds half the rows, the second padded to fewer columns (its longest completion is 3 tokens):
    batch_stats gathers both halves, ranks them together, and each keeps its rows: the union is the whole batch's
    selection, Clip-Cov's draw included (the same seed on both processes), and the token counts add up."""
    args = replace(ARGS, cov_method=method, **flags)
    logp, old, _, A, mask, _ = random_batch()
    mask[5, 3:] = 0  # the second half's longest completion: 3 tokens
    torch.manual_seed(3)
    whole_stats = covpo.batch_stats(logp.detach(), old, A, mask, args)
    halves = [(slice(0, 4), 5), (slice(4, 8), 3)]
    mine, rank = [], [0]
    fake_processes(monkeypatch, mine, rank)
    for p, (s, T) in enumerate(halves):  # phase 1: each process's stack
        rank[0] = p
        covpo.batch_stats(logp.detach()[s, :T], old[s, :T], A[s], mask[s, :T], args)
    parts, count = [], 0
    for p, (s, T) in enumerate(halves):  # phase 2: the gathered batch
        rank[0] = p
        torch.manual_seed(3)
        stats = covpo.batch_stats(logp.detach()[s, :T], old[s, :T], A[s], mask[s, :T], args)
        parts.append(torch.nn.functional.pad(stats.selected, (0, 5 - T)))
        count += stats.num_tokens
    torch.testing.assert_close(torch.cat(parts), whole_stats.selected)
    assert count == whole_stats.num_tokens and whole_stats.selected.sum() > 1


@pytest.mark.parametrize("method", ["clip", "kl"])
def test_gradient_check_in_float64(method):
    """torch.autograd.gradcheck on the loss as a function of logp, the selection held (as in a micro-batch; it is a
    constant of the loss), away from the clip's and |.|'s kinks."""
    logp, old, ref, A, mask, tis = random_batch(seed=3, spread=0.3)
    args = replace(ARGS, cov_method=method, beta=0.04, clip_cov_ratio=0.15, kl_cov_ratio=0.2)
    torch.manual_seed(0)
    stats = covpo.batch_stats(logp.detach(), old, A, mask, args)

    def loss_of(x):
        return covpo.compute_loss(x, old, ref, A, mask, args, tis_weights=tis, stats=stats)[0]

    assert torch.autograd.gradcheck(loss_of, (logp.detach().requires_grad_(),))


# Against verl 0.5.0's own code


def verl_config(args):
    """What verl's two functions read of their config (AlgoConfig is stubbed: a namespace)."""
    policy_loss = types.SimpleNamespace(clip_cov_ratio=args.clip_cov_ratio, clip_cov_lb=args.clip_cov_lb,
                                        clip_cov_ub=args.clip_cov_ub, kl_cov_ratio=args.kl_cov_ratio,
                                        ppo_kl_coef=args.ppo_kl_coef)
    return types.SimpleNamespace(clip_ratio=0.2, clip_ratio_low=args.epsilon, clip_ratio_high=args.epsilon_high,
                                 policy_loss=policy_loss)


@pytest.mark.peer
def test_equals_verls_grpo_advantages(verl_core_algos):  # noqa: F811
    """verl's compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo, epsilon 1e-6) on the same rewards, placed at
    each row's last valid token; verl returns (B, T), the row's value on its valid tokens."""
    _, _, _, _, mask, _ = random_batch()
    mask[6, :2] = 1
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1, 0.5, 2, 0, 1], dtype=torch.float64)
    mask = torch.cat([mask, mask[:4]])
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64)
    token_rewards[torch.arange(12), mask.sum(-1) - 1] = rewards
    theirs, _ = verl_core_algos.compute_grpo_outcome_advantage(token_rewards, mask, [i // 4 for i in range(12)])
    ours = covpo.compute_advantages(rewards, ARGS)
    torch.testing.assert_close(ours[:, None] * mask, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.peer
@pytest.mark.parametrize("flags", [dict(), dict(clip_cov_ratio=0.15), dict(clip_cov_ratio=0.3, clip_cov_lb=0.2),
                                   dict(clip_cov_ratio=0.15, epsilon=0.1, epsilon_high=0.28),
                                   dict(clip_cov_ratio=0.15, epsilon=1.0, epsilon_high=1.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_verls_clip_cov_loss_and_gradient(verl_core_algos, flags, seed):  # noqa: F811
    """verl's compute_policy_loss_clip_cov (token-mean) on the same log-probs and advantages, the whole batch one
    micro-batch, the same torch seed before each call: the same tokens dropped (verl's clipfrac is their share), the
    same loss and gradient. verl's means divide by n + 1e-8."""
    args = replace(CLIP, **flags)
    logp, old, _, A, mask, _ = random_batch(seed=seed)
    torch.manual_seed(11)
    ours, metrics = covpo.compute_loss(logp, old, None, A, mask, args)
    torch.manual_seed(11)
    theirs, clipfrac, ppo_kl, _ = verl_core_algos.compute_policy_loss_clip_cov(
        old, logp, A[:, None] * mask, mask, loss_agg_mode="token-mean", config=verl_config(args))
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-8)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-8, atol=1e-12)
    assert metrics["covpo/selected_frac"].item() == pytest.approx(clipfrac.item(), rel=1e-6)
    assert clipfrac > 0


@pytest.mark.peer
@pytest.mark.parametrize("flags", [dict(), dict(kl_cov_ratio=0.2), dict(kl_cov_ratio=0.5, ppo_kl_coef=0.1),
                                   dict(kl_cov_ratio=2e-3, ppo_kl_coef=1.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_verls_kl_cov_loss_and_gradient(verl_core_algos, flags, seed):  # noqa: F811
    """verl's compute_policy_loss_kl_cov (token-mean) on the same log-probs and advantages, the whole batch one
    micro-batch: the same top-k tokens penalised, the same loss and gradient."""
    args = replace(KL, **flags)
    logp, old, _, A, mask, _ = random_batch(seed=seed)
    ours, _ = covpo.compute_loss(logp, old, None, A, mask, args)
    theirs, _, _, _ = verl_core_algos.compute_policy_loss_kl_cov(
        old, logp, A[:, None] * mask, mask, loss_agg_mode="token-mean", config=verl_config(args))
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-8)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-8, atol=1e-12)


# End to end


@pytest.mark.slow
@pytest.mark.precondition
@pytest.mark.parametrize("method", ["clip", "kl"])
def test_micro_batch_size_does_not_change_the_on_policy_gradient(in_toy_workdir, method):
    """On-policy, one optimizer step, a quarter of the tokens selected: the selection and the token mean are the
    batch's, so micro-batches of 1 and of 16 take the same gradient."""
    flags = ["--cov_method", method, "--clip_cov_ratio", "0.25", "--clip_cov_lb", "-100", "--kl_cov_ratio", "0.25"]
    grads = {mb: sgd_gradient(in_toy_workdir, f"covpo_{method}_micro{mb}", SMALL + flags + [
        "--micro_batch_size", str(mb)], script="covpo.py") for mb in (1, 16)}
    assert_same_gradient(grads[1], grads[16])


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_clip_cov_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    """Two passes over each batch in two mini-batches: Clip-Cov's selection (over both processes' rows, at the current
    weights) and the token mean are the optimizer batch's, whatever the micro-batches and processes: a fifth of the
    tokens the clip leaves alone (lb -100), drawn at random."""
    flags = STALE + ["--cov_method", "clip", "--clip_cov_ratio", "0.2", "--clip_cov_lb", "-100", "--epsilon", "0.02",
                     "--epsilon_high", "0.02"]
    assert_stale_updates_agree(in_toy_workdir, "covpo.py", "covpo_clip", flags,
                               lambda m: m["covpo/selected_frac"] > 0.005 and m["policy/ratio_mean"] != 1.0)


def first_selection(run_dir: str, num_processes: int, mini_rows: int) -> torch.Tensor:
    """(rows, T) the tokens KL-Cov picked in the first optimizer step of a run (--dump_stats_steps 1), the processes'
    rows put back in the batch's order: each process holds a contiguous share of each mini-batch."""
    parts = [torch.load(os.path.join(run_dir, "stats", f"step_000001.rank{p}.pt"))[0]["selected"]
             for p in range(num_processes)]
    assert all(len(part) == mini_rows // num_processes for part in parts)
    width = max(part.shape[1] for part in parts)
    return torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])


@pytest.mark.slow
@pytest.mark.precondition
def test_kl_covs_selection_is_the_optimizer_batchs_whatever_the_micro_batches_or_processes(in_toy_workdir):
    """KL-Cov picks the top covariance tokens of the whole optimizer batch (over both processes' rows): the first
    optimizer step's selection, at the weights that sampled the batch, is the same with one micro-batch, with
    micro-batches of one row and with 2 processes. The updates themselves are not compared: at that step every
    logp - old_logp is at rounding level, and the penalty's gradient, kappa sign(logp - old_logp), takes the sign of
    the rounding (as in verl), which another micro-batch size changes."""
    flags = STALE + ["--cov_method", "kl", "--kl_cov_ratio", "0.01", "--old_logp_source", "sampler",
                     "--dump_stats_steps", "1"]
    selections = []
    for name, processes, micro in [("kl_m8", 1, 8), ("kl_m1", 1, 1), ("kl_p2", 2, 2)]:
        sgd_gradient(in_toy_workdir, name, flags + ["--micro_batch_size", str(micro)], processes, "covpo.py", STALE_LR)
        selections.append(first_selection(os.path.join(in_toy_workdir, "runs", name), processes, 8))
        assert read_metrics(os.path.join(in_toy_workdir, "runs", name))[-1]["covpo/selected_frac"] > 0
    width = max(selection.shape[1] for selection in selections)  # each run pads to its own longest completion
    selections = [torch.nn.functional.pad(selection, (0, width - selection.shape[1])) for selection in selections]
    assert selections[0].sum() >= 1  # precondition: a token was picked
    assert torch.equal(selections[1], selections[0]) and torch.equal(selections[2], selections[0])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["clip", "kl"])
def test_toy_learns(in_toy_workdir, method):
    """A shortened toy run with the shared toy preset and the defaults: held-out greedy accuracy must rise, and the
    steps select tokens (KL-Cov every step; Clip-Cov most: a step may have no token in its window (1, 5)). On-policy
    the selection needs the log-probs themselves (current_and_old_logprobs: a pass on-policy too), not only their
    difference from old_logp, which is 0 there: every C_t would be 0, none in Clip-Cov's window."""
    run = run_script(covpo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25", "--cov_method", method,
                             "--run_name", f"covpo_{method}_learns"])
    metrics = read_metrics(run)
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar(f"covpo_{method}"), evals
    selected = [m["covpo/selected_frac"] > 0 for m in metrics if "covpo/selected_frac" in m]
    assert len(selected) == 50 and sum(selected) >= (50 if method == "kl" else 40), sum(selected)


def test_on_policy_the_old_policy_is_the_current_one_so_no_token_counts_as_clipped(monkeypatch):
    """On-policy the loop takes `logp_now` and `old_logp` from one pass (common/sampling.py
    current_and_old_logprobs): every ratio is 1, so Clip-Cov may draw any token in its covariance band. A placeholder
    of zeros for old_logp (as once on-policy) made the ratio exp(logp) and left out the tokens of negative advantage
    whose probability is under 1 - epsilon."""
    import common.sampling as sampling

    logp = torch.log(torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.95, 0.2]]))  # (B, T)  probabilities under 0.8 among them
    old_logp = torch.full_like(logp, -1.0)  # what an off-policy batch would hold
    monkeypatch.setattr(sampling, "logprobs_of", lambda run, net, batch, rows=None: logp[rows])
    batch = types.SimpleNamespace(old_logp=old_logp)
    on = types.SimpleNamespace(on_policy=True, model=None)
    now, old = sampling.current_and_old_logprobs(on, batch, slice(0, 2))
    assert now is old  # one pass: the old policy is the current one
    off = types.SimpleNamespace(on_policy=False, model=None)
    now, old = sampling.current_and_old_logprobs(off, batch, slice(0, 2))
    assert torch.equal(now, logp) and torch.equal(old, old_logp)

    mask = torch.ones_like(logp)
    A = torch.tensor([-1.0, 1.0])
    args = replace(CLIP, num_generations=2, clip_cov_ratio=1.0, clip_cov_lb=-math.inf, clip_cov_ub=math.inf)
    stats = covpo.batch_stats(logp, logp, A, mask, args)  # on-policy: every token eligible, ratio 1 ...
    assert stats.selected.all()  # ... and a ratio of 1 is never clipped, so the draw of all of them takes all
    zeros = covpo.batch_stats(logp, torch.zeros_like(logp), A, mask, args)  # the old placeholder
    assert not zeros.selected[0, :2].any() and zeros.selected[0, 2] and zeros.selected[1].all()


def test_zscore_epsilon_is_1e_6_added_to_the_std():
    """Rewards 1e-6 apart in a group of two: the std (1e-6 / sqrt(2)) is the epsilon's size, so A = +-(1e-6 / 2) /
    (1e-6 / sqrt(2) + 1e-6) = +-(1 - 1 / sqrt(2)); an epsilon of 1e-5 would give +-0.047, one inside the sqrt +-5e-4.
    A group of equal rewards (std 0) gets A = 0 / 1e-6 = 0, not NaN."""
    rewards = torch.tensor([1e-6, 0.0, 3.0, 3.0], dtype=torch.float64)
    A = covpo.compute_advantages(rewards, replace(ARGS, num_generations=2))
    a = 1 - 1 / math.sqrt(2)
    torch.testing.assert_close(A, torch.tensor([a, -a, 0.0, 0.0], dtype=torch.float64), rtol=1e-9, atol=0)
