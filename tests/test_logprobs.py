"""common.logprobs.completion_logprobs against the naive fp32 log-softmax over (B, T, V): same values (at completion
tokens; 0 at padding) and same gradients, with padding, temperature, entropy_grad on/off, several chunkings, on the
toy model (tied embeddings), a random model with a large vocabulary and a LoRA-wrapped model (LoRA on the head), by
both paths: "head" (hidden states x head weight, common.logprobs.HeadLogprobs) and "logits" (TokenLogprobs, the
path for heads fused_head turns down). Then float64 gradchecks, no (B, T, V) tensor on the head path, and rows
bucketed by length (length_buckets) against the padded form."""

import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import common.logprobs
import common.nucleus
from benchmarks.logprobs_memory import make_batch, naive_completion_logprobs, tiny_model
from common.logprobs import HeadLogprobs, TokenLogprobs, completion_logprobs, fused_head
from common.sampling import length_buckets, pad_rows
from common.tasks.toy import TOY_DIR

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(params=["head", "logits"])
def path(request, monkeypatch):
    """Every comparison runs on both paths: "logits" is what a model without a plain head gets."""
    if request.param == "logits":
        monkeypatch.setattr(common.logprobs, "PLAIN_HEAD_MODELS", set())
    return request.param


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
    m = batch[2].bool()  # completion tokens: padding is 0 in completion_logprobs, whatever it is in the naive form
    torch.testing.assert_close(got[0][m], want[0][m], **tol)
    torch.testing.assert_close(got[1][m], want[1][m], **tol)
    assert not got[0][~m].any() and not got[1][~m].any()
    assert got[2].keys() == want[2].keys() and len(got[2]) > 0
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():  # the old / reference passes
        lp, ent = completion_logprobs(model, batch[0], batch[1], T, temperature)
    torch.testing.assert_close(lp[m], want[0][m], **tol)
    torch.testing.assert_close(ent[m], want[1][m], **tol)


@pytest.fixture(scope="module")
def toy_model(toy_workdir):
    return AutoModelForCausalLM.from_pretrained(os.path.join(toy_workdir, TOY_DIR, "model"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_toy_model_matches_naive(toy_model, temperature, entropy_grad, path):
    assert toy_model.lm_head.weight is toy_model.model.embed_tokens.weight  # tied: both gradients land in one tensor
    assert (fused_head(toy_model) is toy_model.lm_head) == (path == "head")
    V = toy_model.config.vocab_size
    assert_same_as_naive(toy_model, make_batch(V, 6, 5, 7), 7, temperature, entropy_grad)


@pytest.mark.parametrize("chunk", ["default", "rows", "positions"])
@pytest.mark.parametrize("temperature, entropy_grad", [(1.0, False), (1.3, True), (0.6, True)])
def test_large_vocabulary_matches_naive(monkeypatch, chunk, temperature, entropy_grad, path):
    V, T = 32_000, 9
    if chunk == "rows":  # two whole rows per chunk, the last chunk one row
        monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 2 * T * V)
    elif chunk == "positions":  # 4 positions per chunk: chunks never line up with rows
        monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 4 * V + 7)
    model = tiny_model(V, torch.float64)  # fp64: the two sum in different orders, and fp32 rounding (~3e-5 here,
    # amplified by T = 0.6 through the layers) would hide a wrong term as well as it hides the order
    assert_same_as_naive(model, make_batch(V, 5, 4, T), T, temperature, entropy_grad)


def test_lora_model_matches_naive(path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model(5_000, torch.float32), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False))
    head = fused_head(model)  # the LoRA Linear over lm_head: the adapter's low-rank term is a second (h, W) pair
    assert (head is not None and type(head).__name__ == "Linear" and hasattr(head, "lora_A")) == (path == "head")
    assert_same_as_naive(model, make_batch(5_000, 3, 4, 6), 6, 0.8, True)
    with model.disable_adapter(), torch.no_grad():  # the LoRA reference policy
        want, _ = naive_completion_logprobs(model, *make_batch(5_000, 3, 4, 6)[:2], 6, 0.8)
        got, _ = completion_logprobs(model, *make_batch(5_000, 3, 4, 6)[:2], 6, 0.8)
    m = make_batch(5_000, 3, 4, 6)[2].bool()
    torch.testing.assert_close(got[m], want[m], **TOL)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9)])
