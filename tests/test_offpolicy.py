"""End-to-end runs of the off-policy options on the toy (CPU): rollout lag against the weights that sampled each batch,
exact resume and 2-process invariance with a lag, dynamic sampling, truncation masks and IS corrections."""

import json
import os
import shutil
import types

import pytest
import torch
from conftest import launch, read_metrics, run_script
from safetensors.torch import load_file
from test_train import REPO, SMALL, assert_same_weights, final_weights, run_interrupted
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
import snib
from common.logprobs import completion_logprobs
from common.offpolicy import importance_weights
from common.sampling import step_prompts

TOY = os.path.join("runs", "toy")


def queue_of(run_dir: str, step: int) -> list[dict]:
    return torch.load(os.path.join(run_dir, "checkpoints", f"step_{step}", "state", "rollout_queue_0.pt"),
                      weights_only=True)


def logprobs_at(run_dir: str, step: int, batch: dict) -> torch.Tensor:
    """The batch's completion log-probs under the weights of a checkpoint, 0 off the mask."""
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", f"step_{step}", "model"),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["mask"].shape[1], 1.0)
    return logp * batch["mask"]


@pytest.mark.slow
def test_rollout_lag_trains_on_batches_sampled_k_steps_back(in_toy_workdir):
    """K = 2. The checkpoint after 2 updates holds the batches of step indices 2 and 3. The batch of step 3 was
    sampled at step 1, after 1 update: its behaviour log-probs (the trainer's, taken then) and the sampler's are
    those of checkpoint step_1; it is trained at step 3, with the weights of step_3. Its prompts are step 3's, the
    ones a lag-0 run trains on at step 3."""
    run = run_script(grpo, SMALL + ["--total_steps", "5", "--save_steps", "1", "--rollout_lag", "2",
                                    "--run_name", "lag2"])
    assert [len(queue_of(run, s)) for s in (1, 2, 3, 4)] == [2, 2, 2, 1]  # nothing is sampled past the last step
    batch = queue_of(run, 2)[1]
    at_sampling, at_training = logprobs_at(run, 1, batch), logprobs_at(run, 3, batch)
    torch.testing.assert_close(batch["old_logp"] * batch["mask"], at_sampling, rtol=0, atol=1e-5)
    torch.testing.assert_close(batch["sampler_logp"] * batch["mask"], at_sampling, rtol=0, atol=1e-4)
    assert (at_training - at_sampling).abs().max() > 1e-3  # the weights moved twice since: the batch is stale

    with open(os.path.join(TOY, "train.jsonl")) as f:
        data = [json.loads(line) for line in f]
    _, rows = step_prompts(3, batch_size=16, num_generations=4, mini_batch_size=0, num_processes=1, process_index=0,
                           dataset_size=len(data), seed=1)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TOY, "model"))
    prompt_width = batch["input_ids"].shape[1] - batch["mask"].shape[1]
    prompts = tokenizer.batch_decode(batch["input_ids"][::4, :prompt_width], skip_special_tokens=True)
    assert prompts == [data[r]["prompt"] for r in rows]


@pytest.mark.slow
def test_rollout_lag_resumes_exactly(in_toy_workdir, monkeypatch):
    """Interrupted after the step-2 checkpoint, a K = 2 run resumes from the queue it saved and ends with the
    weights and metrics of a run that never stopped."""
    argv = SMALL + ["--total_steps", "6", "--save_steps", "2", "--rollout_lag", "2"]
    straight = run_script(grpo, argv + ["--run_name", "lag_straight"])
    # one compute_advantages call per step trained (the queue samples ahead, the loop computes advantages): step 3
    run_interrupted(argv + ["--run_name", "lag_interrupted"], monkeypatch, at_call=3)
    resumed = run_script(grpo, argv + ["--resume_from", os.path.join("runs", "lag_interrupted")])
    assert_same_weights(final_weights(straight, 6), final_weights(resumed, 6), atol=0)
    drop_times = lambda ms: [{k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))} for m in ms]  # noqa: E731
    assert drop_times(read_metrics(resumed)) == drop_times(read_metrics(straight))


