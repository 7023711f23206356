"""sdpo.compute_loss by hand and against TRL 1.16's own SDPOTrainer.compute_loss (trl.experimental.sdpo), the
re-prompting of each row from its group (sdpo.demonstrations, sdpo.teacher_contexts), then end-to-end runs."""

import dataclasses
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import REPO, learning_bar, read_metrics, run_script
from peers import trl_sdpo_loss, trl_sdpo_reprompts
from test_snib import STALE, assert_stale_updates_agree

import grpo
import sdpo
from common.sampling import Rollouts, to_tensors
from common.tasks.toy import build_tokenizer

ARGS = sdpo.Args(num_generations=2)
# The toy's vocabulary is digits, + and =: its re-prompt is the demonstration and the question again
TOY = ["--reprompt_template", "{prompt}{solution}={prompt}", "--solution_template", "{successful_previous_attempt}"]


def test_defaults_and_the_flags_are_sdpos_own():
    args = sdpo.Args()
    assert (args.beta, args.epsilon, args.epsilon_high) == (0.0, 0.2, 0.2)
    assert (args.distillation_weight, args.teacher, args.teacher_update_rate, args.distillation_is_clip) == (
        1.0, "ema", 0.05, 2.0)
    assert (args.success_threshold, args.dont_reprompt_on_self_success) == (1.0, True)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(sdpo.Args)} - shared == {
        "beta", "epsilon", "epsilon_high", "distillation_weight", "teacher", "teacher_update_rate",
        "distillation_is_clip", "success_threshold", "dont_reprompt_on_self_success", "reprompt_template",
        "solution_template", "feedback_column", "feedback_template", "environment_feedback_only_without_solution"}


def test_the_toy_preset_re_prompts_in_the_toys_vocabulary():
    """--preset toy gives sdpo.py templates of digits, + and = (TRL's English would be unknown tokens); a script
    without these flags takes the preset's other values and none of these."""
    from common.args import parse_args

    args = parse_args(sdpo.Args, ["--preset", "toy"])
    assert (args.reprompt_template, args.solution_template) == ("{prompt}{solution}{feedback}={prompt}",
                                                                "{successful_previous_attempt}")
    assert parse_args(grpo.Args, ["--preset", "toy"]).reward_funcs == "toy_addition"


@pytest.mark.peer
def test_the_defaults_are_trls():
    """TRL 1.16's SDPOConfig defaults, field by field (its names on the right)."""
    from trl.experimental.sdpo import SDPOConfig

    trl = {f.name: f.default for f in dataclasses.fields(SDPOConfig)}
    args = sdpo.Args()
    pairs = {"distillation_weight": "distillation_weight", "teacher": "teacher_model_kind",
             "teacher_update_rate": "teacher_update_rate", "distillation_is_clip": "distillation_is_clip",
             "success_threshold": "success_reward_threshold",
             "dont_reprompt_on_self_success": "dont_reprompt_on_self_success",
             "reprompt_template": "reprompt_template", "solution_template": "solution_template",
             "feedback_template": "feedback_template",
             "environment_feedback_only_without_solution": "environment_feedback_only_without_solution",
             "beta": "beta", "epsilon": "epsilon"}
    assert {ours: getattr(args, ours) for ours in pairs} == {ours: trl[theirs] for ours, theirs in pairs.items()}
    assert trl["distillation_mode"] == "sampled_token" and trl["distillation_alpha"] == 1.0  # the reverse KL
    assert (args.feedback_column, trl["include_environment_feedback"]) == ("", False)  # no feedback text


def test_zscore_advantages_are_grpos():
    rewards = torch.tensor([1.0, 0, 0, 0, 3, 3, 3, 3])
    A = sdpo.compute_advantages(rewards, replace(ARGS, num_generations=4))
    torch.testing.assert_close(A, grpo.compute_advantages(rewards, grpo.Args(num_generations=4)))