def test_a_pass_without_the_entropy_gives_the_same_logprobs_and_skips_its_work(path, monkeypatch, temperature, top_p):
    """with_entropy=False (the no-grad passes: reference and old log-probs, which read only the log-probs): the same
    log-probs to the bit, the entropy 0, and at top_p = 1 no exp over the logits (the entropy's p), on both paths and
    over several chunks; with the entropy, an exp in each chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountExp(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func in (torch.ops.aten.exp.default, torch.ops.aten.exp_.default)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 4 * 5_000)  # 4 positions a chunk
    model = tiny_model(5_000, torch.float32)
    input_ids, attention_mask, mask = make_batch(5_000, 3, 4, 6)
    counted = {}
    with torch.no_grad():
        for with_entropy in (True, False):
            with CountExp() as exps:
                counted[with_entropy] = completion_logprobs(model, input_ids, attention_mask, 6, temperature,
                                                            top_p=top_p, with_entropy=with_entropy)
            counted[with_entropy] += (exps.calls,)
    (logp, entropy, exps_with), (lean_logp, lean_entropy, exps_without) = counted[True], counted[False]
    assert torch.equal(lean_logp, logp) and logp[mask.bool()].lt(0).all()
    assert entropy[mask.bool()].gt(0).all() and not lean_entropy.any()
    if top_p == 1:
        assert exps_without == 0 and exps_with >= 2, (exps_with, exps_without)  # one exp in each chunk


@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_gradcheck_in_double_precision(monkeypatch, which):
    monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 3 * 11)  # chunks of 3 positions
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=g).requires_grad_()  # (B, T + 1, V)
    targets = torch.randint(0, 11, (2, 4), generator=g)

    def f(x):
        logp, entropy = TokenLogprobs.apply(x, targets, 0.7, which != "logp")
        return {"logp": (logp,), "entropy": (entropy,), "both": (logp, entropy)}[which]

    assert torch.autograd.gradcheck(f, (logits,))


def test_bf16_logits_same_as_naive_and_no_fp32_vocabulary_tensor_is_kept(path):
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
    m = mask.bool()
    torch.testing.assert_close(logp[m], logp_n[m], **TOL)  # fp32 math on the same bf16 logits
    torch.testing.assert_close(entropy[m], entropy_n[m], **TOL)
    for n, p in model.named_parameters():  # both cast the fp32 gradient of the logits to bf16 once
        torch.testing.assert_close(lean_grad[n], p.grad, atol=1e-2, rtol=1e-2)


def test_backward_overwrites_the_logits_so_a_second_backward_fails_loudly(monkeypatch):
    monkeypatch.setattr(common.logprobs, "PLAIN_HEAD_MODELS", set())  # the logits path
    model = tiny_model(1_000, torch.float32)
    input_ids, attention_mask, _ = make_batch(1_000, 2, 3, 5)
    logp, _ = completion_logprobs(model, input_ids, attention_mask, 5, 1.0)
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()


def test_rows_of_one_prompt_share_its_forward_in_no_grad_passes(toy_model, path):
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
            assert shapes == [(7, 11)]  # 5 prompt and 6 completion columns (exact widths on the CPU)
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


@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
@pytest.mark.parametrize("pairs", [1, 2])
def test_head_gradcheck_in_double_precision(monkeypatch, which, pairs):
    """HeadLogprobs' backward (recomputed chunk logits) against finite differences, for the hidden states and the
    weights of a plain head (1 pair) and of a LoRA-shaped head (2 pairs: x W^T + (x A^T) B^T), chunks of 3 positions."""
    monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 3 * 11)
    g = torch.Generator().manual_seed(0)
    N, V, D, r = 7, 11, 5, 2
    targets = torch.randint(0, V, (N,), generator=g)
    inputs = [torch.randn(N, D, dtype=torch.float64, generator=g), torch.randn(V, D, dtype=torch.float64, generator=g),
              torch.randn(N, r, dtype=torch.float64, generator=g), torch.randn(V, r, dtype=torch.float64, generator=g)]
    inputs = [t.requires_grad_() for t in inputs[:2 * pairs]]

    def f(*tensors):
        logp, entropy = HeadLogprobs.apply(targets, 0.7, which != "logp", 1.0, True, *tensors)
        return {"logp": (logp,), "entropy": (entropy,), "both": (logp, entropy)}[which]

    assert torch.autograd.gradcheck(f, tuple(inputs))


def largest_vocabulary_tensor(fn) -> int:
    """The most elements of any tensor made while `fn` runs whose last dimension is the vocabulary (32,000)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes = [0]

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == 32_000:
                    sizes.append(t.numel())
            return out

    with Record():
        fn()
    return max(sizes)


