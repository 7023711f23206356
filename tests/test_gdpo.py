"""gdpo.reward_matrix / compute_advantages / batch_normalise / compute_loss by hand, against GRPO (one reward), against
verl 0.9.1's own `compute_gdpo_outcome_advantage` (`verl/trainer/ppo/core_algos.py`, loaded from its wheel), across
two simulated processes, then an end-to-end run on the toy's two rewards.

TRL 1.16's `multi_objective_aggregation="normalize_then_sum"` is not reachable as a function (it is inline in
`GRPOTrainer._generate_and_score_completions`), so it is not called here; docs/estimators/gdpo.md compares it."""

import dataclasses
import math
import threading
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_reinforcepp import load_verl_core_algos

import gdpo
import grpo
import landscape

ARGS = gdpo.Args(num_generations=2)
VERL_GDPO = "0.9.1"  # the first PyPI release checked here that ships @register_adv_est("gdpo")


@pytest.fixture(scope="session")
def verl_gdpo(tmp_path_factory):
    """verl 0.9.1's core_algos module (VERL_CACHE=DIR keeps the wheel, else a temporary folder)."""
    return load_verl_core_algos(tmp_path_factory, VERL_GDPO)


def test_defaults_and_there_are_no_other_switches():
    args = gdpo.Args()
    # the authors' TRL recipe (trl-GDPO/open-r1/recipes/Qwen2.5-1.5B-Instruct/gdpo_gsm8k/config.yaml) leaves TRL
    # 0.18's GRPOConfig defaults: beta 0.04, epsilon 0.2 (epsilon_high = epsilon)
    assert (args.beta, args.epsilon, args.epsilon_high) == (0.04, 0.2, 0.2)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(gdpo.Args)} - shared == {"beta", "epsilon", "epsilon_high"}


def test_the_reward_matrix_holds_each_function_then_the_overlong_penalty():
    per_func = {"math_accuracy": torch.tensor([1.0, 0.0]), "math_accuracy/timeouts": torch.tensor([0.0, 1.0]),
                "format": torch.tensor([0.5, 1.0]), "overlong": torch.tensor([0.0, -0.3])}
    torch.testing.assert_close(gdpo.reward_matrix(per_func), torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, -0.3]]))


# One reward: GRPO's advantage


@pytest.mark.parametrize("weights", [None, "2.0"])
def test_one_reward_is_grpos_advantage(weights):
    """K = 1: the z-score of the (weighted) reward, GRPO's advantage on batch.rewards, and no batch normalisation
    (the authors' TRL code applies GDPO only to several rewards)."""
    torch.manual_seed(0)
    rewards = torch.rand(16, dtype=torch.float64).round(decimals=1)
    args = replace(ARGS, num_generations=4, reward_weights=weights)
    total = rewards * (2.0 if weights else 1.0)  # what common/tasks/rewards.py sums into batch.rewards
    expected = grpo.compute_advantages(total, grpo.Args(num_generations=4))
    for given in (rewards, rewards[:, None]):
        A = gdpo.compute_advantages(given, args)
        torch.testing.assert_close(A, expected, rtol=0, atol=0)
    mask = torch.ones(16, 3)
    assert torch.equal(gdpo.batch_normalise(A, mask, 1), A)


# Several rewards, by hand


def test_decoupled_normalisation_keeps_what_grpos_sum_collapses():
    """The paper's Figure 2 in two groups of two: (correct, format) rewards (1, 1) vs (0, 0) and (1, 0) vs (0, 0).
    GRPO z-scores the sums (2, 0) and (1, 0): +-1/sqrt 2 in both groups. GDPO z-scores each reward in its group:
    correctness +-1/sqrt 2 in both, format +-1/sqrt 2 in the first and 0 (equal rewards) in the second, so the first
    group's pair is twice as far apart."""
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    z = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - 1/2) / (std of (1, 0), unbiased: 1/sqrt 2)
    g = 1 / (math.sqrt(2) + 1e-6)  # (2 - 1) / (std of (2, 0): sqrt 2), and (1, 0): z
    torch.testing.assert_close(grpo.compute_advantages(rewards.sum(-1), grpo.Args(num_generations=2)),
                               torch.tensor([g, -g, z, -z], dtype=torch.float64))
    assert g == pytest.approx(z, rel=1e-5)  # GRPO: the same pair of advantages in both groups
    A = gdpo.compute_advantages(rewards, ARGS)
    torch.testing.assert_close(A, torch.tensor([2 * z, -2 * z, z, -z], dtype=torch.float64))
    weighted = gdpo.compute_advantages(rewards, replace(ARGS, reward_weights="1.0,0.5"))
    torch.testing.assert_close(weighted, torch.tensor([1.5 * z, -1.5 * z, z, -z], dtype=torch.float64))


