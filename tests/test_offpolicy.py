"""End-to-end runs of the off-policy options on the toy (CPU): rollout lag against the weights that sampled each batch,
exact resume and 2-process invariance with a lag, dynamic sampling, truncation masks and IS corrections."""

import json
import os
import shutil

import pytest
import torch
from conftest import launch, read_metrics, run_script
from safetensors.torch import load_file
from test_train import REPO, SMALL, assert_same_weights, final_weights, run_interrupted
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
import snib
from common.logprobs import completion_logprobs
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
