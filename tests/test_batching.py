"""common/offpolicy.py and common/dapo.py by hand (importance weights, overlong penalty, dynamic sampling, the lag
queue), and rows removed from the loss, tool tokens and TIS / MIS in every estimator
(docs/estimators/conventions.md)."""

import importlib
import math
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from common.args import parse_args
from common.dapo import fill_batch, overlong_penalty
from common.offpolicy import importance_weights
from common.sampling import Batch, RolloutQueue, Rollouts
from evals import ALGORITHMS

SCRIPTS = {name: importlib.import_module(name) for name in ALGORITHMS}


def test_token_tis_and_mis_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    sampler = torch.tensor([[0.0, -1.0, 1.0], [-2.0, 0.0, 5.0]], dtype=torch.float64)  # rho = 1, e, 1/e; e^2, 1, pad
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tis, frac = importance_weights(old, sampler, mask, cap=2.0)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, math.exp(-1)], [2.0, 1.0, 0.0]], dtype=torch.float64))
    assert frac == 0.0  # truncation masks nothing
    mis, frac = importance_weights(old, sampler, mask, cap=2.0, masked=True)
    torch.testing.assert_close(mis, torch.tensor([[1.0, 0.0, math.exp(-1)], [0.0, 1.0, 0.0]], dtype=torch.float64))
    assert frac == pytest.approx(2 / 5)  # 2 of 5 valid tokens are above the cap


def test_sequence_tis_and_mis_by_hand():
    old = torch.zeros(3, 2, dtype=torch.float64)
    sampler = torch.tensor([[-0.5, -0.5], [0.2, 0.3], [-0.1, 9.0]], dtype=torch.float64)  # row 2: token 2 is padding
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    tis, _ = importance_weights(old, sampler, mask, cap=2.0, mode="sequence")  # rho_i = e^1, e^-0.5, e^0.1
    torch.testing.assert_close(tis, torch.tensor([[2.0, 2.0], [math.exp(-0.5)] * 2, [math.exp(0.1), 0.0]],
                                                 dtype=torch.float64))
    mis, frac = importance_weights(old, sampler, mask, cap=2.0, mode="sequence", masked=True)
    torch.testing.assert_close(mis, torch.tensor([[0.0, 0.0], [math.exp(-0.5)] * 2, [math.exp(0.1), 0.0]],
                                                 dtype=torch.float64))
    assert frac == pytest.approx(1 / 3)  # one row of three


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([5, 6, 7, 8, 10])  # limit 10, buffer 4: free up to 6 tokens, then -0.25 per token
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))


class OneProcess:
    """What fill_batch needs of an Accelerator, for a single process."""
    device = torch.device("cpu")

    def reduce(self, tensor, reduction):
        return tensor


def fake_rollouts(group_rewards: list[list[float]], tag: int) -> Rollouts:
    """Groups with the given rewards; every row's prompt is [tag, group] so tests can tell where it came from."""
    rows = [[tag, g] for g, rewards in enumerate(group_rewards) for _ in rewards]
    rewards = torch.tensor([float(r) for rewards in group_rewards for r in rewards])
    return Rollouts(rows, [[7, 2]] * len(rows), [[-0.1, -0.2]] * len(rows), rewards,
                    {"acc": rewards.clone()}, torch.zeros(len(rows), dtype=torch.bool), [[1, 0]] * len(rows))


def test_dynamic_sampling_drops_zero_std_groups_and_keeps_the_batch_size():
    rounds = {0: [[1, 1], [0, 1], [0, 0], [1, 1]], 1: [[1, 0], [1, 1], [0, 0], [0, 1]], 2: [[0, 1]] * 4}
    seen = []

    def sample_round(r):
        seen.append(r)
        return fake_rollouts(rounds[r], tag=r)

    metrics = {}
    batch, removed = fill_batch(sample_round, num_groups=3, G=2, accelerator=OneProcess(), max_rounds=4,
                                metrics=metrics)
    assert seen == [0, 1]  # round 1 filled the batch: round 2 never ran
    assert batch.prompt_ids == [[0, 1], [0, 1], [1, 0], [1, 0], [1, 3], [1, 3]]  # the first 3 kept, in sampling order
    assert (batch.rewards.view(-1, 2).std(dim=1) > 0).all()  # never a zero-std group
    assert len(batch.rewards) == 6 and not removed.any()
    assert batch.per_func["acc"].tolist() == batch.rewards.tolist() and batch.action_mask == [[1, 0]] * 6
    assert metrics == {"dynamic/rounds": 2, "dynamic/prompts_sampled": 8, "dynamic/groups_dropped": 5,
                       "dynamic/unfilled_groups": 0}


