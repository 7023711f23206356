"""Log-probs and entropies of completion tokens, a chunk of positions at a time: never a (B, T, V) fp32 tensor,
and, where the model's head allows it, no (B, T, V) logits at all.

    textbook_logprobs     read this first: one log-softmax over (B, T, V), the sampled tokens gathered; what
                          completion_logprobs computes, and the reference its tests hold it equal to
    HeadLogprobs   from the last hidden states and the LM head's weight: the model's forward runs as usual up
                   to its head, whose forward head_logprobs swaps for this function for one call, so every hook of
                   DDP, FSDP2 or ZeRO-3 still fires around it; one chunk of positions' logits at a time.
    TokenLogprobs  from logits the model made, for heads HeadLogprobs cannot stand in for (fused_head says which).
    completion_logprobs   a batch's completion tokens: picks between them, runs the forward on the columns the rows
                          use, and (no-grad passes) shares each prompt's forward among its G completions
    logprob_metrics       what a micro-batch's log-probs say when its gradient is taken: entropy, and how far the
                          policy has moved from the one of `old_logp` (log-ratio std, the ratios' ESS)

With top_p < 1 the policy is the distribution the sampler draws from: softmax(logits / T)
renormalised over each position's kept set (common.nucleus). The log-prob is z_y - logsumexp(z over
the kept set), the entropy that distribution's, both recomputed from the trainer's own logits. At
top_p = 1 none of this runs.
"""

import contextlib

import torch
from transformers.cache_utils import DynamicLayer

LOGPROB_CHUNK_ELEMENTS = 2**24  # fp32 scratch of one chunk of positions x vocabulary (64 MiB per buffer)
# A forward runs on the prompt and completion columns its rows use. On a GPU each width is rounded up, to a power of
# two up to the device's step, then to a multiple of it, so that a step meets a few attention shapes that recur, not
# a new one for each length: cuDNN's attention builds an execution plan for every new shape, which costs more than
# the padding. Elsewhere (the CPU) no kernel keeps per-shape state, and the widths are exact. Device type -> step.
WIDTH_STEP = {"cuda": 64}
# Causal LMs whose forward ends in `logits = self.lm_head(hidden_states[:, slice_indices, :])` and returns them as
# they are (no soft-capping, no logit scale): the head's output is the policy's logits.
PLAIN_HEAD_MODELS = {"qwen2", "qwen3", "qwen3_moe", "llama", "mistral"}


def textbook_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature,
                      entropy_grad=False):
    """The completion tokens' log-probs and entropies, the textbook way: one forward, the logits over
    the temperature, one log-softmax over the whole (B, T, V), the sampled tokens' entries gathered.

    completion_logprobs (below) returns the same values and gradients without ever holding the
    (B, T, V) float32 tensor this one makes: tests/test_logprobs.py's test_toy_model_matches_naive,
    test_large_vocabulary_matches_naive and test_lora_model_matches_naive hold them equal (at
    top_p 1; with top_p < 1, test_top_p_matches_naive_on_a_large_vocabulary)."""
    T = num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P+T)
    # the logits that predict the T completion tokens: positions P-1 .. P+T-2
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=T + 1).logits[:, :-1]  # (B, T, V)
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32 (float64 stays float64)
    all_logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)  # (B, T, V)
    logp = all_logp.gather(-1, input_ids[:, -T:, None])[..., 0]  # (B, T)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(all_logp.exp() * all_logp).sum(-1)  # (B, T)
    return logp, entropy