def test_head_path_makes_no_logits_of_the_whole_batch(monkeypatch, path):
    """With the head path, no tensor over the vocabulary is larger than a chunk of positions or the head's weight
    (and its gradient); the logits path makes the (B, T + 1, V) logits. The batch has more positions (B * T = 96)
    than the hidden size (64), so the bound tells them apart."""
    monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 4 * 32_000)
    V, B, T = 32_000, 4, 24
    model = tiny_model(V, torch.float32)
    input_ids, attention_mask, mask = make_batch(V, B, 3, T)

    def step():
        logp, entropy = completion_logprobs(model, input_ids, attention_mask, T, 1.0, entropy_grad=True)
        ((logp + entropy) * mask).sum().backward()

    largest = largest_vocabulary_tensor(step)
    bound = V * model.config.hidden_size  # lm_head.weight and its gradient
    assert (largest <= bound) == (path == "head"), (largest, bound)
    if path == "logits":
        assert largest >= B * (T + 1) * V


def test_length_buckets_sort_rows_longest_first():
    mask = pad_rows([[1] * n for n in [3, 7, 1, 7, 5, 2]], 0)  # (6, 7)
    buckets = length_buckets(mask, 4, offset=10)
    assert [b.tolist() for b in buckets] == [[11, 13, 14, 10], [15, 12]]  # ties keep their order


def test_length_buckets_can_keep_groups_whole_and_in_order():
    mask = pad_rows([[1] * n for n in [3, 1, 7, 2, 5, 6]], 0)  # (6, 7): groups of 2 whose longest are 3, 7, 6
    buckets = length_buckets(mask, 4, offset=10, unit=2)
    assert [b.tolist() for b in buckets] == [[12, 13, 14, 15], [10, 11]]
    assert [b.tolist() for b in length_buckets(mask, 4, offset=10)] == [[12, 15, 14, 10], [13, 11]]  # split