def test_dynamic_sampling_removes_the_slots_it_cannot_fill():
    metrics = {}
    batch, removed = fill_batch(lambda r: fake_rollouts([[1, 1], [0, 1], [0, 0]], tag=r), num_groups=3, G=2,
                                accelerator=OneProcess(), max_rounds=1, metrics=metrics)
    # two rounds give 2 groups with signal: the third slot is a dropped group, removed from the loss
    assert batch.prompt_ids == [[0, 1], [0, 1], [1, 1], [1, 1], [0, 0], [0, 0]]
    assert removed.tolist() == [False, False, False, False, True, True]
    assert metrics["dynamic/unfilled_groups"] == 1 and metrics["dynamic/rounds"] == 2


def test_rollout_queue_trains_each_step_on_the_batch_sampled_k_steps_earlier(tmp_path):
    """A hand-built schedule: `weights` counts the updates so far; each batch records which weights sampled it."""
    for lag in (0, 1, 2, 4):
        queue, weights, trained = RolloutQueue(lag), 0, []
        for step in range(8):
            for index in queue.steps_to_sample(step, total_steps=8):
                queue.put(SimpleNamespace(index=index, weights=weights), sampled_at=step)
            batch = queue.take(step)
            trained.append((batch.index, batch.weights, batch.staleness))
            weights += 1  # the update of this step
        assert trained == [(s, max(0, s - lag), min(s, lag)) for s in range(8)]  # data of step s, weights of s - K
        assert not queue.batches  # nothing sampled for a step past the last

    queue = RolloutQueue(2)
    for index in queue.steps_to_sample(0, total_steps=8):
        T = index + 1
        queue.put(Batch(*(torch.full((2, T), index) for _ in range(5)), rewards=torch.zeros(2),
                        truncated=torch.zeros(2, dtype=torch.bool), per_func={"f": torch.ones(2)},
                        old_logp=torch.randn(2, T), ref_logp=None), sampled_at=0)
    queue.take(0)
    queue.save(str(tmp_path), process_index=1)
    restored = RolloutQueue(2)
    restored.load(str(tmp_path), process_index=1)
    assert [int(b.input_ids[0, 0]) for b in restored.batches] == [1, 2]
    assert all(torch.equal(a.old_logp, b.old_logp) and a.as_dict().keys() == b.as_dict().keys()
               for a, b in zip(restored.batches, queue.batches))
    empty = RolloutQueue(0)
    empty.save(str(tmp_path / "none"), process_index=0)  # lag 0: nothing between steps, no file
    assert not os.path.exists(tmp_path / "none")


def own_inputs(name: str, ref: torch.Tensor) -> dict:
    """What a script's loss takes beyond the six: sdpo.py's self-teacher log-probs (the reference's stand in for them,
    so that its distillation term is in every check here)."""
    return {"teacher_logp": ref} if name == "sdpo" else {}


