"""Time of one no-grad log-prob pass (the reference / old log-probs) over a toy batch, by rows per forward and with
or without shared prompts (common.logprobs.shared_prompt_cache): what --logprob_batch_size and prompt sharing buy.

    python benchmarks/logprob_passes.py                       # toy model, 32 prompts x G = 8, one thread
    python benchmarks/logprob_passes.py --sizes 64,256 --repeat 50

The batch is the toy's first --prompts training prompts, each G times, with completions sampled by HFEngine
(as in a training step). Prints milliseconds per pass (median of --repeat), and the largest difference of the
log-probs from the plain forward's.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from common.engines.rollout import HFEngine  # noqa: E402
from common.logprobs import completion_logprobs
from common.sampling import pad_rows  # noqa: E402
from common.tasks.data import load_prompts  # noqa: E402
from common.tasks.toy import TOY_DIR, TOY_PRESET, prepare_toy  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--sizes", default="64,128,256", help="rows per forward, comma-separated")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    prepare_toy(TOY_DIR)
    path = TOY_PRESET["model"]
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    data = load_prompts(tokenizer, TOY_PRESET["dataset"], None, "train", prompt_column="prompt", answer_column="answer")
    prompt_ids = [p for p in data.select(range(a.prompts))["prompt_ids"] for _ in range(a.num_generations)]
    completions, _ = HFEngine(tokenizer, Accelerator(cpu=True)).generate(
        model, prompt_ids, list(range(len(prompt_ids))), max_tokens=TOY_PRESET["max_completion_length"],
        temperature=1.0, top_p=1.0)
    prompts_t, completions_t = pad_rows(prompt_ids, tokenizer.pad_token_id, left=True), pad_rows(completions, 0)
    mask = pad_rows([[1] * len(c) for c in completions], 0)
    input_ids = torch.cat([prompts_t, completions_t], dim=1)
    attention_mask = torch.cat([pad_rows([[1] * len(p) for p in prompt_ids], 0, left=True), mask], dim=1)
    T, B = mask.shape[1], len(prompt_ids)

    def one_pass(size: int, share: bool) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([completion_logprobs(model, input_ids[i:i + size], attention_mask[i:i + size], T, 1.0,
                                                  share_prompts=share)[0] for i in range(0, B, size)])

    plain = one_pass(B, False)
    results = []
    print(f"{B} rows ({a.prompts} prompts x G = {a.num_generations}), width {input_ids.shape[1]}, "
          f"{a.threads} thread(s)")
    print("| rows per forward | shared prompts | ms per pass | max |logp - plain| |\n|---|---|---|---|")
    for size in map(int, a.sizes.split(",")):
        for share in (False, True):
            for _ in range(3):
                one_pass(size, share)
            times = []
            for _ in range(a.repeat):
                start = time.perf_counter()
                out = one_pass(size, share)
                times.append(1000 * (time.perf_counter() - start))
            diff = ((out - plain) * mask).abs().max().item()
            results.append({"rows": size, "share_prompts": share, "ms": statistics.median(times), "max_diff": diff})
            print(f"| {size} | {share} | {statistics.median(times):.1f} | {diff:.1e} |")
    os.makedirs("runs/benchmarks", exist_ok=True)
    with open("runs/benchmarks/logprob_passes.json", "w") as f:
        json.dump({"settings": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