def test_batch_normalisation_by_hand_weighs_rows_by_their_tokens():
    """Advantages (3, -1, 1, -3) on rows of 2, 1, 1, 0 valid tokens: the token-weighted mean (6 - 1 + 1) / 4 = 1.5,
    the unbiased variance over the 4 tokens (2 * 1.5^2 + 2.5^2 + 0.5^2) / 3 = 11/3; the removed row leaves both."""
    A = torch.tensor([3.0, -1.0, 1.0, -3.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [0, 0]])
    mean, var = 1.5, (2 * 1.5 ** 2 + 2.5 ** 2 + 0.5 ** 2) / 3
    expected = (A - mean) / math.sqrt(var + 1e-8)
    torch.testing.assert_close(gdpo.batch_normalise(A, mask, 2), expected, rtol=1e-7, atol=0)  # n + 1e-8 in verl


def run_as_processes(fn, parts):
    """fn(part, total) on each part in its own thread, `total` an all-reduce (a sum over the threads in rank order)."""
    barrier, slots, results = threading.Barrier(len(parts)), [None] * len(parts), [None] * len(parts)

    def total_of(rank):
        def total(x):
            slots[rank] = x
            barrier.wait()
            summed = sum(slots[1:], slots[0])
            barrier.wait()
            return summed
        return total

    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(parts[r], total_of(r))))
               for r in range(len(parts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_two_processes_normalise_with_the_whole_batchs_statistics():
    torch.manual_seed(1)
    A = torch.randn(8, dtype=torch.float64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 0, 2, 4, 5, 1])[:, None]).long()
    whole = gdpo.batch_normalise(A, mask, 3)
    halves = run_as_processes(lambda rows, total: gdpo.batch_normalise(A[rows], mask[rows], 3, total),
                              [slice(0, 4), slice(4, 8)])
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-12, atol=0)
    assert not torch.allclose(halves[0], gdpo.batch_normalise(A[:4], mask[:4], 3))  # one process's own: not it


# Against verl 0.9.1's own code


def verl_inputs(rewards, mask, prompt_length=3):
    """verl's batch: prompts and an attention mask over prompt | response, the per-reward scores as numpy arrays
    in non_tensor_batch (verl places each at the row's last valid token), a uid per group."""
    B = len(rewards)
    batch = {"prompts": torch.zeros(B, prompt_length, dtype=torch.long),
             "attention_mask": torch.cat([torch.ones(B, prompt_length, dtype=torch.long), mask], -1)}
    non_tensor = {f"r{k}": rewards[:, k].numpy() for k in range(rewards.shape[1])}
    return batch, non_tensor


def test_a_reward_that_does_not_apply_leaves_its_groups_z_score_and_the_sum():
    """A function returning None for a sample (TRL's convention; NaN here) is z-scored over the samples it applies to,
    and adds nothing for the others, as TRL's normalize_then_sum (nanmean, nanstd, nansum)."""
    nan = float("nan")
    rewards = torch.tensor([[1.0, 2.0], [0.0, nan], [1.0, 4.0], [0.0, nan]], dtype=torch.float64)  # (B, K), G 4
    A = gdpo.compute_advantages(rewards, gdpo.Args(num_generations=4))
    first = (rewards[:, 0] - 0.5) / (math.sqrt(1 / 3) + 1e-6)  # z-score over all four
    second = torch.tensor([-1.0, 0.0, 1.0, 0.0], dtype=torch.float64) / (math.sqrt(2.0) + 1e-6)  # over rows 0, 2
    torch.testing.assert_close(A, first + second)