@pytest.mark.slow
def test_rollout_lag_two_processes_match_one(in_toy_workdir):
    argv = SMALL + ["--micro_batch_size", "2", "--total_steps", "3", "--rollout_lag", "1", "--beta", "0.1"]
    for n in (1, 2):
        launch(in_toy_workdir, "snib.py", [*argv, "--run_name", f"lag_p{n}"], num_processes=n)
    m1, m2 = (read_metrics(os.path.join("runs", f"lag_p{n}")) for n in (1, 2))
    assert [m["reward/mean"] for m in m1] == [m["reward/mean"] for m in m2]  # the same batches at every step
    for a, b in zip(m1, m2):
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-4)
        assert a["rollout/logp_gap_mean"] < 1e-5 and b["rollout/logp_gap_mean"] < 1e-5


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_with_groups_that_carry_signal(in_toy_workdir):
    # the 0/1 reward: groups all right or all wrong carry no signal (the dense reward of SMALL rarely has any)
    run = run_script(snib, SMALL + ["--total_steps", "3", "--dynamic_sampling", "--reward_funcs", "toy_addition",
                                    "--run_name", "dapo"])
    for m in read_metrics(run):
        assert m["dynamic/prompts_sampled"] >= 4 and m["dynamic/groups_dropped"] >= 0
        if m["dynamic/unfilled_groups"] == 0:
            assert m["reward/frac_zero_std_groups"] == 0 and m["completion/removed_frac"] == 0
        else:  # slots left unfilled hold zero-std groups, and only those rows leave the loss
            assert m["completion/removed_frac"] == pytest.approx(m["dynamic/unfilled_groups"] / 4)
    assert sum(m["dynamic/groups_dropped"] for m in read_metrics(run)) > 0  # the toy has groups without signal


@pytest.mark.slow
def test_mask_truncated_overlong_and_sequence_mis_run_together(in_toy_workdir):
    """Completions cut at 2 tokens: every truncated row leaves the loss, the overlong term is a logged reward. The HF
    sampler runs the trainer's weights, so each kept row's sequence ratio rho_i is 1 (to float rounding): under the
    cap 2, sequence MIS masks none and the step trains; under the cap 0.5 it masks every kept row, which leaves no
    policy term (beta 0: no other), so the loss and gradient are 0 and the weights do not move."""
    flags = SMALL + ["--total_steps", "2", "--max_completion_length", "3", "--mask_truncated", "--overlong_buffer",
                     "2", "--overlong_penalty", "0.5", "--tis_mode", "sequence", "--mis", "--beta", "0"]
    for cap, masked in (("2", 0.0), ("0.5", 1.0)):
        run = run_script(grpo, flags + ["--tis_cap", cap, "--run_name", f"masks_{cap}"])
        for m in read_metrics(run):
            assert 0 < m["completion/truncated_frac"] < 1, m  # precondition: some rows are kept, some removed
            assert m["completion/removed_frac"] == m["completion/truncated_frac"]
            assert -0.5 <= m["reward/overlong/mean"] < 0  # truncated rows are at the limit: -0.5 each
            # precondition: |log rho_i| <= 3 tokens x 0.2 = 0.6 < log 2, so rho_i is inside (0.5, 2)
            assert m["rollout/logp_gap_max"] < 0.2, m
            assert m["rollout/is_masked_frac"] == masked, m
            assert (m["optim/grad_norm"] == 0) == (masked == 1.0), m
            if masked:
                assert m["loss/policy"] == 0, m
    initial = load_file(os.path.join(in_toy_workdir, "runs", "toy", "model", "model.safetensors"))
    assert_same_weights(final_weights(os.path.join("runs", "masks_0.5"), 2), initial, atol=0)
    moved = final_weights(os.path.join("runs", "masks_2"), 2)
    assert any(not torch.equal(moved[name], initial[name]) for name in initial), "the unmasked run did not train"


def test_a_lagged_checkpoint_resumed_under_another_process_count_is_refused_in_one_line(in_toy_workdir):
    """At --rollout_lag 1 each process saves the batch it sampled ahead, its own rows. Resumed by 2 processes, the
    1-process checkpoint of step 2 is refused before any weights load, naming the count to use (it aborted in a
    gloo collective before)."""
    argv = SMALL + ["--total_steps", "4", "--save_steps", "2", "--micro_batch_size", "2", "--rollout_lag", "1"]
    run_script(grpo, argv + ["--run_name", "lag1_one"])
    run = os.path.join(in_toy_workdir, "runs", "lag1_one")
    shutil.rmtree(os.path.join(run, "checkpoints", "step_4"))  # as if stopped after step 2's checkpoint
    assert "rollout_queue_0.pt" in os.listdir(os.path.join(run, "checkpoints", "step_2", "state"))  # precondition
    with pytest.raises(AssertionError) as e:
        launch(in_toy_workdir, "grpo.py", argv + ["--resume_from", run], num_processes=2)
    assert ("holds the batches sampled ahead of it (--rollout_lag) by 1 process, and this run has 2: resume with 1 "
            "(accelerate launch --num_processes 1)") in str(e.value), str(e.value)[-3000:]
    assert f'File "{REPO}' not in str(e.value)  # no traceback of ours (accelerate's launcher prints its own)