def hand_batch():
    """Three rows, T = 2: row 1's second token is padding, row 2 has no demonstration (mask' 0). Old log-probs put
    token (0, 0)'s ratio at 3 (its IS weight clipped to 2) and token (0, 1)'s at 0.5; the others are on-policy."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0], [-0.3, -0.2]], dtype=torch.float64, requires_grad=True)
    log3, log2 = torch.log(torch.tensor(3.0, dtype=torch.float64)), torch.log(torch.tensor(2.0, dtype=torch.float64))
    old = logp.detach() - torch.tensor([[log3, -log2], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    teacher = torch.tensor([[-1.5, -1.5], [-0.7, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    distill_mask = mask * torch.tensor([1, 1, 0])[:, None]
    return logp, old, teacher, mask, distill_mask


def test_distillation_loss_and_gradient_by_hand():
    """lam = 1, is_clip 2. gap = logp - q: row 0 (0.5, -0.5), row 1 (0.2); w: 2 (3 clipped), 0.5, 1.
    d = w gap logp: row 0 (2 * 0.5 * -1, 0.5 * -0.5 * -2) = (-1, 0.5), mean -0.25; row 1: 0.2 * -0.5 = -0.1; row 2
    has no demonstration: 0, counted in B = 3. L = (-0.25 - 0.1 + 0) / 3. The gradient is (1/B)(1/L'_i) w gap:
    (1/3)(1/2)(2)(0.5) = 1/6, (1/3)(1/2)(0.5)(-0.5) = -1/24, (1/3)(0.2) = 1/15, and 0 on row 2 and padding."""
    logp, old, teacher, mask, distill_mask = hand_batch()
    A = torch.tensor([1.0, -1.0, 0.2], dtype=torch.float64)
    loss, metrics = sdpo.compute_loss(logp, old, None, A, mask, ARGS, teacher_logp=teacher, distill_mask=distill_mask)
    assert loss.item() == pytest.approx(-0.35 / 3, rel=1e-12)
    assert metrics["sdpo/distill_loss"].item() == pytest.approx(-0.35 / 3, rel=1e-12)
    assert metrics["sdpo/teacher_gap"].item() == pytest.approx((0.5 - 0.5 + 0.2) / 3, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[1 / 6, -1 / 24], [1 / 15, 0.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_the_mix_with_grpos_term_by_hand():
    """lam = 0.5 on the same batch, A = (1, -1, 0.2). GRPO's s_t: row 0 min(3, 1.2) = 1.2 (clipped: no gradient) and
    min(0.5, 0.8) = 0.5, mean 0.85; row 1 -1; row 2 0.2; L_grpo = -(0.85 - 1 + 0.2) / 3 = -0.05 / 3, whose gradient
    is -(1/3)(1/L_i) r A: (0, -1/12), (1/3), (-1/30, -1/30). L = (L_grpo + L_sd) / 2, and half of each gradient."""
    logp, old, teacher, mask, distill_mask = hand_batch()
    A = torch.tensor([1.0, -1.0, 0.2], dtype=torch.float64)
    args = replace(ARGS, distillation_weight=0.5)
    loss, _ = sdpo.compute_loss(logp, old, None, A, mask, args, teacher_logp=teacher, distill_mask=distill_mask)
    assert loss.item() == pytest.approx(0.5 * (-0.05 / 3) + 0.5 * (-0.35 / 3), rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = 0.5 * torch.tensor([[0.0, -1 / 12], [1 / 3, 0.0], [-1 / 30, -1 / 30]], dtype=torch.float64) + \
        0.5 * torch.tensor([[1 / 6, -1 / 24], [1 / 15, 0.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    # lam = 0 is grpo.py's loss to the bit, beta 0 as sdpo's default
    lam0, _ = sdpo.compute_loss(logp, old, None, A, mask, replace(ARGS, distillation_weight=0.0),
                                teacher_logp=teacher, distill_mask=distill_mask)
    ours, _ = grpo.compute_loss(logp, old, None, A, mask, grpo.Args(num_generations=2, beta=0.0))
    assert lam0.item() == ours.item()


def test_without_the_is_clip_and_on_policy_the_weight_is_one():
    """--distillation_is_clip 0: no weight; on-policy (old = logp) the clipped weight is exp(0) = 1: the same loss."""
    logp, _, teacher, mask, distill_mask = hand_batch()
    A = torch.zeros(3, dtype=torch.float64)
    on_policy, _ = sdpo.compute_loss(logp, logp.detach(), None, A, mask, ARGS, teacher_logp=teacher,
                                     distill_mask=distill_mask)
    unclipped, _ = sdpo.compute_loss(logp, logp.detach() + 5.0, None, A, mask, replace(ARGS, distillation_is_clip=0.0),
                                     teacher_logp=teacher, distill_mask=distill_mask)
    gaps = logp.detach() - teacher
    expected = ((gaps[0] * logp.detach()[0]).mean() + gaps[1, 0] * logp.detach()[1, 0]) / 3
    assert on_policy.item() == pytest.approx(expected.item(), rel=1e-12)
    assert unclipped.item() == pytest.approx(expected.item(), rel=1e-12)


def ragged_batch(seed=0, B=8, T=5, V=7):
    """Logits of a student and a teacher over a vocabulary of V, sampled tokens, right-padded rows of unequal lengths,
    stale old log-probs (some IS weights above 2), and rows without a demonstration."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=gen, dtype=torch.float64).requires_grad_()
    teacher = student.detach() + torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 3, 1])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T)
    ids = ids * mask  # padding is token 0, as a pad id would be
    logp = torch.log_softmax(student, -1).gather(-1, ids[..., None]).squeeze(-1)  # (B, T) with the gradient
    q = torch.log_softmax(teacher, -1).gather(-1, ids[..., None]).squeeze(-1)
    old = logp.detach() + 0.8 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    reprompted = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1])
    A = sdpo.compute_advantages(torch.rand(B, generator=gen, dtype=torch.float64), replace(ARGS, num_generations=4))
    return student, teacher, ids, mask, logp, q, old, reprompted, A


