"""rloo.compute_advantages / compute_loss by hand, against loops from the equations (Ahmadian et al.'s leave-one-out
baseline with the KL-shaped reward, TRL's sequence-ratio PPO loss), against TRL 1.16's own RLOOTrainer (its advantage
computation in _generate_and_score_completions, its _compute_loss), then end-to-end runs."""

import dataclasses
import math
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_snib import STALE, assert_stale_updates_agree

import grpo
import landscape
import rloo

ARGS = rloo.Args(num_generations=2)


def test_defaults_and_there_are_no_other_switches():
    args = rloo.Args()
    assert (args.epsilon, args.epsilon_high, args.beta) == (0.2, 0.2, 0.05)  # TRL's RLOOConfig defaults
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(rloo.Args)} - shared == {"beta", "epsilon", "epsilon_high"}


def test_leave_one_out_advantages_by_hand():
    """Group 1: R = (1, 0, 0, 0): A_0 = 1 - 0, the others 0 - 1/3; group 2 all equal: 0. It is G / (G - 1) times the
    centred reward, with no std; the KL enters as a penalty in each reward before the baseline."""
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3], dtype=torch.float64)
    args = replace(ARGS, num_generations=4)
    A = rloo.compute_advantages(rewards, args)
    torch.testing.assert_close(A, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0], dtype=torch.float64))
    centred = rewards.view(2, 4) - rewards.view(2, 4).mean(1, keepdim=True)
    torch.testing.assert_close(A, (4 / 3 * centred).flatten())
    kl = torch.tensor([2.0, 0, 0, 0, 0, 0, 0, 4.0], dtype=torch.float64)
    with_kl = rloo.compute_advantages(rewards, args, kl)  # beta 0.05: R' = (0.9, 0, 0, 0, 3, 3, 3, 2.8)
    torch.testing.assert_close(with_kl, torch.tensor([0.9, -0.3, -0.3, -0.3, 0.2 / 3, 0.2 / 3, 0.2 / 3, -0.2],
                                                     dtype=torch.float64))


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: every s_i = 1, the loss -(1/B) sum_i A_i and its gradient REINFORCE's, -(1/B) A_i on every
    valid token (grad log pi(y_i) is a sum over tokens): GRPO's sequence-mean gradient times L_i, which is GRPO's
    token-sum-norm gradient with max_completion_length 1."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([1.0, -2.0, 0.5])
    loss, metrics = rloo.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, beta=0.0))
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    assert metrics["policy/seq_ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0], [0.5, 0.0, 0.0]]) / 3
    torch.testing.assert_close(grad, expected)
    token_sum = landscape.compute_loss(logp, logp.detach(), None, A, mask, landscape.Args(
        num_generations=1, beta=0.0, loss_agg="token-sum-norm", max_completion_length=1))[0]
    torch.testing.assert_close(torch.autograd.grad(token_sum, logp)[0], expected)


def test_the_sequence_ratio_is_the_product_of_token_ratios_and_is_clipped_as_a_whole():
    """Token log-ratios (0.1, 0.15): s = e^0.25 = 1.28 > 1.2. A > 0: clipped, the loss -1.2 A and no gradient on
    either token; A < 0: the pessimistic side, -s A, whose gradient -A s sits on both tokens."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.15, 5.0]], dtype=torch.float64, requires_grad=True)  # the third is padding
    mask = torch.tensor([[1, 1, 0]])
    args = replace(ARGS, beta=0.0)
    loss, metrics = rloo.compute_loss(logp, old, None, torch.tensor([2.0], dtype=torch.float64), mask, args)
    assert loss.item() == pytest.approx(-1.2 * 2.0) and metrics["policy/clip_frac_high"].item() == 1.0
    assert torch.autograd.grad(loss, logp)[0].abs().max() == 0
    loss, metrics = rloo.compute_loss(logp, old, None, torch.tensor([-2.0], dtype=torch.float64), mask, args)
    s = math.exp(0.25)
    assert loss.item() == pytest.approx(2.0 * s, rel=1e-12) and metrics["policy/clip_frac"].item() == 0.0
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0],
                               torch.tensor([[2.0 * s, 2.0 * s, 0.0]], dtype=torch.float64))


def test_tis_scales_a_row_by_the_mean_of_its_tokens_weights_and_the_kl_is_not_in_the_loss():
    logp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old, ref = logp.detach() - 0.05, logp.detach() + 0.3
    mask, A = torch.tensor([[1, 1], [1, 0]]), torch.tensor([1.0, -1.0], dtype=torch.float64)
    tis = torch.tensor([[0.5, 2.0], [1.5, 0.0]], dtype=torch.float64)
    loss, metrics = rloo.compute_loss(logp, old, ref, A, mask, ARGS, tis_weights=tis)
    s0, s1 = math.exp(0.1), math.exp(0.05)
    assert loss.item() == pytest.approx(-(min(s0, 1.2) * 1.25 + -s1 * 1.5) / 2, rel=1e-12)
    assert metrics["policy/kl"].item() == pytest.approx(math.exp(0.3) - 0.3 - 1)  # logged, not in the loss
    no_kl = rloo.compute_loss(logp, old, ref, A, mask, replace(ARGS, beta=0.0), tis_weights=tis)[0]
    assert no_kl.item() == loss.item()


# Against loops straight from the equations, and micro-batches


def reference_advantages(rewards, kl, G, beta):
    """Ahmadian et al.'s leave-one-out baseline on the KL-shaped reward R_i - beta KL_i, one completion at a time."""
    shaped = [rewards[i] - beta * kl[i] for i in range(len(rewards))]
    out = []
    for i in range(len(rewards)):
        g = i // G
        others = [shaped[j] for j in range(g * G, g * G + G) if j != i]
        out.append(shaped[i] - sum(others) / (G - 1))
    return torch.stack(out)


def reference_loss(logp, old, A, mask, args, tis=None):
    """TRL's RLOO objective, row by row with torch scalars: s_i = prod_t r_t over valid tokens, the PPO clip of s_i,
    a mean over completions (a row's term times the mean of its TIS weights)."""
    B, T = logp.shape
    total, rows = 0.0, 0
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        if not valid:
            continue
        s = 1.0
        for t in valid:
            s = s * torch.exp(logp[i, t] - old[i, t])
        term = torch.minimum(s * A[i], torch.clamp(s, 1 - args.epsilon, 1 + args.epsilon_high) * A[i])
        if tis is not None:
            term = term * sum(tis[i, t] for t in valid) / len(valid)
        total, rows = total + term, rows + 1
    return -total / rows


def random_batch(seed=0, B=8, T=5, spread=0.15, beta=0.05):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread  # sequence ratios on both sides of the clip
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])  # row 6 removed (no valid token)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T) unequal lengths, right-padded
    rewards = torch.rand(B, dtype=torch.float64)
    kl = (mask * (old - ref)).sum(-1)  # (B,) the sampler's log-ratio to the reference (old_logp stands in)
    A = rloo.compute_advantages(rewards, replace(ARGS, num_generations=4, beta=beta), kl)
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, rewards, kl, A, mask, tis


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("epsilon, epsilon_high", [(0.2, 0.2), (0.1, 0.28)])
def test_matches_the_equations_and_micro_batches_sum_to_the_full_batch(beta, with_tis, epsilon, epsilon_high):
    args = replace(ARGS, num_generations=4, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high)
    logp, old, ref, rewards, kl, A, mask, tis = random_batch(beta=beta)
    torch.testing.assert_close(A, reference_advantages(rewards, kl, 4, beta), rtol=1e-12, atol=1e-15)
    tis = tis if with_tis else None
    loss, metrics = rloo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected = reference_loss(logp, old, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    assert 0 < metrics["policy/clip_frac"] < 1  # some completions clipped, not all
    stats = rloo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_rows"]
    assert stats.per_row_values() == {} and stats.num_rows.item() == 7
    micro = sum(rloo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                  tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    """torch.autograd.gradcheck on the loss as a function of logp (away from the clip's kinks)."""
    logp, old, ref, _, _, A, mask, tis = random_batch(seed=3, spread=0.02)
    assert torch.autograd.gradcheck(lambda x: rloo.compute_loss(x, old, ref, A, mask, ARGS, tis_weights=tis)[0],
                                    (logp.detach().requires_grad_(),))


# Against TRL 1.16's own code


def trl_rloo_advantages(rewards, old, ref, mask, G, beta):
    """TRL's RLOOTrainer._generate_and_score_completions itself, on a stand-in trainer: generation returns completions
    of the mask's lengths, the reward function returns `rewards`, the policy's forward `old` and the reference's `ref`
    (one process, normalize_advantages False, TRL's default). Returns TRL's advantages."""
    from trl import RLOOTrainer

    B = len(rewards)
    completions = [[7] * int(n) for n in mask.sum(-1)]
    policy, reference = SimpleNamespace(training=True, is_gradient_checkpointing=False), SimpleNamespace()
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                    reduce=lambda x, reduction="sum": x, gather=lambda x: x),
        model=policy, ref_model=reference, beta=beta, num_generations=G, normalize_advantages=False,
        _generate=lambda prompts: ([[1]] * B, completions, ["c"] * B),
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        args=SimpleNamespace(per_device_train_batch_size=B, gradient_checkpointing_kwargs=None),
        _get_per_token_logps_and_entropies=lambda net, *a, **k: (ref if net is reference else old, None, None),
        _calculate_rewards=lambda *a: rewards[:, None].clone(), reward_weights=torch.ones(1, dtype=rewards.dtype),
        reward_clip_range=None, reward_func_names=["r"], _metrics=defaultdict(lambda: defaultdict(list)),
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list)},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False)
    return RLOOTrainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * B)["advantages"]