# IcePop's mask against prime-rl's: its double-sided ratio mask (PR #1101 "Double sided masking", after the IcePop
# blog), verbatim: PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/loss.py `compute_loss` at commit
# 3147f5fed32d1541e64b6f292a7144d4771149e3 (main, 2025-12-18), whose `LossConfig` (trainer/rl/config.py) has
# `ratio_type` token | sequence, `mask_ratio_low` 0.125, `mask_ratio_high` 8.0 and `sequence_mask_ratio_low` 0 (off).
# Its return annotation `Float[Tensor, ""]` (jaxtyping) is written `Tensor`; `LossConfig` is the config's class there.
# prime-rl's later `IcePopLoss` (PR #3526, defaults 0.2 / 5.0) tests the same band in log space, per token only.

from typing import Any  # noqa: E402

from torch import Tensor  # noqa: E402

LossConfig = types.SimpleNamespace


def compute_loss(
    trainer_logprobs: Any,  # list of Float[Tensor, "seq_i"] with potentially different seq_i lengths
    inference_logprobs: Any,  # list of Float[Tensor, "seq_i"] with potentially different seq_i lengths
    advantages: Any,  # list of Float[Tensor, "seq_i"] with potentially different seq_i lengths
    loss_mask: Any,  # list of Bool[Tensor, "seq_i"] with potentially different seq_i lengths
    loss_config: LossConfig,
    loss_scale: int,
) -> tuple[Tensor, dict[str, Any]]:
    """
    Compute loss for packed sequences (batch size = 1, multiple sequences packed along sequence dimension).

    Args:
        trainer_logprobs: Log probabilities tensor for packed sequences
        inference_logprobs: Old log probabilities tensor for packed sequences
        advantages: Advantages tensor for packed sequences
        loss_mask: Loss mask tensor for packed sequences
        loss_config: Loss configuration object
        loss_scale: Scale factor to normalize the loss

    Returns:
        Tuple of (scaled_loss, aggregated_loss_tensors)
    """

    total_loss = 0
    total_mismatch_kl = []
    total_masked_mismatch_kl = []
    total_unmasked_mismatch_kl = []
    total_is_masked = []
    total_is_masked_low = []
    total_is_masked_high = []
    total_sequence_masked_low = []

    for trainer_logprobs, inference_logprobs, advantages, loss_mask in zip(
        trainer_logprobs, inference_logprobs, advantages, loss_mask
    ):
        log_importance_ratio = trainer_logprobs - inference_logprobs

        # Compute trainer-inference mismatch KL
        token_mismatch_kl = torch.exp(log_importance_ratio) - log_importance_ratio - 1

        if loss_config.ratio_type == "sequence":
            seq_log_importance_ratio = (log_importance_ratio[loss_mask]).sum()
            log_importance_ratio = trainer_logprobs - trainer_logprobs.detach() + seq_log_importance_ratio.detach()
            log_importance_ratio = torch.clamp(log_importance_ratio, max=10.0)

        importance_ratio = torch.exp(log_importance_ratio)
        is_masked_low = importance_ratio < loss_config.mask_ratio_low
        is_masked_high = importance_ratio > loss_config.mask_ratio_high
        is_masked = is_masked_low | is_masked_high
        seq_min_ratio = importance_ratio.masked_fill(~loss_mask, torch.inf).min()
        seq_should_mask = seq_min_ratio < loss_config.sequence_mask_ratio_low
        is_masked = is_masked | seq_should_mask
        keep_mask = loss_mask & ~is_masked
        loss = (-importance_ratio * advantages)[keep_mask].sum()
        if loss_config.kl_mask_type == "masked":
            kl_mask = loss_mask & is_masked
        elif loss_config.kl_mask_type == "unmasked":
            kl_mask = keep_mask
        elif loss_config.kl_mask_type == "all":
            kl_mask = loss_mask
        else:
            raise ValueError(f"Invalid KL mask type: {loss_config.kl_mask_type}")
        loss = loss + loss_config.kl_tau * (log_importance_ratio[kl_mask]).sum()

        # Apply sequence-level normalization if configured
        if loss_config.ratio_type == "sequence":
            loss = loss / torch.clamp_min(loss_mask.sum(), 1)

        total_loss = total_loss + loss

        mismatch_kl = token_mismatch_kl[loss_mask].sum() / torch.clamp_min(loss_mask.sum(), 1)
        masked_mismatch_kl = token_mismatch_kl[loss_mask & is_masked].sum() / torch.clamp_min(
            (loss_mask & is_masked).sum(), 1
        )
        unmasked_mismatch_kl = token_mismatch_kl[keep_mask].sum() / torch.clamp_min(keep_mask.sum(), 1)

        # Aggregate loss tensors
        total_mismatch_kl.append(mismatch_kl)
        total_masked_mismatch_kl.append(masked_mismatch_kl)
        total_unmasked_mismatch_kl.append(unmasked_mismatch_kl)
        total_is_masked.append(is_masked[loss_mask].float())
        total_is_masked_low.append(is_masked_low[loss_mask].float())
        total_is_masked_high.append(is_masked_high[loss_mask].float())
        total_sequence_masked_low.append(seq_should_mask.float())

    # Apply loss scaling
    scaled_loss = total_loss / loss_scale

    return scaled_loss, {
        "mismatch_kl": torch.stack(total_mismatch_kl),
        "masked_mismatch_kl": torch.stack(total_masked_mismatch_kl),
        "unmasked_mismatch_kl": torch.stack(total_unmasked_mismatch_kl),
        "is_masked": torch.cat(total_is_masked),
        "is_masked_low": torch.cat(total_is_masked_low),
        "is_masked_high": torch.cat(total_is_masked_high),
        "sequence_masked_low": torch.stack(total_sequence_masked_low),
    }