@pytest.mark.peer
@pytest.mark.parametrize("distillation_weight", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("is_clip", [2.0, None])
@pytest.mark.parametrize("stale", [True, False])
def test_equals_trls_sdpo_loss_and_gradient(distillation_weight, is_clip, stale):
    """TRL's sampled-token mode (its only reverse-KL mode, and sdpo.py's), its policy term's loss_type "grpo" (grpo.py's
    aggregation); the gradient with respect to the student's logits. On-policy TRL passes no old log-probs (no IS
    weight); sdpo.py's weight is then exp(0) = 1."""
    student, teacher, ids, mask, logp, q, old, reprompted, A = ragged_batch()
    old = old if stale else logp.detach()
    args = replace(ARGS, num_generations=4, distillation_weight=distillation_weight,
                   distillation_is_clip=0.0 if is_clip is None else is_clip)
    ours, _ = sdpo.compute_loss(logp, old, None, A, mask, args, teacher_logp=q, distill_mask=mask * reprompted[:, None])
    theirs = trl_sdpo_loss(student, teacher, ids, mask, old if stale else None, A, reprompted.double(),
                           distillation_weight, is_clip)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12, abs=1e-15)
    (ours_grad,) = torch.autograd.grad(ours, student, retain_graph=True)
    torch.testing.assert_close(ours_grad, torch.autograd.grad(theirs, student)[0], rtol=1e-10, atol=1e-14)
    if stale and is_clip:
        assert ((torch.exp(logp - old) > is_clip) & (mask > 0)).any()  # the clip is reached: the comparison covers it