def varied_batch(V: int, B: int, P: int, T: int, seed: int = 0):
    """[left-padded prompt | right-padded completion], prompt lengths 1..P and completion lengths 1..T at random."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, V, (int(n),), generator=g).tolist() for n in torch.randint(1, P + 1, (B,), generator=g)]
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    completions = [torch.randint(2, V, (int(n),), generator=g).tolist() for n in lengths]
    completions[0] = completions[0][:1] + [5] * (T - 1)  # one row of full length: the batch is T wide
    prompts_t, completions_t = pad_rows(prompts, 0, left=True), pad_rows(completions, 0)
    mask = pad_rows([[1] * len(c) for c in completions], 0)
    attention_mask = torch.cat([(prompts_t != 0).long(), mask], dim=1)
    return torch.cat([prompts_t, completions_t], dim=1), attention_mask, mask


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_length_buckets_give_the_padded_form_gradient(path, entropy_grad):
    """The update as the loop runs it (micro-batches of rows sorted by length, each forward on its own columns)
    against the padded form (micro-batches in row order, every row T wide, the naive log-softmax): the same
    accumulated gradient, and the same log-probs at completion tokens."""
    V, B, P, T, size = 3_000, 10, 6, 20, 3
    model = tiny_model(V, torch.float32)
    input_ids, attention_mask, mask = varied_batch(V, B, P, T)
    w = torch.randn(2, B, T, generator=torch.Generator().manual_seed(2))  # (2, B, T) upstream gradients

    def accumulate(fn, groups):
        model.zero_grad()
        logp = torch.zeros(B, T)
        for s in groups:
            lp, ent = fn(model, input_ids[s], attention_mask[s], T, 0.9, entropy_grad=entropy_grad)
            loss = (w[0][s] * lp * mask[s]).sum() + ((w[1][s] * ent * mask[s]).sum() if entropy_grad else 0)
            loss.backward()
            logp[s] = lp.detach()
        return logp, {n: p.grad.clone() for n, p in model.named_parameters()}

    padded = accumulate(naive_completion_logprobs, [slice(i, i + size) for i in range(0, B, size)])
    buckets = length_buckets(mask, size)
    assert [int(mask[b].sum(-1).max()) for b in buckets] != [T] * len(buckets)  # some forwards are narrower
    bucketed = accumulate(completion_logprobs, buckets)
    m = mask.bool()
    torch.testing.assert_close(bucketed[0][m], padded[0][m], **TOL)
    for name, grad in padded[1].items():
        torch.testing.assert_close(bucketed[1][name], grad, **TOL, msg=lambda msg, name=name: f"{name}: {msg}")


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str):
    """One of `world` processes: DDP over the tiny model, this process's rows, the head path; saves its gradients."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(tiny_model(2_000, torch.float64))
    assert fused_head(model) is model.module.lm_head
    input_ids, attention_mask, mask = varied_batch(2_000, 4 * world, 4, 9)
    rows = slice(4 * rank, 4 * rank + 4)
    logp, entropy = completion_logprobs(model, input_ids[rows], attention_mask[rows], 9, 0.8, entropy_grad=True)
    ((logp + 0.1 * entropy) * mask[rows]).sum().backward()  # DDP averages over processes
    torch.save({n: p.grad for n, p in model.module.named_parameters()}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_head_gradient_is_reduced_by_ddp(tmp_path):
    """Under DDP the head's weight gradient goes through DDP's reducer (the head runs inside DDP's forward): every
    process ends with the mean over processes of the single-process gradients, lm_head included."""
    world = 2
    torch.multiprocessing.spawn(_ddp_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    model = tiny_model(2_000, torch.float64)
    input_ids, attention_mask, mask = varied_batch(2_000, 4 * world, 4, 9)
    logp, entropy = naive_completion_logprobs(model, input_ids, attention_mask, 9, 0.8, entropy_grad=True)
    ((logp + 0.1 * entropy) * mask).sum().div(world).backward()
    for rank in range(world):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, name=name: f"rank {rank} {name}: {m}")


def qwen3_geometry_steps(steps: int, seed: int = 0):
    """Batches of the Qwen3-shaped benchmark's geometry (benchmarks/qwen3_shape.py at the GPU check's batch 64, G 8):
    prompts of 13-37 tokens, completions of roughly geometric length (mean 100, cap 256), a group's rows sharing
    their prompt. Yields (input_ids, attention_mask, P, T)."""
    import random

    rng = random.Random(seed)
    B, G = 64, 8
    for _ in range(steps):
        prompts = [rng.randint(13, 37) for _ in range(B // G) for _ in range(G)]
        completions = [min(256, max(1, int(rng.expovariate(1 / 100)))) for _ in range(B)]
        P, T = max(prompts), max(completions)
        ids = torch.randint(2, 512, (B, P + T), generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        attention = torch.zeros(B, P + T, dtype=torch.long)
        for i in range(B):
            attention[i, P - prompts[i]:P + completions[i]] = 1
        for g in range(0, B, G):  # a group's rows share their prompt
            ids[g:g + G, :P] = ids[g, :P]
            attention[g:g + G, :P] = attention[g, :P]
        yield ids * attention, attention, P, T


def new_shapes_per_step(model, step: int, monkeypatch) -> tuple[list[int], int]:
    """How many attention shapes each step meets that no earlier step met, in the log-prob passes and the update of
    the Qwen3-shaped geometry (old and reference passes sharing prompts, then --micro_batch_size 16), decode aside,
    with the widths rounded to `step`; and how many distinct shapes in all."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    met = []

    def spy(q, k, v, attn_mask=None, **kwargs):
        if q.shape[2] > 1:  # not a decode step
            met.append((tuple(q.shape), tuple(k.shape), None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setitem(common.logprobs.WIDTH_STEP, "cpu", step)
    seen, new = set(), []
    for ids, attention, P, T in qwen3_geometry_steps(5):
        met.clear()
        with torch.no_grad():
            for _ in range(2):  # old_logp and ref_logp
                for rows in length_buckets(attention[:, P:], 16):
                    completion_logprobs(model, ids[rows], attention[rows], T, 1.0, share_prompts=True)
        for rows in length_buckets(attention[:, P:], 16):  # the update
            completion_logprobs(model, ids[rows], attention[rows], T, 1.0)[0].sum().backward()
        new.append(len(set(met) - seen))
        seen |= set(met)
    monkeypatch.undo()
    return new, len(seen)


def test_a_gpus_forwards_meet_few_new_attention_shapes_after_the_first_steps(monkeypatch):
    """On a GPU the widths are rounded (common/logprobs.py WIDTH_STEP, forced here on the CPU): from the third step
    on, at most 2 attention shapes a step were not met before. With exact widths (the CPU's rule), most of a step's
    shapes are new every step, each a cuDNN execution plan to build on a GPU. (TRL pads every micro-batch to the
    batch's longest prompt and completion: about 1 new shape a step.)"""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config)
    rounded, distinct = new_shapes_per_step(model, 64, monkeypatch)
    assert max(rounded[2:]) <= 2 and distinct <= 30, (rounded, distinct)
    exact, _ = new_shapes_per_step(model, 1, monkeypatch)
    assert min(exact[2:]) > 2, exact  # the measure tells the two rules apart


def test_padded_columns_leave_the_log_probs_as_they_are(monkeypatch, toy_model):
    """The GPU's rounded widths (forced here) add prompt columns on the left and completion columns on the right,
    none attended to: the log-probs and entropies are the exact widths' ones, with or without shared prompts."""
    ids, attention, P, T = next(qwen3_geometry_steps(1))
    ids = ids.clamp(max=toy_model.config.vocab_size - 1)[:16, : P + 40]
    attention = attention[:16, : P + 40]
    with torch.no_grad():
        exact = completion_logprobs(toy_model, ids, attention, 40, 0.7, share_prompts=True)
        monkeypatch.setitem(common.logprobs.WIDTH_STEP, "cpu", 64)
        padded = completion_logprobs(toy_model, ids, attention, 40, 0.7, share_prompts=True)
    for got, want in zip(padded, exact):
        assert got.shape == want.shape == (16, 40)
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("used, step, width", [(0, 64, 0), (1, 64, 1), (5, 64, 8), (64, 64, 64), (65, 64, 128),
                                               (200, 64, 256), (37, 1, 37), (6, 1, 6)])
def test_padded_width(used, step, width):
    assert common.logprobs.padded_width(used, step) == width


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_no_buffer_is_read_before_it_is_written(monkeypatch, path, entropy_grad):
    """Issue 55: a NaN at the first step of a bf16 run on the CPU, in 2 runs of 12, pointed at memory read before it
    was written. Every torch.empty / torch.empty_like made during the passes here is filled with NaN (the allocator
    may hand back any bytes, and 0 * NaN is NaN): values and gradients must be finite and bit for bit those of the
    run without the poison, in bf16, with chunks that line up neither with rows nor with the last position."""
    monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 4 * 3_000 + 7)  # 4 positions per chunk
    model = tiny_model(3_000, torch.bfloat16)
    batch = make_batch(3_000, 5, 4, 9)
    weights = torch.randn(2, *batch[2].shape, generator=torch.Generator().manual_seed(1))
    clean = run(completion_logprobs, model, batch, 9, 0.8, entropy_grad, weights)
    empty, empty_like, made = torch.empty, torch.empty_like, []

    def poisoned(tensor):
        made.append(tensor.numel())
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))
    logp, entropy, grads = run(completion_logprobs, model, batch, 9, 0.8, entropy_grad, weights)
    assert made  # the passes made buffers, and each was poisoned
    for want, got in [(clean[0], logp), (clean[1], entropy)] + [(clean[2][n], grads[n]) for n in clean[2]]:
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)



# -------------------------------------------------- top_p < 1: the distribution that was sampled

TOP_P = 0.9


def naive_nucleus_logprobs(model, input_ids, attention_mask, T, temperature, top_p):
    """The sampled distribution's log-probs, entropies and kept sets the plain way.

    The full logits, a log-softmax over (B, T, V), a sort and a cumsum for each position's kept
    set (the sampler's rule), the target added to it (completion_logprobs always keeps it), then a
    log-softmax over the kept set. Autograd differentiates it: the kept set is a boolean, so its
    gradient is that of the log-sum-exp over the set."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=T + 1).logits[:, :-1]  # (B, T, V)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # (B, T, V)
    all_logp = torch.log_softmax(z, dim=-1)  # (B, T, V)
    sorted_logp, order = all_logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # (B, T, V) in sorted order
    nucleus = ~drop.scatter(-1, order, drop)  # (B, T, V) in vocabulary order
    targets = input_ids[:, -T:, None]  # (B, T, 1)
    kept = nucleus.scatter(-1, targets, True)  # (B, T, V)
    kept_logp = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1)  # (B, T, V)
    logp = kept_logp.gather(-1, targets)[..., 0]  # (B, T)
    entropy = -(kept_logp.exp() * kept_logp.masked_fill(~kept, 0)).sum(-1)  # (B, T)
    in_nucleus = nucleus.gather(-1, targets)[..., 0]  # (B, T)
    return logp, entropy, in_nucleus, nucleus.sum(-1)


def assert_nucleus_same_as_naive(model, batch, T, temperature, tol=TOL):
    """Values at completion tokens, with and without gradient, and every parameter's gradient of
    an arbitrary weighted sum of logp and entropy, against naive_nucleus_logprobs."""
    input_ids, attention_mask, mask = batch
    weights = torch.randn(2, *mask.shape, generator=torch.Generator().manual_seed(1))  # (2, B, T)
    weights = weights.to(torch.promote_types(model.dtype, torch.float32))

    def grads(logp, entropy):
        model.zero_grad()
        ((weights[0] * logp + weights[1] * entropy) * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = naive_nucleus_logprobs(model, input_ids, attention_mask, T, temperature, TOP_P)
    want_grads = grads(*want[:2])
    got = completion_logprobs(model, input_ids, attention_mask, T, temperature,
                              entropy_grad=True, top_p=TOP_P)
    got_grads = grads(*got)
    m = mask.bool()
    torch.testing.assert_close(got[0][m], want[0][m].detach(), **tol)
    torch.testing.assert_close(got[1][m], want[1][m].detach(), **tol)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **tol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # the old-policy passes, prompts shared
        lp, ent = completion_logprobs(model, input_ids, attention_mask, T, temperature,
                                      share_prompts=True, top_p=TOP_P)
    torch.testing.assert_close(lp[m], want[0][m].detach(), **tol)
    torch.testing.assert_close(ent[m], want[1][m].detach(), **tol)
    return want


@pytest.fixture(scope="module")
def toy_tokenizer(toy_workdir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(toy_workdir, TOY_DIR, "model"))


@pytest.mark.parametrize("temperature, topk", [(1.0, None), (0.7, None), (1.0, 3)])
def test_top_p_log_probs_of_sampled_tokens_are_the_sampled_distributions(
        monkeypatch, toy_model, toy_tokenizer, path, temperature, topk):
    """Issue 55: the toy's completions at top_p 0.9, as the HF engine samples them. At every
    sampled token the trainer's log-prob (and entropy, and their gradients) are those of
    softmax(logits / T) renormalised over the kept set, computed independently
    (naive_nucleus_logprobs), and the sampler reports the same log-prob. With `topk` 3 the kept
    sets are looked for among the 3 most probable tokens first, and some are larger."""
    from accelerate import Accelerator

    from common.engines.rollout import HFEngine

    engine = HFEngine(toy_tokenizer, Accelerator(cpu=True))
    prompts = [toy_tokenizer(p)["input_ids"] for p in ["1+2=", "45+67=", "9+9=", "12+88="]] * 4
    ids, sampler = engine.generate(toy_model, prompts, list(range(len(prompts))), max_tokens=8,
                                   temperature=temperature, top_p=TOP_P)
    pad = toy_tokenizer.pad_token_id
    mask = pad_rows([[1] * len(c) for c in ids], 0)  # (B, T)
    input_ids = torch.cat([pad_rows(prompts, pad, left=True), pad_rows(ids, pad)], dim=1)
    prompt_tokens = pad_rows([[1] * len(p) for p in prompts], 0, left=True)
    attention = torch.cat([prompt_tokens, mask], dim=1)
    T, m = mask.shape[1], mask.bool()
    batch = (input_ids, attention, mask)
    if topk:
        monkeypatch.setattr(common.nucleus, "NUCLEUS_TOPK", topk)
    want, _, in_nucleus, kept = assert_nucleus_same_as_naive(toy_model, batch, T, temperature)
    if topk:
        assert (kept[m] < topk).any() and (kept[m] >= topk).any()  # both ways to find the floor
    assert in_nucleus[m].all()  # every sampled token lies in the kept set the naive form finds
    assert (kept[m] > 1).any()  # the kept sets are not all one token
    assert (kept[m] < toy_model.config.vocab_size).all()  # nor the whole vocabulary
    with torch.no_grad():
        full, _ = completion_logprobs(toy_model, input_ids, attention, T, temperature)
        trainer, _ = completion_logprobs(toy_model, input_ids, attention, T, temperature,
                                         top_p=TOP_P)
    sampler = pad_rows(sampler, 0.0)  # (B, T)
    # the tolerance of the top_p = 1 test (tests/test_common.py), which the full softmax fails
    torch.testing.assert_close(sampler[m], trainer[m], atol=1e-4, rtol=1e-4)
    assert (full[m] - want[m]).abs().max() > 0.05


@pytest.mark.parametrize("chunk", ["default", "positions", "partial"])
def test_top_p_matches_naive_on_a_large_vocabulary(monkeypatch, chunk, path):
    """A random model in fp64 (V = 32,000, near-uniform: the kept sets hold about 90% of the
    vocabulary), random completion tokens, some outside their position's kept set (the trainer
    keeps them; naive_nucleus_logprobs adds them too), chunks that line up with neither rows nor
    the last position ("positions"); "partial": the kept sets are looked for among as many of the
    most probable tokens as the median set holds first, so some are found there, some not."""
    V, T = 32_000, 9
    if chunk == "positions":
        monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 4 * V + 7)
    model = tiny_model(V, torch.float64)
    batch = make_batch(V, 5, 4, T)
    m = batch[2].bool()
    if chunk == "partial":
        with torch.no_grad():
            sizes = naive_nucleus_logprobs(model, *batch[:2], T, 0.8, TOP_P)[3][m]
        monkeypatch.setattr(common.nucleus, "NUCLEUS_TOPK", int(sizes.median()))
        assert (sizes < int(sizes.median())).any()
    _, _, in_nucleus, kept = assert_nucleus_same_as_naive(model, batch, T, 0.8)
    assert not in_nucleus[m].all() and in_nucleus[m].any()
    assert (kept[m] < V).all()


@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_top_p_gradcheck_in_double_precision(monkeypatch, which):
    """Both functions' backward at top_p 0.9 against finite differences (the kept sets do not move
    within the step), chunks of 3 positions; some targets lie outside their kept set."""
    monkeypatch.setattr(common.logprobs, "LOGPROB_CHUNK_ELEMENTS", 3 * 11)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=g).mul_(2)  # (B, T + 1, V)
    logits.requires_grad_()
    targets = torch.randint(0, 11, (2, 4), generator=g)
    N, D = 8, 5
    head = [torch.randn(N, D, dtype=torch.float64, generator=g).requires_grad_(),
            torch.randn(11, D, dtype=torch.float64, generator=g).requires_grad_()]

    def pick(logp, entropy):
        return {"logp": (logp,), "entropy": (entropy,), "both": (logp, entropy)}[which]

    def token(x):
        return pick(*TokenLogprobs.apply(x, targets, 0.7, which != "logp", False, TOP_P))

    def fused(h, w):
        return pick(*HeadLogprobs.apply(targets.flatten(), 0.7, which != "logp", TOP_P, True, h, w))

    assert torch.autograd.gradcheck(token, (logits,))
    assert torch.autograd.gradcheck(fused, tuple(head))
    with torch.no_grad():
        full, _ = TokenLogprobs.apply(logits, targets, 0.7, False)
        kept, _ = TokenLogprobs.apply(logits, targets, 0.7, False, False, TOP_P)
    assert (kept > full).all()  # each kept set is a proper subset: every log-prob rises


def test_top_p_1_runs_none_of_the_nucleus_code(monkeypatch, path):
    """top_p = 1 (the default) takes the code path of before top_p existed: the kept-set functions
    never run, and the values and gradients are bit for bit the default's (at 0.9 they do run, so
    the test can fail)."""
    model = tiny_model(3_000, torch.float32)
    batch = make_batch(3_000, 3, 4, 6)
    weights = torch.randn(2, *batch[2].shape, generator=torch.Generator().manual_seed(1))
    want = run(completion_logprobs, model, batch, 6, 0.8, True, weights)

    def forbidden(*args, **kwargs):
        raise AssertionError("a kept-set function ran at top_p = 1")

    for name in ["nucleus_floor", "nucleus_forward", "nucleus_backward"]:
        monkeypatch.setattr(common.nucleus, name, forbidden)

    def at_one(*args, **kwargs):
        return completion_logprobs(*args, **kwargs, top_p=1.0)

    got = run(at_one, model, batch, 6, 0.8, True, weights)
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a, b)
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    with pytest.raises(AssertionError, match="top_p = 1"):
        completion_logprobs(model, *batch[:2], 6, 0.8, top_p=TOP_P)


def test_logprob_metrics_by_hand():
    """logprob_metrics on two rows, three columns, the last a padding column whose old log-prob is NaN (a row the
    update never reached): log-ratios ln 2 and 0 on the valid tokens, so ratios 2 and 1, ESS (2 + 1)^2 / (2 (4 + 1))
    = 0.9, std ln 2 / 2 (over the tokens, not unbiased), entropy (1 + 3) / 2; on-policy ESS 1 and std 0; a
    micro-batch without a valid token 1 and 0, never NaN."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, 0.0]])
    old = torch.tensor([[-1.0 - math.log(2), -2.0, float("nan")], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    entropy = torch.tensor([[1.0, 3.0, 100.0], [50.0, 50.0, 50.0]])
    m = common.logprobs.logprob_metrics(entropy, logp, old, mask)
    assert m["policy/ess"].item() == pytest.approx(0.9, rel=1e-6)
    assert m["policy/log_ratio_std"].item() == pytest.approx(math.log(2) / 2, rel=1e-6)
    assert m["policy/entropy"].item() == pytest.approx(2.0)
    on_policy = common.logprobs.logprob_metrics(entropy, logp, logp, mask)
    assert on_policy["policy/ess"].item() == pytest.approx(1.0) and on_policy["policy/log_ratio_std"].item() == 0
    empty = common.logprobs.logprob_metrics(entropy, logp, old, torch.zeros_like(mask))
    assert (empty["policy/ess"].item(), empty["policy/log_ratio_std"].item(), empty["policy/entropy"].item()) == (
        1.0, 0.0, 0.0)