def trl_rloo_loss(logp, old, A, mask, epsilon, epsilon_high):
    """TRL's RLOOTrainer._compute_loss itself, on a stand-in trainer whose forward returns `logp` (one process)."""
    from trl import RLOOTrainer

    accelerator = SimpleNamespace(reduce=lambda x, reduction="sum": x, gather=lambda x: x)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, epsilon_low=epsilon, epsilon_high=epsilon_high, model=SimpleNamespace(training=True),
        accelerator=accelerator, _metrics=defaultdict(lambda: defaultdict(list)))
    B, T = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "old_logps": (old * mask).sum(1), "advantages": A}
    return RLOOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_equals_trls_advantages_on_the_same_rewards(beta):
    """TRL puts the KL in the reward as rloo.py does: beta sum_t (old_logp - ref_logp), k1 at the weights that
    sampled. TRL's old_logp is a trainer pass at those weights; rloo.py's main() takes the sampler's log-probs, the
    same quantity up to the sampler/trainer mismatch: here one tensor stands for both."""
    _, old, ref, rewards, kl, _, mask, _ = random_batch(seed=4)
    ours = rloo.compute_advantages(rewards, replace(rloo.Args(), num_generations=4, beta=beta), kl)
    theirs = trl_rloo_advantages(rewards, old, ref, mask, 4, beta)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-15)