def test_micro_batches_sum_to_the_full_batch_loss_and_gradient():
    _, _, _, mask, logp, q, old, reprompted, A = ragged_batch(seed=1)
    args = replace(ARGS, num_generations=4, distillation_weight=0.5)
    distill_mask = mask * reprompted[:, None]
    loss, _ = sdpo.compute_loss(logp, old, None, A, mask, args, teacher_logp=q, distill_mask=distill_mask)
    (full_grad,) = torch.autograd.grad(loss, logp, retain_graph=True)
    stats = sdpo.batch_stats(A, mask, args)
    micro = sum(sdpo.compute_loss(logp[s], old[s], None, A[s], mask[s], args, stats=stats, teacher_logp=q[s],
                                  distill_mask=distill_mask[s])[0] for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_tis_weights_scale_the_policy_term_only():
    """The sampler/trainer weights multiply GRPO's term, never the distillation term (a KL-like term)."""
    _, _, _, mask, logp, q, old, reprompted, A = ragged_batch(seed=2)
    distill_mask = mask * reprompted[:, None]
    tis = torch.full(mask.shape, 0.5, dtype=torch.float64) * mask
    for lam in (1.0, 0.5):
        args = replace(ARGS, num_generations=4, distillation_weight=lam)
        with_tis, _ = sdpo.compute_loss(logp, old, None, A, mask, args, tis_weights=tis, teacher_logp=q,
                                        distill_mask=distill_mask)
        halved, _ = sdpo.compute_loss(logp, old, None, A / 2, mask, args, teacher_logp=q, distill_mask=distill_mask)
        assert with_tis.item() == pytest.approx(halved.item(), rel=1e-12)  # min(r A, clip A) / 2 = that of A / 2


# Re-prompting from the batch


def test_each_rows_demonstration_is_the_first_other_success_of_its_group():
    """G = 4. Group 0: rows 0 and 3 succeed; row 0's demonstration is row 3 (not itself), the others' row 0. Group 1:
    no success, no demonstration. Group 2: only row 8 succeeds: it has none (dont_reprompt_on_self_success), its
    siblings have row 8. Without the switch a success is its own demonstration (TRL's rule both ways)."""
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 0.5, 0, 0])
    args = replace(ARGS, num_generations=4)
    assert sdpo.demonstrations(rewards, args) == [3, 0, 0, 0, None, None, None, None, None, 8, 8, 8]
    assert sdpo.demonstrations(rewards, replace(args, dont_reprompt_on_self_success=False)) == [
        0, 0, 0, 0, None, None, None, None, 8, 8, 8, 8]
    assert sdpo.demonstrations(rewards, replace(args, success_threshold=0.5))[8:] == [9, 8, 8, 8]


def toy_batch(tokenizer, G=2):
    """Two groups of the toy: "12+34=" (row 0 right, "46"; row 1 wrong, "4") and "5+5=" (both wrong)."""
    prompts = ["12+34=", "5+5="]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(G)]
    eos = tokenizer.eos_token_id
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in ["46", "4", "11", "9"]]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rollouts = Rollouts(prompt_ids, completions, [[0.0] * len(c) for c in completions], rewards, {"acc": rewards},
                        torch.zeros(4, dtype=torch.bool), [[1] * len(c) for c in completions])
    batch = to_tensors(rollouts, torch.zeros(4, dtype=torch.bool), tokenizer.pad_token_id)
    rows = {"prompt": prompts, "prompt_ids": [prompt_ids[0], prompt_ids[2]]}
    return batch, rows


def on_one_process(args, kind=DistributedType.NO):
    """A stand-in run of `args` on one process (`kind`: what accelerate says it is)."""
    return SimpleNamespace(args=args, accelerator=SimpleNamespace(distributed_type=kind, is_fsdp2=False))


def contexts(monkeypatch, tokenizer, rows, batch, **flags):
    """sdpo.teacher_contexts on a stand-in run whose step's prompts are `rows`."""
    monkeypatch.setattr(sdpo, "round_prompts", lambda run, step, r: (rows, None, None))
    flags = {"reprompt_template": "{prompt}{solution}={prompt}", "solution_template": "{successful_previous_attempt}",
             **flags}
    args = sdpo.Args(num_generations=2, prompt_template="{prompt}", **flags)
    metrics = {}
    context = sdpo.teacher_contexts(SimpleNamespace(args=args, tokenizer=tokenizer), 0, batch, metrics)
    return context, metrics


