"""What sharing each prompt's forward among its completions would save in the update (with gradients), and that it
computes the same thing: one micro-batch of random tokens, forward and backward of the completions' log-probs,
plain (common.logprobs.completion_logprobs, as the scripts' update runs it today) against shared (the prompts run
once through common.logprobs.shared_prompt_cache, the completions on that cache, gradients flowing through it).

    python benchmarks/shared_prompt_grad.py --model runs/smollm2/model --rows 8 --prompt 50 --completion 33

Prints, for 1, 2, 4 ... distinct prompts among --rows rows, the seconds of each (the faster of --repeat tries), the
largest log-prob difference and the relative difference of the gradients. One thread unless --threads.
"""

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def forward_backward(model, ids, mask, T: int, share: bool):
    """Seconds, (rows, T) log-probs and the flat gradient of their sum."""
    import torch

    from common.logprobs import completion_logprobs, fused_head, head_logprobs, shared_prompt_cache

    model.zero_grad()
    start = time.perf_counter()
    if share:
        P = ids.shape[1] - T
        cache = shared_prompt_cache(model, ids, mask, P - 1)  # with gradients: this forward is in the graph
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        with head_logprobs(fused_head(model), ids[:, P:], mask[:, P:], 1.0, False):
            logp = model(input_ids=ids[:, P - 1:], attention_mask=mask, position_ids=position_ids[:, P - 1:],
                         past_key_values=cache, use_cache=True, logits_to_keep=T + 1).logits[..., 0]
    else:
        logp = completion_logprobs(model, ids, mask, T, 1.0)[0]
    logp.sum().backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return time.perf_counter() - start, logp.detach(), grad


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/smollm2/model", help="a model folder (python -m common.tasks.smollm2 "
                        "smollm2 builds this one)")
    parser.add_argument("--rows", type=int, default=8, help="rows in the micro-batch")
    parser.add_argument("--prompt", type=int, default=50, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=33, help="completion tokens")
    parser.add_argument("--distinct", default="1,2,4", help="distinct prompts among the rows, comma-separated")
    parser.add_argument("--repeat", type=int, default=2, help="tries of each; the fastest is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    a = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    V, results = model.config.vocab_size, []
    for k in map(int, a.distinct.split(",")):
        if a.rows % k:
            raise SystemExit(f"error: --distinct {k} does not divide --rows {a.rows}")
        prompts = torch.randint(3, V, (k, a.prompt)).repeat_interleave(a.rows // k, 0)  # (rows, P)
        ids = torch.cat([prompts, torch.randint(3, V, (a.rows, a.completion))], 1)  # (rows, P + T)
        mask = torch.ones_like(ids)
        runs = {share: [forward_backward(model, ids, mask, a.completion, share) for _ in range(a.repeat)]
                for share in (False, True)}
        (_, lp, gp), (_, ls, gs) = runs[False][-1], runs[True][-1]
        r = {"distinct": k, "plain_s": min(t for t, _, _ in runs[False]), "shared_s": min(t for t, _, _ in runs[True]),
             "logp_max_diff": float((lp - ls).abs().max()), "grad_rel_diff": float((gp - gs).norm() / gp.norm())}
        results.append(r)
        print(f"{k} distinct prompt(s) in {a.rows} rows: plain {r['plain_s']:.2f} s, shared {r['shared_s']:.2f} s; "
              f"log-probs within {r['logp_max_diff']:.1e}, gradients within {r['grad_rel_diff']:.1e} (relative)")
    return results


if __name__ == "__main__":
    main()
