"""common.utils.completion_logprobs (chunked logsumexp + gather, custom backward) against the naive fp32
log-softmax over (B, T, V): same values and same gradients, with padding, temperature, entropy_grad on/off,
several chunkings, on the toy model, a random model with a large vocabulary and a LoRA-wrapped model."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import common.utils
from benchmarks.logprobs_memory import make_batch, naive_completion_logprobs, tiny_model
from common.toy import TOY_DIR
from common.utils import TokenLogprobs, completion_logprobs

TOL = {"atol": 1e-5, "rtol": 1e-5}


def run(fn, model, batch, T, temperature, entropy_grad, weights):
    """Values, and the gradient of sum(w1 logp + w2 entropy) (entropy only if entropy_grad) w.r.t. every parameter."""
    input_ids, attention_mask, mask = batch
    model.zero_grad()
    logp, entropy = fn(model, input_ids, attention_mask, T, temperature, entropy_grad=entropy_grad)
    assert entropy.requires_grad == entropy_grad
    loss = (weights[0] * logp * mask).sum()
    if entropy_grad:
        loss = loss + (weights[1] * entropy * mask).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


def assert_same_as_naive(model, batch, T, temperature, entropy_grad, tol=TOL):
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(2, *batch[2].shape, generator=g)  # (2, B, T): arbitrary upstream gradients
    want = run(naive_completion_logprobs, model, batch, T, temperature, entropy_grad, weights)
    got = run(completion_logprobs, model, batch, T, temperature, entropy_grad, weights)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert got[2].keys() == want[2].keys() and len(got[2]) > 0
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():  # the old / reference passes
        lp, ent = completion_logprobs(model, batch[0], batch[1], T, temperature)
    torch.testing.assert_close(lp, want[0], **tol)
    torch.testing.assert_close(ent, want[1], **tol)


@pytest.fixture(scope="module")
def toy_model(toy_workdir):
    return AutoModelForCausalLM.from_pretrained(os.path.join(toy_workdir, TOY_DIR, "model"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_toy_model_matches_naive(toy_model, temperature, entropy_grad):
    V = toy_model.config.vocab_size
    assert_same_as_naive(toy_model, make_batch(V, 6, 5, 7), 7, temperature, entropy_grad)


@pytest.mark.parametrize("chunk", ["default", "rows", "positions"])
@pytest.mark.parametrize("temperature, entropy_grad", [(1.0, False), (1.3, True), (0.6, True)])
def test_large_vocabulary_matches_naive(monkeypatch, chunk, temperature, entropy_grad):
    V, T = 32_000, 9
    if chunk == "rows":  # two whole rows per chunk, the last chunk one row
        monkeypatch.setattr(common.utils, "LOGPROB_CHUNK_ELEMENTS", 2 * T * V)
    elif chunk == "positions":  # 4 positions per chunk: chunks never line up with rows
        monkeypatch.setattr(common.utils, "LOGPROB_CHUNK_ELEMENTS", 4 * V + 7)
    model = tiny_model(V, torch.float32)
    assert_same_as_naive(model, make_batch(V, 5, 4, T), T, temperature, entropy_grad)


def test_lora_model_matches_naive():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model(5_000, torch.float32), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False))
    assert_same_as_naive(model, make_batch(5_000, 3, 4, 6), 6, 0.8, True)
    with model.disable_adapter(), torch.no_grad():  # the LoRA reference policy
        want, _ = naive_completion_logprobs(model, *make_batch(5_000, 3, 4, 6)[:2], 6, 0.8)
        got, _ = completion_logprobs(model, *make_batch(5_000, 3, 4, 6)[:2], 6, 0.8)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_gradcheck_in_double_precision(monkeypatch, which):
    monkeypatch.setattr(common.utils, "LOGPROB_CHUNK_ELEMENTS", 3 * 11)  # chunks of 3 positions
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=g).requires_grad_()  # (B, T + 1, V)
    targets = torch.randint(0, 11, (2, 4), generator=g)

    def f(x):
        logp, entropy = TokenLogprobs.apply(x, targets, 0.7, which != "logp")
        return {"logp": (logp,), "entropy": (entropy,), "both": (logp, entropy)}[which]

    assert torch.autograd.gradcheck(f, (logits,))


def test_bf16_logits_same_as_naive_and_no_fp32_vocabulary_tensor_is_kept():
    V, T = 20_000, 6
    model = tiny_model(V, torch.bfloat16)
    input_ids, attention_mask, mask = make_batch(V, 3, 4, T)
    saved = []

    def keep(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logp, entropy = completion_logprobs(model, input_ids, attention_mask, T, 0.9, entropy_grad=True)
    assert not [s for s in saved if s[0] == torch.float32 and s[1] >= 3 * T * V]  # the backward keeps bf16 logits only
    (logp * mask).sum().add((entropy * mask).sum()).backward()
    lean_grad = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logp_n, entropy_n = naive_completion_logprobs(model, input_ids, attention_mask, T, 0.9, entropy_grad=True)
    (logp_n * mask).sum().add((entropy_n * mask).sum()).backward()
    torch.testing.assert_close(logp, logp_n, **TOL)  # fp32 math on the same bf16 logits
    torch.testing.assert_close(entropy, entropy_n, **TOL)
    for n, p in model.named_parameters():  # both cast the fp32 gradient of the logits to bf16 once
        torch.testing.assert_close(lean_grad[n], p.grad, atol=1e-2, rtol=1e-2)


def test_backward_overwrites_the_logits_so_a_second_backward_fails_loudly():
    model = tiny_model(1_000, torch.float32)
    input_ids, attention_mask, _ = make_batch(1_000, 2, 3, 5)
    logp, _ = completion_logprobs(model, input_ids, attention_mask, 5, 1.0)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()


def test_rows_of_one_prompt_share_its_forward_in_no_grad_passes(toy_model):
    """share_prompts: each distinct prompt (left padding included) runs once, its cache goes to all its rows, and the
    log-probs and entropies are the plain forward's; with gradients, or without repeats, it is the plain forward."""
    ids, attention, mask = make_batch(toy_model.config.vocab_size, 4, 5, 6)  # prompts of 5, 2, 1 and 1 tokens
    completions = torch.randint(2, toy_model.config.vocab_size, (4, 3, 6), generator=torch.Generator().manual_seed(3))
    P = 5
    rows = [0, 0, 1, 2, 0, 1, 3]  # repeats of prompts 0 and 1, not all next to each other; 2 and 3 differ only in
    # their one real token, the last: all that precedes it (the shared prefix) is padding in both
    ids, attention = ids[rows].clone(), attention[rows].clone()
    ids[:, P:] = completions[rows, torch.arange(len(rows)) % 3] * attention[:, P:]  # other completions per row
    shapes = []
    hook = toy_model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)),
                                               with_kwargs=True)
    try:
        with torch.no_grad():
            plain = completion_logprobs(toy_model, ids, attention, 6, 0.7)
            assert shapes == [(7, 11)]
            shapes.clear()
            shared = completion_logprobs(toy_model, ids, attention, 6, 0.7, share_prompts=True)
            assert shapes == [(3, 4), (7, 7)]  # the 3 distinct prefixes (prompts less their last token), then the rest
            shapes.clear()
            distinct = completion_logprobs(toy_model, ids[[0, 2]], attention[[0, 2]], 6, 0.7, share_prompts=True)
            assert shapes == [(2, 11)]
        shapes.clear()
        completion_logprobs(toy_model, ids, attention, 6, 0.7, share_prompts=True)
        assert shapes == [(7, 11)]  # with gradients: no cache (its backward would need the prefix's graph)
    finally:
        hook.remove()
    m = mask[rows].bool()
    for got, want in zip(shared, plain):
        torch.testing.assert_close(got[m], want[m], **TOL)
    for got, want in zip(distinct, plain):
        torch.testing.assert_close(got[m[[0, 2]]], want[[0, 2]][m[[0, 2]]], **TOL)