def decoded(tokenizer, context, T):
    """Each teacher row as text: its context, then its completion."""
    return [(tokenizer.decode(ids[:-T][att[:-T].bool()]), tokenizer.decode(ids[-T:][att[-T:].bool()]))
            for ids, att in zip(context.input_ids, context.attention_mask)]


@pytest.mark.parametrize("chat", [True, False])
def test_the_teacher_sees_a_siblings_success_or_the_prompt(monkeypatch, chat):
    """Row 1 (wrong) is re-prompted with row 0's "46"; row 0 (the group's only success) is not re-prompted with
    itself; group 1 has no success. The completions are the rows' own, column for column; mask' is the mask on row
    1 alone. The toy's chat template writes a user turn as it is, so both formats give the same text."""
    tokenizer = build_tokenizer() if chat else build_tokenizer(chat_template=None)
    batch, rows = toy_batch(tokenizer)
    T = batch.mask.shape[1]
    context, metrics = contexts(monkeypatch, tokenizer, rows, batch)
    assert decoded(tokenizer, context, T) == [("12+34=", "46<eos>"), ("12+34=46=12+34=", "4<eos>"),
                                              ("5+5=", "11<eos>"), ("5+5=", "9<eos>")]
    assert torch.equal(context.input_ids[:, -T:], batch.input_ids[:, -T:])
    assert torch.equal(context.mask, batch.mask * torch.tensor([0, 1, 0, 0])[:, None])
    assert metrics["sdpo/reprompted_frac"] == 0.25
    # without dont_reprompt_on_self_success, the success is its own demonstration
    context, _ = contexts(monkeypatch, tokenizer, rows, batch, dont_reprompt_on_self_success=False)
    assert decoded(tokenizer, context, T)[0] == ("12+34=46=12+34=", "46<eos>")
    assert torch.equal(context.mask, batch.mask * torch.tensor([1, 1, 0, 0])[:, None])


def test_a_micro_batch_without_a_reprompted_row_takes_no_teacher_forward(monkeypatch):
    """Group 1 of the toy batch has no success, so none of its rows is re-prompted: the teacher is not run on them,
    and their distillation term is 0 whatever log-probs stand in (the loss and gradient are those with the teacher's
    own). Group 0's row 1 is re-prompted, and the teacher runs on group 0."""
    tokenizer = build_tokenizer()
    batch, rows = toy_batch(tokenizer)
    context, _ = contexts(monkeypatch, tokenizer, rows, batch)
    calls = []

    def teacher_forward(model, input_ids, *args, **kwargs):
        calls.append(len(input_ids))
        return torch.full(input_ids[:, -batch.mask.shape[1]:].shape, -1.5), None

    monkeypatch.setattr(sdpo, "completion_logprobs", teacher_forward)
    args, metrics = replace(ARGS, distillation_weight=0.5), {}
    skipped = sdpo.self_teacher(None, context, torch.tensor([2, 3]), on_one_process(args), metrics)
    assert calls == [] and "time/teacher" not in metrics
    run = on_one_process(args)
    assert sdpo.self_teacher(None, context, torch.tensor([0, 1]), run, metrics).shape == (2, batch.mask.shape[1])
    assert calls == [2]
    # sharded weights: every forward is a collective, so every micro-batch takes one
    sdpo.self_teacher(None, context, torch.tensor([2, 3]), on_one_process(args, DistributedType.FSDP), metrics)
    assert calls == [2, 2]
    teacher_logp = torch.full_like(skipped, -1.5)  # what the forward would have given
    T = batch.mask.shape[1]
    mask = batch.mask[2:].float()
    losses = []
    for stand_in in (skipped, teacher_logp):
        logp = torch.linspace(-2.0, -0.1, 2 * T).view(2, T).requires_grad_()
        loss, _ = sdpo.compute_loss(logp, logp.detach() - 0.1, None, torch.tensor([0.5, -0.5]), mask, args,
                                    teacher_logp=stand_in, distill_mask=context.mask[2:])
        loss.backward()
        losses.append((loss.detach(), logp.grad))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])