def removal_batch(G: int = 4, seed: int = 0):
    """Two groups of G rows; the last row of each group will be removed (mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = 2 * G, 5
    logp = (-torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.1).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = logp.detach() + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.arange(T)[None, :] < torch.randint(2, T + 1, (B,), generator=gen)[:, None]).long()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0][:B], dtype=torch.float64)
    return logp, old, ref, rewards, mask


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_removed_rows_get_no_gradient_and_leave_every_denominator(name):
    """The loss with the last row of each group removed (mask 0, as --mask_truncated does) equals the loss of the
    batch of kept rows alone (G - 1 per group), and the removed rows get no gradient."""
    module, G = SCRIPTS[name], 4
    args = replace(parse_args(module.Args, []), num_generations=G, beta=0.05)
    logp, old, ref, rewards, mask = removal_batch(G)
    A = module.compute_advantages(rewards, args)
    removed = torch.tensor([j == G - 1 for _ in range(2) for j in range(G)])
    loss, _ = module.compute_loss(logp, old, ref, A, mask * ~removed[:, None], args, **own_inputs(name, ref))
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[removed].abs().max() == 0 and grad[~removed].abs().max() > 0

    kept = ~removed
    small = logp.detach()[kept].clone().requires_grad_()
    expected, _ = module.compute_loss(small, old[kept], ref[kept], A[kept], mask[kept],
                                      replace(args, num_generations=G - 1), **own_inputs(name, ref[kept]))
    (expected_grad,) = torch.autograd.grad(expected, small)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad[kept], expected_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_whole_removed_group_changes_nothing(name):
    """Every row of a group removed (dynamic sampling's unfilled slot): the loss is the other group's, finite."""
    module, G = SCRIPTS[name], 4
    args = replace(parse_args(module.Args, []), num_generations=G, beta=0.05)
    logp, old, ref, rewards, mask = removal_batch(G, seed=1)
    A = module.compute_advantages(rewards, args)
    removed = torch.arange(2 * G) >= G
    loss, metrics = module.compute_loss(logp, old, ref, A, mask * ~removed[:, None], args, **own_inputs(name, ref))
    assert all(math.isfinite(float(v)) for v in metrics.values())
    expected, _ = module.compute_loss(logp[:G], old[:G], ref[:G], A[:G], mask[:G], args, **own_inputs(name, ref[:G]))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_masked_is_weights_zero_a_rows_policy_gradient(name):
    """MIS in sequence mode: a row above the cap gets weight 0 in the policy term: with beta 0, no gradient."""
    module, G = SCRIPTS[name], 4
    args = replace(parse_args(module.Args, []), num_generations=G, beta=0.0)
    if name == "snib":
        args = replace(args, self_normalize=False)  # SNIB-sg's group mean is a constant; Vanilla IS: none at all
    logp, old, ref, rewards, mask = removal_batch(G, seed=2)
    A = module.compute_advantages(rewards, args)
    sampler = old.clone()
    sampler[0] -= 1.0  # row 0: rho_0 = e^L0 > 2
    weights, frac = importance_weights(old, sampler, mask, cap=2.0, mode="sequence", masked=True)
    assert weights[0].abs().max() == 0 and frac == pytest.approx(1 / (2 * G))
    loss, _ = module.compute_loss(logp, old, ref, A, mask, args, tis_weights=weights, **own_inputs(name, ref))
    (grad,) = torch.autograd.grad(loss, logp)
    # the same as row 0 having no advantage (its policy term gone), whatever its weight
    no_signal, ones = A.clone(), weights.clone()
    no_signal[0], ones[0] = 0.0, mask[0].double()
    expected, _ = module.compute_loss(logp, old, ref, no_signal, mask, args, tis_weights=ones, **own_inputs(name, ref))
    (expected_grad,) = torch.autograd.grad(expected, logp)
    if name == "ipo":  # IPO: a row of zero advantage leaves the token count too (prime-rl drops it); MIS keeps it
        expected_grad = expected_grad * (module.batch_stats(no_signal, mask, args).num_tokens.item()
                                         / module.batch_stats(A, mask, args).num_tokens.item())
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    if name == "vespo":  # VESPO folds the weight into w, floored at 1e-8: phi = e^lambda 1e-8^k ~ 2e-15, not 0
        assert grad[0].abs().max() < 1e-15 and grad[1:].abs().max() > 0
    # P3O's trust region (1 - ESS) KL(old), DRO's (tau/2) (logp - old_logp)^2 and SDPO's distillation term are not
    # policy terms: they keep a gradient on every row
    elif name not in ("p3o", "dro", "sdpo"):
        assert grad[0].abs().max() == 0 and grad[1:].abs().max() > 0


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_tool_output_tokens_are_context_not_actions(name):
    """Multi-turn rows: tool-output tokens (columns 2-3, mask 0) between model tokens. Whatever their logp, old_logp
    and ref_logp, the loss and every gradient are those of the rows with the tool tokens cut out: sums, lengths,
    CTPO's c_t and p_t, P3O's token counts all run over the model's tokens only (docs/estimators/conventions.md)."""
    module, G = SCRIPTS[name], 4
    args = replace(parse_args(module.Args, []), num_generations=G, beta=0.05)
    logp, old, ref, rewards, _ = removal_batch(G, seed=3)
    B, T = logp.shape
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, 2:4] = 0  # the tool's turn
    A = module.compute_advantages(rewards, args)
    noisy = lambda x, s: x.detach() + s * (torch.arange(T) >= 2) * (torch.arange(T) < 4)  # noqa: E731  tool columns only
    losses, grads = [], []
    for shift in (0.0, 0.9):
        lp = noisy(logp, shift).requires_grad_()
        loss, _ = module.compute_loss(lp, noisy(old, -shift), noisy(ref, shift / 2), A, mask, args,
                                      **own_inputs(name, noisy(ref, shift / 2)))
        losses.append(loss.item())
        grads.append(torch.autograd.grad(loss, lp)[0])
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)
    assert grads[0][:, 2:4].abs().max() == 0
    keep = [0, 1, 4]  # the model's tokens, with the tool turn cut out
    short = logp.detach()[:, keep].clone().requires_grad_()
    expected, _ = module.compute_loss(short, old[:, keep], ref[:, keep], A, mask[:, keep], args,
                                      **own_inputs(name, ref[:, keep]))
    assert losses[0] == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grads[0][:, keep], torch.autograd.grad(expected, short)[0], rtol=1e-10, atol=1e-14)