# (end of the verbatim copy)


def prime_rl_weights(old_logp, sampler_logp, mask, low, high, ratio_type):
    """prime-rl's accepted weights and mask on our rows: trainer_logprobs = old_logp (pi_train at the weights that
    sampled), inference_logprobs = sampler_logp; advantages 1 on every token and loss_scale 1, so the gradient of
    its loss with respect to trainer_logprobs is minus each kept token's importance ratio (0 where masked; per
    sequence, over the row's length)."""
    config = types.SimpleNamespace(ratio_type=ratio_type, mask_ratio_low=low, mask_ratio_high=high,
                                   sequence_mask_ratio_low=0.0, kl_tau=0.0, kl_mask_type="all")
    trainer = old_logp.clone().requires_grad_()
    rows = range(old_logp.shape[0])
    loss, metrics = compute_loss([trainer[i] for i in rows], [sampler_logp[i] for i in rows],
                                 [torch.ones_like(old_logp[i]) for i in rows], [mask[i].bool() for i in rows],
                                 config, 1)
    (grad,) = torch.autograd.grad(loss, trainer)
    if ratio_type == "sequence":  # prime-rl then divides each row's loss by its length: undone here
        grad = grad * mask.sum(-1, keepdim=True)
    return -grad, metrics["is_masked"]