FEEDBACK = {"none": None, "both": ["carry the one", "the sum of 5 and 5 has two digits"],
            "second": ["   ", "the sum of 5 and 5 has two digits"], "first": ["carry the one", None]}


@pytest.mark.peer
@pytest.mark.parametrize("feedback", list(FEEDBACK))
@pytest.mark.parametrize("only_without", [False, True])
@pytest.mark.parametrize("rewards", [[1.0, 0, 0, 0], [1.0, 1, 0, 1]])
@pytest.mark.parametrize("conversational", [False, True])
def test_the_reprompts_are_trls(monkeypatch, feedback, only_without, rewards, conversational):
    """Each row's teacher message and whether it is re-prompted, against TRL 1.16's own
    SuccessfulRolloutTeacherContextBuilder.build: demonstrations, feedback text (TRL's privileged_context column,
    blank or missing text none), --environment_feedback_only_without_solution, text and conversational prompts."""
    tokenizer = build_tokenizer()
    batch, rows = toy_batch(tokenizer)
    batch = replace(batch, rewards=torch.tensor(rewards))
    if conversational:
        rows = {**rows, "prompt": [[{"role": "user", "content": p}] for p in rows["prompt"]]}
    flags = {"environment_feedback_only_without_solution": only_without}
    if FEEDBACK[feedback] is not None:
        rows = {**rows, "privileged_context": FEEDBACK[feedback]}
        flags["feedback_column"] = "privileged_context"
    seen = []  # what sdpo.py formats for each re-prompted row
    format_prompt = sdpo.format_prompt

    def record(tokenizer, prompt, *rest):
        seen.append(prompt)
        return format_prompt(tokenizer, prompt, *rest)

    monkeypatch.setattr(sdpo, "format_prompt", record)
    context, metrics = contexts(monkeypatch, tokenizer, rows, batch, **flags, reprompt_template=TRL_TEMPLATE)
    ours = context.mask.amax(-1)  # (B,)  mask' on a row: it is re-prompted
    T = batch.mask.shape[1]
    per_row = [x for x in rows["prompt"] for _ in range(2)]
    feedbacks = None if FEEDBACK[feedback] is None else [x for x in FEEDBACK[feedback] for _ in range(2)]
    messages, theirs = trl_sdpo_reprompts(
        tokenizer, per_row, batch.input_ids[:, -T:], batch.rewards, feedbacks, 2, reprompt_template=TRL_TEMPLATE,
        solution_template="{successful_previous_attempt}", include_environment_feedback=feedbacks is not None,
        environment_feedback_only_without_solution=only_without)
    assert ours.tolist() == theirs.long().tolist()
    assert seen == [m for m, on in zip(messages, theirs.tolist()) if on]
    told = [f is not None and f.strip() != "" and not (only_without and d is not None) for f, d in zip(
        feedbacks or [None] * 4, sdpo.demonstrations(batch.rewards, replace(ARGS, num_generations=2)))]
    assert metrics["sdpo/feedback_frac"] == sum(told) / 4


TRL_TEMPLATE = "{prompt}{solution}{feedback}=Correctly solve the original question."