def fused_head(model):
    """The LM head module whose forward head_logprobs may replace, or None (then the logits path is used).

    A bias-free nn.Linear (tied to the embeddings or not), or a peft LoRA Linear over one; not under ZeRO-3 with a
    LoRA head, where the base weight and lora_B are gathered only when their own modules run, which they would not.
    """
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):  # DDP, DeepSpeed engine
        inner = inner.module
    config = getattr(inner, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODELS or not hasattr(inner, "get_output_embeddings"):
        return None
    head = inner.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.bias is None:  # not a subclass: quantized layers are Linear too
        return head
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:
        return None
    if not isinstance(head, LoraLinear) or type(head.get_base_layer()) is not torch.nn.Linear:
        return None
    base = head.get_base_layer()
    plain_adapters = all(not head.use_dora.get(a, False) and head.lora_B[a].bias is None for a in head.lora_A)
    zero3 = any(hasattr(p, "ds_id") for p in head.parameters())
    return head if base.bias is None and plain_adapters and not zero3 else None


def head_pairs(head, x: torch.Tensor) -> list[torch.Tensor]:
    """[h_1, W_1, h_2, W_2, ...] with head(x) = sum_k h_k W_k^T: (x, W) for a linear head; LoRA adds, per active
    adapter, (scaling * lora_A(dropout(x)), lora_B.weight), as peft's forward computes it."""
    if type(head) is torch.nn.Linear:
        return [x, head.weight]
    pairs = [x, head.get_base_layer().weight]
    if head.merged or head.disable_adapters:
        return pairs
    for name in head.active_adapters:
        if name in head.lora_A:
            A, B = head.lora_A[name], head.lora_B[name]
            pairs += [A(head.lora_dropout[name](x.to(A.weight.dtype))) * head.scaling[name], B.weight]  # (N, r), (V, r)
    return pairs


@contextlib.contextmanager
def head_logprobs(head, targets: torch.Tensor, mask: torch.Tensor, temperature: float,
                  entropy_grad: bool, top_p: float = 1.0, with_entropy: bool = True):
    """For one forward of the model: its head, given the hidden states of the last T + 1 positions (logits_to_keep),
    returns (B, T, 2) [logp, entropy] of `targets` (B, T) where `mask` (B, T) is set, and 0 elsewhere, in place of
    the (B, T + 1, V) logits. The result is the head's output, so hooks on the head's outputs (ZeRO-3's gather
    before the head's backward, FSDP2's) see it as they would see the logits."""
    T = targets.shape[1]

    def forward(hidden):  # (B, T + 1, D)
        keep = mask.bool()  # (B, T)
        x = hidden[:, :T][keep]  # (N, D) only completion tokens: padding costs nothing in the head
        pairs = head_pairs(head, x)
        logp, entropy = HeadLogprobs.apply(targets[keep], temperature, entropy_grad, top_p, with_entropy,
                                           *pairs)  # (N,) each
        out = logp.new_zeros(*targets.shape, 2)  # (B, T, 2)
        return out.index_put((keep,), torch.stack([logp, entropy], dim=-1))  # (B, T, 2)

    head.forward = forward  # an instance attribute: nn.Module.__call__ and its hooks run as before
    try:
        yield
    finally:
        del head.forward


class HeadLogprobs(torch.autograd.Function):
    """logp_n = z_y - logsumexp(z), H_n = -sum_v p_v log p_v with z = (sum_k h_k W_k^T) / T, one chunk of positions at
    a time (LOGPROB_CHUNK_ELEMENTS), in fp32 (fp64 stays fp64: gradcheck). Saves the inputs, logsumexp and the
    entropy, (N,) each; the backward recomputes each chunk's logits (the Liger / chunked-LM-head idea):

        g = (d logp / dz * grad_logp + d H / dz * grad_H) / T,
        d logp / dz = onehot(y) - p,   d H / dz = -p (log p + H)
        dh_k = g W_k,   dW_k = sum over chunks of g^T h_k   (accumulated in fp32 at least, cast once at the end)

    g is cast to each weight's dtype before its matmuls, as nn.Linear's backward receives the logits' gradient in
    the logits' dtype. Inputs: targets (N,), temperature, entropy_grad, top_p, with_entropy, then h_1 (N, D_1),
    W_1 (V, D_1), h_2, W_2, ... With top_p < 1, p is renormalised over each position's kept set
    (common.nucleus) and is 0 outside it, in the log-prob, the entropy and both derivatives; the
    kept set's floor and log-mass are saved, (N,) each. Without `with_entropy` (the no-grad passes, which
    read only the log-probs) the entropy is 0, and at top_p = 1 a chunk takes only a logsumexp and one gather
    over its logits: no log p, p or sum.
    """

    @staticmethod
    def forward(ctx, targets, temperature, entropy_grad, top_p, with_entropy, *pairs):
        hiddens, weights = pairs[0::2], pairs[1::2]
        N, V = targets.shape[0], weights[0].shape[0]
        ctx.dtype = torch.promote_types(weights[0].dtype, torch.float32)
        logp = torch.empty(N, device=targets.device, dtype=ctx.dtype)  # (N,)
        entropy = torch.empty_like(logp) if with_entropy else torch.zeros_like(logp)  # (N,)
        lse = torch.empty_like(logp)  # (N,)
        width = N if top_p < 1 else 0
        nucleus = logp.new_empty(2, width)  # the kept sets' floor and log-mass
        for c in _chunks(N, V):
            z = scaled(_chunk_logits(hiddens, weights, c, ctx.dtype), temperature)  # (n, V)
            lse[c] = torch.logsumexp(z, dim=-1)  # (n,)
            if top_p < 1:
                from common.nucleus import nucleus_forward

                log_p = z.sub_(lse[c, None])  # (n, V)
                logp[c], kept_entropy = nucleus_forward(log_p, targets[c], top_p, nucleus[:, c])
                entropy[c] = kept_entropy if with_entropy else 0
                continue
            logp[c] = z.gather(-1, targets[c, None])[:, 0] - lse[c]  # (n,)  z_y - logsumexp(z)
            if with_entropy:
                log_p = z.sub_(lse[c, None])  # (n, V)
                entropy[c] = -(log_p.exp().mul_(log_p)).sum(-1)
        ctx.save_for_backward(targets, lse, entropy, nucleus, *pairs)
        ctx.temperature, ctx.top_p = temperature, top_p
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skip its term
        if not (entropy_grad and with_entropy):
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        targets, lse, entropy, nucleus, *pairs = ctx.saved_tensors
        hiddens, weights = pairs[0::2], pairs[1::2]
        needs = ctx.needs_input_grad[5:]  # per entry of pairs
        N, V = targets.shape[0], weights[0].shape[0]
        grad_h = [torch.empty_like(h) if needs[2 * k] else None for k, h in enumerate(hiddens)]  # (N, D_k)
        grad_w = [torch.zeros(w.shape, device=w.device, dtype=torch.promote_types(w.dtype, torch.float32))
                  if needs[2 * k + 1] else None for k, w in enumerate(weights)]  # (V, D_k)
        for c in _chunks(N, V):
            log_p = scaled(_chunk_logits(hiddens, weights, c, ctx.dtype), ctx.temperature).sub_(lse[c, None])  # (n, V)
            if ctx.top_p < 1:  # log p and p of the kept set's distribution (0 outside it)
                from common.nucleus import nucleus_backward

                p = nucleus_backward(log_p, targets[c], nucleus[:, c])  # (n, V)
            else:
                p = log_p.exp()  # (n, V)
            if grad_logp is not None:
                g = p.mul(grad_logp[c, None]).neg_()  # (n, V) d/dz
                g.scatter_add_(-1, targets[c, None], grad_logp[c, None])
            else:
                g = torch.zeros_like(p)
            if grad_entropy is not None:
                g.sub_(log_p.add_(entropy[c, None]).mul_(p).mul_(grad_entropy[c, None]))
            g = scaled(g, ctx.temperature)  # (n, V) d/d(logits)
            for k, (h, w) in enumerate(zip(hiddens, weights)):
                g_k = g.to(w.dtype)  # (n, V)
                if grad_h[k] is not None:
                    grad_h[k][c] = (g_k @ w).to(h.dtype)  # (n, D_k)
                if grad_w[k] is not None:
                    grad_w[k].addmm_(g_k.t().to(grad_w[k].dtype), h[c].to(grad_w[k].dtype))  # (V, D_k)
        grads = [x for k in range(len(hiddens)) for x in (grad_h[k], None if grad_w[k] is None
                                                          else grad_w[k].to(weights[k].dtype))]
        return None, None, None, None, None, *grads


def scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / temperature, in place (at temperature 1, z itself: no pass over a chunk's logits)."""
    return z if temperature == 1 else z.div_(temperature)


def _chunk_logits(hiddens, weights, c: slice, dtype: torch.dtype) -> torch.Tensor:
    """sum_k h_k[c] W_k^T, (n, V): each product in its operands' dtype (bf16 logits as the model's head makes them),
    summed in `dtype` (fp32: a LoRA adapter kept in fp32 over a bf16 base, as peft does, adds as peft adds it)."""
    z = (hiddens[0][c] @ weights[0].t()).to(dtype)  # (n, V)
    for h, w in zip(hiddens[1:], weights[1:]):
        z += (h[c].to(w.dtype) @ w.t()).to(dtype)
    return z


def _chunks(N: int, V: int):
    n = max(1, LOGPROB_CHUNK_ELEMENTS // V)
    for i in range(0, N, n):
        yield slice(i, min(i + n, N))


class TokenLogprobs(torch.autograd.Function):
    """logp_t = z_y - logsumexp(z) and H_t = -sum_v p_v log p_v, z = logits_t / T in fp32, a chunk of positions
    at a time (LOGPROB_CHUNK_ELEMENTS). Saves only the logits (model dtype) and logsumexp (B, T); the backward
    recomputes p per chunk and writes the gradient in the logits' dtype, into the logits themselves when
    `overwrite_logits` (the caller owns them: then the head costs one (B, T, V) buffer, not two):

        d logp_t / dz = onehot(y) - p,    d H_t / dz = -p * (log p + H_t),    d/dlogits = d/dz / T

    With top_p < 1, p is each position's kept set's, renormalised, 0 outside it (as HeadLogprobs); without
    `with_entropy`, the entropy is 0 and its passes are skipped (as HeadLogprobs).
    Against log_softmax over (B, T, V) in fp32 (the naive form), this keeps no fp32 copy of the logits for the
    backward and no full-size fp32 gradient. The logits themselves are made by the model's forward: the path for
    heads that HeadLogprobs cannot replace (fused_head).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy_grad, overwrite_logits=False, top_p=1.0,
                with_entropy=True):
        B, T = targets.shape  # logits (B, >= T, V): position t < T predicts targets[:, t]
        ctx.dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 stays fp64: gradcheck)
        logp = torch.empty(B, T, device=logits.device, dtype=ctx.dtype)  # (B, T)
        entropy = torch.empty_like(logp) if with_entropy else torch.zeros_like(logp)  # (B, T)
        lse = torch.empty_like(logp)  # (B, T)
        shape = (2, B, T) if top_p < 1 else (2, 0, 0)
        nucleus = logp.new_empty(shape)  # the kept sets' floor and log-mass
        for rows, pos in _position_chunks(B, T, logits.shape[-1]):
            z = scaled(logits[rows, pos].to(ctx.dtype, copy=True), temperature)  # (b, t, V)
            lse[rows, pos] = torch.logsumexp(z, dim=-1)  # (b, t)
            if top_p < 1:
                from common.nucleus import nucleus_forward

                log_p = z.sub_(lse[rows, pos, None])  # (b, t, V) log p = z - logsumexp(z)
                logp[rows, pos], kept_entropy = nucleus_forward(log_p, targets[rows, pos], top_p, nucleus[:, rows, pos])
                entropy[rows, pos] = kept_entropy if with_entropy else 0
                continue
            logp[rows, pos] = z.gather(-1, targets[rows, pos, None])[..., 0] - lse[rows, pos]  # (b, t)
            if with_entropy:
                log_p = z.sub_(lse[rows, pos, None])  # (b, t, V)
                entropy[rows, pos] = -(log_p.exp().mul_(log_p)).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy, nucleus)
        ctx.temperature, ctx.overwrite_logits, ctx.top_p = temperature, overwrite_logits, top_p
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skip its term
        if not (entropy_grad and with_entropy):
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse, entropy, nucleus = ctx.saved_tensors
        B, T = targets.shape
        grad = logits if ctx.overwrite_logits else torch.empty_like(logits)  # (B, T + 1, V) model dtype
        grad[:, T:] = 0  # the unused last position; a chunk's logits are read before its gradient is written
        for rows, pos in _position_chunks(B, T, logits.shape[-1]):
            log_p = scaled(logits[rows, pos].to(ctx.dtype, copy=True), ctx.temperature)  # (b, t, V) z
            log_p.sub_(lse[rows, pos, None])  # (b, t, V) log p
            if ctx.top_p < 1:  # log p and p of the kept set's distribution (0 outside it)
                from common.nucleus import nucleus_backward

                p = nucleus_backward(log_p, targets[rows, pos], nucleus[:, rows, pos])  # (b, t, V)
            else:
                p = log_p.exp()  # (b, t, V)
            if grad_logp is not None:
                g = p.mul(grad_logp[rows, pos, None]).neg_()  # (b, t, V) d/dz
                g.scatter_add_(-1, targets[rows, pos, None], grad_logp[rows, pos, None])
            else:
                g = torch.zeros_like(p)
            if grad_entropy is not None:
                g.sub_(log_p.add_(entropy[rows, pos, None]).mul_(p).mul_(grad_entropy[rows, pos, None]))
            grad[rows, pos] = scaled(g, ctx.temperature)
        return grad, None, None, None, None, None, None


def _position_chunks(B: int, T: int, V: int):
    """(rows, positions) slices covering (B, T), each at most LOGPROB_CHUNK_ELEMENTS // V positions: whole rows
    together when they fit (small vocabularies), else a stretch of positions of one row."""
    t = max(1, min(T, LOGPROB_CHUNK_ELEMENTS // V))
    b = max(1, LOGPROB_CHUNK_ELEMENTS // (t * V)) if t == T else 1
    for i in range(0, B, b):
        for j in range(0, T, t):
            yield slice(i, i + b), slice(j, min(j + t, T))  # logits have T + 1 positions: stop at T


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int,
                        temperature: float, entropy_grad: bool = False, share_prompts: bool = False,
                        top_p: float = 1.0, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each completion token under softmax(logits / T), and the entropy there (with its
    gradient only if `entropy_grad`: an entropy bonus needs it, logging does not). With `top_p` < 1,
    under the distribution the sampler draws from: softmax(logits / T) renormalised over each
    position's kept set (common.nucleus), recomputed from these logits, so that their gradients are
    exact (docs/rollouts.md).

    input_ids = [left-padded prompt | right-padded completion], (B, P + T). Returns two (B, T) in fp32, 0 at padding.
    The forward runs on the columns these rows use (the longest prompt and completion among them: rows of similar
    length together waste little, see length_buckets). Where the model's head is a plain linear map (fused_head),
    the log-probs come from the last hidden states through the head's weight, a chunk of positions at a time, and
    only at completion tokens: no (B, T, V) logits (common.logprobs.HeadLogprobs); otherwise from the logits, with
    no fp32 (B, T, V) tensor (TokenLogprobs).
    `share_prompts` (no-grad passes only): rows with the same prompt share one forward of it (shared_prompt_cache).
    `with_entropy` False (passes that read only the log-probs): the entropy is 0, and not computed.
    """
    T, P = num_completion_tokens, input_ids.shape[1] - num_completion_tokens
    used = attention_mask.sum(0) > 0  # (P + T,) the columns some row uses
    # Completions are right-padded (their first T_used columns), prompts left-padded (their last P_used): one sync.
    T_used, P_used = torch.stack([used[P:].sum(), used[:P].sum()]).tolist()
    T_used = max(T_used, 1)
    step = WIDTH_STEP.get(input_ids.device.type, 1)
    T_b, P_b = padded_width(T_used, step), padded_width(P_used, step)  # a few widths that recur (WIDTH_STEP)
    input_ids = widen(input_ids, P, T, P_b, T_b)  # (B, P_b + T_b)
    attention_mask = widen(attention_mask, P, T, P_b, T_b)  # (B, P_b + T_b) 0 on the added columns
    mask = attention_mask[:, P_b:]  # (B, T_b)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    cache = None
    if share_prompts and not torch.is_grad_enabled():
        cache = shared_prompt_cache(model, input_ids, attention_mask, P_b - 1, pad_prefixes=step > 1)
    start = 0 if cache is None else P_b - 1  # with the prompts' cache, run from each prompt's last token on
    targets, head = input_ids[:, -T_b:], fused_head(model)  # (B, T_b)
    entropy_grad = entropy_grad and torch.is_grad_enabled()
    fused = None
    if head is not None:
        fused = head_logprobs(head, targets, mask, temperature, entropy_grad, top_p, with_entropy)
    with contextlib.nullcontext() if fused is None else fused:
        out = model(input_ids=input_ids[:, start:], attention_mask=attention_mask, position_ids=position_ids[:, start:],
                    past_key_values=cache, use_cache=cache is not None,
                    logits_to_keep=T_b + 1).logits  # head: (B, T_b, 2); else (B, T_b + 1, V), t < T_b predicts token t
    if head is not None:
        logp, entropy = out.unbind(-1)  # (B, T_b) each
        entropy = entropy if entropy_grad else entropy.detach()  # its gradient is 0 anyway (HeadLogprobs)
    else:  # nothing else holds these logits: the backward may overwrite them with their gradient (a second
        # backward through a retained graph then fails with autograd's in-place error instead of a wrong gradient)
        logp, entropy = TokenLogprobs.apply(out, targets, temperature, entropy_grad, True, top_p, with_entropy)
        logp, entropy = logp * mask, entropy * mask  # (B, T_b) 0 at padding, as the head's path gives
    if T_b >= T:  # back to the batch's T columns
        return logp[:, :T], entropy[:, :T]
    pad = (0, T - T_b)
    return torch.nn.functional.pad(logp, pad), torch.nn.functional.pad(entropy, pad)


def logprob_metrics(entropy: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """A micro-batch's policy entropy, and how far the policy being trained has moved from the one whose log-probs
    are `old_logp` (the first pass on-policy: not at all), over its valid tokens (mask 1), (b, T) each:

        policy/entropy         the mean entropy
        policy/log_ratio_std   the std of the token log-ratios logp - old_logp: 0 on-policy
        policy/ess             the token ratios' effective sample size, (sum r)^2 / (n sum r^2), in log space: 1 when
                               every ratio is equal (on-policy), near 0 when a few tokens hold the weight

    The same for every estimator, whatever ratio its own loss takes (a sequence's, a prefix's): the regime's
    distance from on-policy, comparable across scripts (docs/metrics.md)."""
    with torch.no_grad():
        valid = mask > 0  # (b, T)
        n = valid.sum()  # ()
        log_ratio = torch.where(valid, logp - old_logp, 0.0)  # (b, T)  0 at padding, whatever old_logp holds there
        mean = log_ratio.sum() / n.clamp(min=1)  # ()
        std = (torch.where(valid, log_ratio - mean, 0.0).square().sum() / n.clamp(min=1)).sqrt()  # ()
        kept = torch.where(valid, log_ratio, -torch.inf)  # (b, T)
        log_ess = 2 * kept.logsumexp((0, 1)) - (2 * kept).logsumexp((0, 1)) - n.clamp(min=1).log()  # ()
        ess = torch.where(n > 0, log_ess.exp(), 1.0)  # ()  a micro-batch without a valid token: nothing moved
        entropy = (entropy * mask).sum() / mask.sum().clamp(min=1)  # ()
    return {"policy/entropy": entropy, "policy/log_ratio_std": std, "policy/ess": ess}


def padded_width(used: int, step: int) -> int:
    """The width a forward runs on for `used` columns: with a step of 1, `used`; else the next power of two up to
    `step`, then the next multiple of `step` (0 stays 0)."""
    if used <= 0 or step <= 1:
        return used
    if used <= step:
        return 1 << (used - 1).bit_length()
    return -(-used // step) * step


def widen(x: torch.Tensor, P: int, T: int, P_b: int, T_b: int) -> torch.Tensor:
    """[prompt, P columns | completion, T columns] (B, P + T) cut or padded with zeros to [P_b | T_b]: the last P_b
    prompt columns (prompts are left-padded) and the first T_b completion columns (completions are right-padded)."""
    prompt = x[:, max(P - P_b, 0):P]  # (B, <= P_b)
    completion = x[:, P:P + T_b]  # (B, <= T_b)
    left = P_b - prompt.shape[1]
    right = T_b - completion.shape[1]
    return torch.nn.functional.pad(torch.cat([prompt, completion], dim=1), (left, right))

def shared_prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int,
                        pad_prefixes: bool = False):
    """The KV cache of the first `length` columns of every (left-padded) row, computed once per distinct prefix
    (GRPO's G completions of a prompt share it) and indexed out to all rows; None, for a plain forward, when no
    prefix repeats or the model's cache is not plain key/value layers (e.g. linear attention's states). Used by
    the no-grad log-prob passes and by HFEngine's prefill. `pad_prefixes`: the prefixes' forward runs on a power of
    two of rows (the first repeated), so that its attention shapes recur from batch to batch."""
    if length < 1:
        return None
    position_ids = (attention_mask[:, :length].cumsum(-1) - 1).clamp(min=0)  # (B, length)
    prefix = torch.cat([input_ids[:, :length], attention_mask[:, :length]], dim=1)  # (B, 2 * length)
    distinct, row_of = torch.unique(prefix, dim=0, return_inverse=True)  # (u, 2 * length), (B,)
    if len(distinct) == len(prefix):
        return None
    first = torch.full((len(distinct),), len(prefix), device=prefix.device).scatter_reduce(
        0, row_of, torch.arange(len(prefix), device=prefix.device), "amin")  # (u,) one row of each prefix
    if pad_prefixes:
        rows = 1 << (len(first) - 1).bit_length()  # (the rows beyond u repeat the first prefix; unused)
        first = torch.cat([first, first[:1].expand(rows - len(first))])  # (rows,)
    cache = model(input_ids=input_ids[first, :length], attention_mask=attention_mask[first, :length],
                  position_ids=position_ids[first, :length], use_cache=True, logits_to_keep=1).past_key_values
    if not all(isinstance(layer, DynamicLayer) for layer in getattr(cache, "layers", [None])):
        return None
    cache.batch_select_indices(row_of)  # (B,) rows
    return cache