def mismatch_batch(seed=0, B=6, T=7):
    """float64 log-probs with right padding, a removed row (4), ratios spread over [e^-3, e^3] and two extremes."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3  # (B, T)
    sampler = old + torch.randn(B, T, generator=gen, dtype=torch.float64)  # (B, T)
    sampler[0, 0], sampler[2, 1] = old[0, 0] + 40.0, old[2, 1] - 40.0  # ratios e^-40 and e^40
    lengths = torch.tensor([7, 3, 5, 1, 0, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    sampler = torch.where(mask > 0, sampler, torch.full_like(sampler, 9.0))  # garbage on padding
    return old, sampler, mask


@pytest.mark.peer
@pytest.mark.parametrize("low, high", [(0.125, 8.0), (0.5, 5.0), (0.2, 5.0)])
def test_icepop_token_mask_and_weights_equal_prime_rls(low, high):
    """Per token: prime-rl's band (its default, the Ring-1T report's, PR #3526's) and ours keep the same tokens with
    the same weights, rho_t inside [floor, cap], 0 outside, and the same masked fraction."""
    old, sampler, mask = mismatch_batch()
    ours, frac = importance_weights(old, sampler, mask, cap=high, mode="token", masked=True, floor=low)
    theirs, is_masked = prime_rl_weights(old, sampler, mask, low, high, "token")
    torch.testing.assert_close(ours, theirs * mask, rtol=1e-12, atol=0)
    assert frac == pytest.approx(is_masked.mean().item(), rel=1e-12)
    assert 0 < frac < 1 and (ours[mask > 0] == 0).sum() == is_masked.sum()


@pytest.mark.peer
@pytest.mark.parametrize("low, high", [(0.125, 8.0), (0.5, 5.0)])
def test_icepop_sequence_mask_and_weights_equal_prime_rls(low, high):
    """Per sequence (prime-rl's ratio_type sequence): rho_i = prod_t rho_t on every token of the row, the row kept
    inside [floor, cap]. prime-rl clamps log rho_i at 10; every row above e^10 is above the cap too."""
    old, sampler, mask = mismatch_batch(seed=1)
    sampler = old + (sampler - old) * 0.3  # (B, T)  rows near 1 as well as far from it
    ours, frac = importance_weights(old, sampler, mask, cap=high, mode="sequence", masked=True, floor=low)
    theirs, _ = prime_rl_weights(old, sampler, mask, low, high, "sequence")
    torch.testing.assert_close(ours, theirs * mask, rtol=1e-12, atol=0)
    rows = mask.sum(-1) > 0
    kept = (ours.sum(-1) > 0)[rows]
    assert frac == pytest.approx(1 - kept.float().mean().item()) and 0 < frac < 1


def test_icepop_by_hand():
    """Token ratios 0.3, 0.5, 1, 5, 6 under [0.5, 5]: the bounds are inside (M(k) = k on [alpha, beta]), 0.3 and 6
    masked; the floor 0 is plain MIS (0.3 kept); TIS ignores no ratio and caps 6 at 5. Per sequence the product 4.5
    is kept, a row of product 0.45 masked."""
    ratios = torch.tensor([[0.3, 0.5, 1.0, 5.0, 6.0]], dtype=torch.float64)
    old, mask = torch.zeros(1, 5, dtype=torch.float64), torch.ones(1, 5)
    sampler = -ratios.log()  # (1, 5)  rho = exp(old - sampler)
    weights, frac = importance_weights(old, sampler, mask, 5.0, "token", masked=True, floor=0.5)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.5, 1.0, 5.0, 0.0]], dtype=torch.float64))
    assert frac == pytest.approx(0.4)
    weights, frac = importance_weights(old, sampler, mask, 5.0, "token", masked=True, floor=0.0)
    torch.testing.assert_close(weights, torch.tensor([[0.3, 0.5, 1.0, 5.0, 0.0]], dtype=torch.float64))
    assert frac == pytest.approx(0.2)
    weights, _ = importance_weights(old, sampler, mask, 5.0, "token", masked=False, floor=0.5)
    torch.testing.assert_close(weights, torch.tensor([[0.3, 0.5, 1.0, 5.0, 5.0]], dtype=torch.float64))
    rows = torch.tensor([[3.0, 1.5, 1.0], [0.9, 0.5, 1.0]], dtype=torch.float64)  # products 4.5 and 0.45
    lengths = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the second row's third token is padding
    weights, frac = importance_weights(torch.zeros(2, 3, dtype=torch.float64), -rows.log(), lengths, 5.0,
                                       "sequence", masked=True, floor=0.5)
    torch.testing.assert_close(weights, torch.tensor([[4.5, 4.5, 4.5], [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert frac == 0.5


@pytest.mark.slow
def test_icepop_runs_and_masks_both_sides(in_toy_workdir, monkeypatch):
    """A 2-step toy run with a band so tight around 1 (the HF sampler and the trainer differ by ~1e-6 in log-prob)
    that tokens fall out on both sides; without the floor, only those above the cap."""
    fracs = {}
    for floor in ("0", "0.9999999"):
        run = run_script(grpo, ["--preset", "toy", "--total_steps", "2", "--eval_steps", "0", "--tis_cap",
                                "1.0000001", "--mis", "--tis_floor", floor, "--run_name", f"icepop_{floor}"])
        fracs[floor] = [m["rollout/is_masked_frac"] for m in read_metrics(run)]
    assert all(0 < f < 1 for f in fracs["0"]), fracs
    assert all(a > b for a, b in zip(fracs["0.9999999"], fracs["0"])), fracs