def test_a_prompts_feedback_text_reprompts_its_rows(monkeypatch):
    """Group 1 ("5+5=") has no success but feedback "10": both its rows are re-prompted with it; group 0's row 1 gets
    its demonstration and the feedback "4"; row 0, the only success, has no demonstration and is re-prompted with the
    feedback alone. --environment_feedback_only_without_solution takes the feedback off row 1 only."""
    tokenizer = build_tokenizer()
    batch, rows = toy_batch(tokenizer)
    rows = {**rows, "hint": ["4", "10"]}
    flags = dict(feedback_column="hint", feedback_template="{feedback_raw}",
                 reprompt_template="{prompt}{solution}{feedback}={prompt}")
    T = batch.mask.shape[1]
    context, metrics = contexts(monkeypatch, tokenizer, rows, batch, **flags)
    assert [c for c, _ in decoded(tokenizer, context, T)] == ["12+34=4=12+34=", "12+34=464=12+34=", "5+5=10=5+5=",
                                                              "5+5=10=5+5="]
    assert torch.equal(context.mask, batch.mask) and metrics["sdpo/feedback_frac"] == 1.0
    context, metrics = contexts(monkeypatch, tokenizer, rows, batch, **flags,
                                environment_feedback_only_without_solution=True)
    assert [c for c, _ in decoded(tokenizer, context, T)][:2] == ["12+34=4=12+34=", "12+34=46=12+34="]
    assert metrics["sdpo/feedback_frac"] == 0.75


def test_a_feedback_column_the_data_lacks_is_refused_before_the_weights_load():
    args = sdpo.Args(feedback_column="privileged_context")
    assert args.problems() == [] and args.problems(["prompt", "answer", "privileged_context"]) == []
    (problem,) = args.problems(["prompt", "answer"])
    assert problem.startswith("--feedback_column 'privileged_context': the data has no such column (its columns: "
                              "prompt, answer)")
    assert sdpo.Args().problems(["prompt"]) == []
    (problem,) = sdpo.Args(feedback_template="{feedback_text}").problems()
    assert problem.startswith("--feedback_template: KeyError 'feedback_text'")


def test_the_reprompt_is_the_user_turn_of_the_chat_template(monkeypatch):
    """A chat template that wraps each turn in "=...=" wraps the re-prompted user turn, not the whole; a TRL
    conversational row gets its last (user) turn re-prompted, as TRL does."""
    tokenizer = build_tokenizer(chat_template="{% for m in messages %}={{ m['content'] }}={% endfor %}")
    batch, rows = toy_batch(tokenizer)
    T = batch.mask.shape[1]
    context, _ = contexts(monkeypatch, tokenizer, rows, batch)
    assert decoded(tokenizer, context, T)[1] == ("=12+34=46=12+34==", "4<eos>")
    conversational = {**rows, "prompt": [[{"role": "user", "content": p}] for p in rows["prompt"]]}
    context, _ = contexts(monkeypatch, tokenizer, conversational, batch)
    assert decoded(tokenizer, context, T)[1] == ("=12+34=46=12+34==", "4<eos>")


def test_the_ema_teacher_moves_a_rate_of_the_way_and_the_others_stay():
    policy, teacher = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    torch.nn.init.constant_(policy.weight, 1.0)
    torch.nn.init.constant_(teacher.weight, 0.0)
    sdpo.ema_update(teacher, policy, on_one_process(replace(ARGS, teacher_update_rate=0.05)))
    torch.testing.assert_close(teacher.weight, torch.full((1, 2), 0.05))
    for kind in ("base", "live"):
        sdpo.ema_update(teacher, policy, on_one_process(replace(ARGS, teacher=kind)))
        torch.testing.assert_close(teacher.weight, torch.full((1, 2), 0.05))


def test_a_frozen_copy_has_the_policys_weights_and_does_not_share_them():
    from common.models.copies import frozen_copy

    policy = torch.nn.Linear(2, 1)
    teacher = frozen_copy(on_one_process(ARGS), policy)
    assert torch.equal(teacher.weight, policy.weight) and not teacher.weight.requires_grad
    with torch.no_grad():
        policy.weight.add_(1.0)
    assert not torch.equal(teacher.weight, policy.weight)
    with pytest.raises(SystemExit, match="FSDP1's flat parameters is not supported: launch with configs/accel"):
        frozen_copy(on_one_process(ARGS, DistributedType.FSDP), policy)  # FSDP, not FSDP2: refused by name


# End to end