@pytest.mark.peer
@pytest.mark.parametrize("K, weights", [(2, None), (3, None), (3, [1.0, 0.5, 2.0])])
def test_equals_verls_gdpo_advantage(verl_gdpo, K, weights):
    """verl's compute_gdpo_outcome_advantage (per-reward GRPO z-scores, weighted sum, masked_whiten over the
    response mask) and ours on the same rewards: padding, a removed row (its reward still in its group's mean, its
    tokens out of the whitening, as ours), groups with equal rewards. verl computes in float32: equal to 1e-5."""
    torch.manual_seed(K)
    rewards = torch.randint(0, 3, (12, K)).double() / 2
    rewards[4:8, 0] = 1.0  # a group whose first reward is the same for all
    mask = (torch.arange(6)[None] < torch.tensor([6, 1, 3, 4, 2, 6, 5, 1, 3, 6, 2, 4])[:, None]).long()
    mask[9] = 0  # a removed row
    args = replace(ARGS, num_generations=4, reward_weights=None if weights is None else ",".join(map(str, weights)))
    ours = gdpo.batch_normalise(gdpo.compute_advantages(rewards, args), mask, K)
    batch, non_tensor = verl_inputs(rewards, mask)
    config = {"gdpo_reward_keys": list(non_tensor), "gdpo_reward_weights": weights}
    theirs, returns = verl_gdpo.compute_gdpo_outcome_advantage(
        torch.zeros(12, 6), mask.float(), [i // 4 for i in range(12)], config=config, non_tensor_batch=non_tensor,
        batch=batch)
    torch.testing.assert_close(ours[:, None] * mask, theirs.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(theirs, returns)


@pytest.mark.peer
def test_verl_whitens_a_single_reward_and_we_do_not(verl_gdpo):
    """With one reward verl 0.9.1 still whitens GRPO's advantage over the batch; the authors' TRL code (and
    gdpo.py) leave GRPO's advantage. Forcing our batch normalisation gives verl's."""
    torch.manual_seed(5)
    rewards = torch.randint(0, 2, (8, 1)).double()
    mask = (torch.arange(4)[None] < torch.tensor([4, 1, 3, 2, 4, 4, 1, 2])[:, None]).long()
    args = replace(ARGS, num_generations=4)
    A = gdpo.compute_advantages(rewards, args)
    batch, non_tensor = verl_inputs(rewards, mask)
    theirs, _ = verl_gdpo.compute_gdpo_outcome_advantage(
        torch.zeros(8, 4), mask.float(), [i // 4 for i in range(8)], config={"gdpo_reward_keys": ["r0"]},
        non_tensor_batch=non_tensor, batch=batch)
    torch.testing.assert_close(gdpo.batch_normalise(A, mask, 2)[:, None] * mask, theirs.double(), rtol=1e-5,
                               atol=1e-5)
    assert not torch.allclose(gdpo.batch_normalise(A, mask, 1)[:, None] * mask, theirs.double(), atol=1e-3)


# The loss: GRPO's PPO clip, a token mean


def random_batch(seed=0, B=8, T=5):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    mask = (torch.arange(T)[None] < torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])[:, None]).long()
    rewards = torch.randint(0, 2, (B, 2)).double()
    A = gdpo.batch_normalise(gdpo.compute_advantages(rewards, replace(ARGS, num_generations=4)), mask, 2)
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, A, mask, tis


@pytest.mark.parametrize("with_tis", [False, True])
def test_the_loss_is_grpos_token_mean_and_micro_batches_sum_to_the_full_batch(with_tis):
    logp, old, ref, A, mask, tis = random_batch()
    tis = tis if with_tis else None
    args = replace(ARGS, num_generations=4)
    loss, metrics = gdpo.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    token_mean = landscape.Args(num_generations=4, beta=args.beta, loss_agg="token-mean")
    expected, _ = landscape.compute_loss(logp, old, ref, A, mask, token_mean, tis_weights=tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    assert 0 < metrics["policy/clip_frac"].item() < 1 and "policy/kl" in metrics
    stats = gdpo.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"] and stats.num_tokens.item() == 21
    micro = sum(gdpo.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                  tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_on_policy_gradient_is_the_token_mean_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([1.0, -2.0, 0.5])
    loss, _ = gdpo.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, beta=0.0))
    assert loss.item() == pytest.approx(-(2 * 1.0 - 3 * 2.0 + 0.5) / 6)
    expected = -torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0], [0.5, 0.0, 0.0]]) / 6
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], expected)


# End to end


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run on the toy's two rewards (exact sum, closeness): held-out greedy accuracy must rise."""
    run = run_script(gdpo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                            "--reward_funcs", "toy_addition,toy_closeness", "--run_name", "gdpo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("gdpo"), evals
