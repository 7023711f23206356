"""Peers' own loss code, run on identical tensors: TRL 1.16's GRPOTrainer._compute_loss on a stand-in trainer (the
`peer` tests of tests/test_cispo.py and tests/test_sapo.py) and its SDPOTrainer.compute_loss (tests/test_sdpo.py); TRL
comes from requirements-test.txt."""

from collections import defaultdict
from types import SimpleNamespace

import torch


def trl_grpo_loss(loss_type: str, logp, old, ref, A, mask, beta: float, tis=None, epsilon_high: float = 0.2,
                  importance_sampling_level: str = "token", epsilon_low: float = 0.2, **config):
    """`GRPOTrainer._compute_loss` itself with `loss_type`, on a stand-in whose forward returns `logp`: one process,
    no accumulation, num_items_in_batch = the batch's valid tokens; `tis` is passed as vLLM's
    importance_sampling_ratio; `config`: extra GRPOConfig fields the loss reads (e.g. sapo_temperature_pos,
    vespo_k_pos); `importance_sampling_level` "sequence" for GSPO / LUSPO."""
    from trl import GRPOTrainer

    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda x, reduction="sum": x,
                                  gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level, beta=beta, loss_type=loss_type, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1, **config),
        use_vllm=tis is not None, vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=accelerator, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)))
    B, T = logp.shape
    trainer.max_completion_length = config.get("max_completion_length", T)  # dr_grpo's denominator
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": A, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum().to(logp.dtype), "importance_sampling_ratio": tis}
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def trl_sdpo_loss(student_logits, teacher_logits, completion_ids, mask, old, A, reprompted,
                  distillation_weight: float, distillation_is_clip: float | None, loss_type: str = "grpo"):
    """`SDPOTrainer.compute_loss` itself (TRL 1.16, trl.experimental.sdpo) in its sampled-token mode, on a stand-in
    whose forwards return `student_logits` (the policy, with their gradient) and `teacher_logits` (the teacher on its
    re-prompted rows): one process, no accumulation; `reprompted` (B,) is TRL's self_distillation_mask, `old` its
    old_per_token_logps (None on-policy), `loss_type` that of its policy term."""
    from contextlib import nullcontext
    from types import MethodType

    from trl.experimental.sdpo import SDPOTrainer

    student, teacher = SimpleNamespace(training=True), SimpleNamespace(training=False)  # told apart by identity
    accelerator = SimpleNamespace(gather=lambda x: x)
    trainer = SimpleNamespace(
        args=SimpleNamespace(distillation_weight=distillation_weight, distillation_mode="sampled_token",
                             distillation_alpha=1.0, distillation_topk=None, distillation_add_tail=False,
                             distillation_is_clip=distillation_is_clip),
        use_teacher_server=False, teacher_model=teacher, current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True), importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.2,
        loss_type=loss_type, max_completion_length=mask.shape[1], accelerator=accelerator, _name="SDPO",
        _metrics=defaultdict(lambda: defaultdict(list)))
    for name in ("_compute_teacher_student_logits", "_compute_self_distillation_loss", "_compute_policy_loss",
                 "_log_self_distillation_metric"):
        setattr(trainer, name, MethodType(getattr(SDPOTrainer, name), trainer))
    trainer._forward_logits = lambda model, **_: student_logits if model is student else teacher_logits
    trainer._get_teacher_context_for_self_distillation = nullcontext
    B, T = mask.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": completion_ids, "completion_mask": mask, "advantages": A,
              "old_per_token_logps": old, "self_distillation_mask": reprompted,
              "teacher_input_ids": torch.zeros(B, 1 + T, dtype=torch.long),
              "teacher_attention_mask": torch.ones(B, 1 + T, dtype=torch.long)}
    return SDPOTrainer.compute_loss(trainer, student, inputs)


def trl_sdpo_reprompts(tokenizer, prompts: list, completion_ids: torch.Tensor, rewards: torch.Tensor,
                       feedbacks: list | None, num_generations: int, **config):
    """`SuccessfulRolloutTeacherContextBuilder.build` itself (TRL 1.16, trl.experimental.sdpo) on a stand-in trainer
    of one process: `prompts` one per row (text, or TRL's conversation), `completion_ids` (B, T) right-padded with
    the pad token, `feedbacks` one per row (TRL's privileged_context) or None, `config` SDPOConfig fields over its
    defaults. Returns the teacher's message of each row (as TRL hands them to its tokenizer) and its
    self_distillation_mask (B,)."""
    import dataclasses

    from trl.experimental.sdpo import SDPOConfig
    from trl.experimental.sdpo.sdpo_trainer import SuccessfulRolloutTeacherContextBuilder

    defaults = {f.name: f.default for f in dataclasses.fields(SDPOConfig)}
    messages = []

    def tokenize(batch):  # what TRL's trainer would tokenize, kept; any ids stand in
        messages.extend(batch)
        return [[tokenizer.pad_token_id] for _ in batch]

    trainer = SimpleNamespace(
        args=SimpleNamespace(**{**defaults, **config}), num_generations=num_generations,
        model=SimpleNamespace(training=True), _tokenizer=tokenizer, processing_class=tokenizer,
        _tokenize_prompts_untruncated=tokenize,
        accelerator=SimpleNamespace(device="cpu", process_index=0, gather=lambda x: x,
                                    pad_across_processes=lambda x, **_: x))
    completion_mask = (completion_ids != tokenizer.pad_token_id).long()
    built = SuccessfulRolloutTeacherContextBuilder(trainer).build(
        {"completion_ids": completion_ids, "completion_mask": completion_mask}, prompts, rewards, feedbacks)
    return messages, built["self_distillation_mask"]