@pytest.mark.slow
def test_a_live_teacher_on_its_own_prompt_distills_nothing(in_toy_workdir):
    """--teacher live with the re-prompt "{prompt}": the teacher's context is the student's, token for token, so its
    log-probs are the student's (the columns line up), the distillation loss is 0 and, the term alone, so is every
    gradient: the step leaves the weights as they were."""
    run = run_script(sdpo, ["--preset", "toy", "--total_steps", "2", "--eval_steps", "0", "--teacher", "live",
                            "--reprompt_template", "{prompt}", "--solution_template", "{successful_previous_attempt}",
                            "--run_name", "sdpo_identity"])
    for m in read_metrics(run):
        assert m["sdpo/reprompted_frac"] > 0 and m["sdpo/teacher_gap"] == 0 and m["sdpo/distill_loss"] == 0
        assert m["optim/grad_norm"] == 0


@pytest.mark.slow
@pytest.mark.precondition
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir):
    """Two passes over each batch in two mini-batches, the EMA teacher between optimizer steps, the IS clip reached:
    the denominators are the optimizer batch's and each row's context its own group's, whatever the micro-batches
    and processes."""
    flags = STALE + TOY + ["--distillation_weight", "0.5", "--distillation_is_clip", "1.001"]
    assert_stale_updates_agree(in_toy_workdir, "sdpo.py", "sdpo", flags,
                               lambda m: m["policy/ratio_mean"] != 1.0 and m["sdpo/reprompted_frac"] > 0)


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run: held-out greedy accuracy must rise. The toy's own templates and a tenth of the
    distillation term beside GRPO's: the distillation term alone collapses the toy (docs/estimators/sdpo.md); 100
    steps, not the others' 50, since the distillation term slows the start (benchmarks/learning_bars.py VARIANTS)."""
    run = run_script(sdpo, ["--preset", "toy", "--total_steps", "100", "--eval_steps", "50", "--distillation_weight",
                            "0.1", *TOY, "--run_name", "sdpo_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("sdpo"), evals


@pytest.mark.slow
@pytest.mark.parametrize("stage, teacher, lora", [("fsdp2", "ema", False), ("zero3", "ema", False),
                                                 ("fsdp2", "live", False), ("zero3", "ema", True)])
def test_a_sharded_policy_takes_the_ddp_update_with_its_teacher_copy(in_toy_workdir, stage, teacher, lora):
    """The teacher under FSDP2 and DeepSpeed ZeRO-3 (2 CPU processes, tests/test_sharded.py's way): the stale step of
    the test above equals the single process's. ema: a sharded copy of the weights (a deepcopy is refused under FSDP2
    and copies empty partitions under ZeRO-3), moved between optimizer steps (its whole weights after a forward
    resharded first under FSDP2, gathered under ZeRO-3); base is the same copy, not moved; live: the sharded policy.
    The teacher runs on every micro-batch, as every process must. With LoRA (ZeRO-3 only: FSDP cannot wrap a peft
    model) the copy takes the same adapter."""
    from test_sharded import FSDP2
    from test_snib import assert_same_update, stale_update
    from test_train import sgd_gradient

    flags = STALE + TOY + ["--distillation_weight", "0.5", "--distillation_is_clip", "1.001", "--teacher", teacher]
    flags += ["--lora_r", "4", "--lora_alpha", "8"] if lora else []
    teacher += "_lora" if lora else ""
    whole, lr, _ = stale_update(in_toy_workdir, "sdpo.py", f"sdpo_{teacher}_p1", flags + ["--micro_batch_size", "8"],
                                lambda m: m["policy/ratio_mean"] != 1.0 and m["sdpo/reprompted_frac"] > 0)
    config = FSDP2 if stage == "fsdp2" else os.path.join(REPO, "configs", "accelerate", "zero3.yaml")
    sharded = sgd_gradient(in_toy_workdir, f"sdpo_{teacher}_{stage}", flags + ["--micro_batch_size", "2"], 2,
                           "sdpo.py", lr, config=config)
    assert_same_update(sharded, whole, f"sdpo.py --teacher {teacher} under {stage} (lr {lr})")