@pytest.mark.peer
@pytest.mark.parametrize("epsilon, epsilon_high", [(0.2, 0.2), (0.1, 0.28)])
def test_equals_trls_loss_and_gradient_given_the_advantages(epsilon, epsilon_high):
    """TRL's loss is a mean over all B rows (a row without valid tokens would count): the batch here has none, as
    TRL's trainer never builds one. TRL applies no sampler-mismatch weight: compared without TIS."""
    logp, old, _, _, _, A, mask, _ = random_batch(seed=2)
    mask[6, :2] = 1  # no removed row
    args = replace(rloo.Args(), num_generations=4, epsilon=epsilon, epsilon_high=epsilon_high)
    ours, metrics = rloo.compute_loss(logp, old, None, A, mask, replace(args, beta=0.0))
    theirs = trl_rloo_loss(logp, old, A, mask, epsilon, epsilon_high)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])
    assert 0 < metrics["policy/clip_frac"] < 1  # the comparison covers both branches of the clip


# End to end


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    """Two passes over each batch in two mini-batches, with a clip tight enough that completions are clipped: the
    mean over rows has the optimizer batch's denominator, whatever the micro-batches and processes."""
    flags = STALE + ["--epsilon", "0.02", "--epsilon_high", "0.02"]
    assert_stale_updates_agree(in_toy_workdir, "rloo.py", "rloo", flags, lambda m: m["policy/clip_frac"] > 0.05)


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset (and the default beta 0.05, the KL in the reward): held-out
    greedy accuracy must rise."""
    run = run_script(rloo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                            "--run_name", "rloo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("rloo"), evals
