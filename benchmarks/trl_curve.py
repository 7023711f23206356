"""TRL's learning curve on grpo.py's work: TRL 1.16's GRPOTrainer trained on exactly what
`benchmarks/step_time.py --trl` maps from grpo.py's flags (the same model, prompts in the same order, reward
functions, group size, completion budget, learning rate, steps), with held-out greedy accuracy measured as grpo.py
measures it (common/run.py `evaluate`: the first reward function over greedy completions of the eval set, made by
the same engine, common/engines/rollout.py HFEngine) at step 0 and every --eval_steps steps.

    python benchmarks/trl_curve.py --preset smollm2 --threads 2 --out runs/benchmarks/trl_curve_smollm2.json

Writes --out (JSON: per evaluation the step, held-out accuracy, wall and CPU seconds since the start of training;
per step TRL's logged reward, mean completion length, clipped ratio, gradient norm and entropy) and prints one line
per evaluation. Its step 0 must equal grpo.py's (the same model, prompts and greedy decoding): the script checks
nothing else about the curve. Any other grpo.py flag after `--`.
"""

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2", help="grpo.py's --preset (toy or smollm2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default="runs/benchmarks/trl_curve.json", help="JSON report")
    parser.add_argument("extra", nargs="*", help="grpo.py flags after --, e.g. -- --total_steps 4 --eval_steps 2")
    a = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)

    import torch
    from accelerate import Accelerator
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from benchmarks.step_time import trl_config_and_data
    from common.engines.rollout import HFEngine
    from common.run import load_data
    from common.tasks.reward_names import get_reward_function

    torch.set_num_threads(a.threads)
    args, config, dataset, tokenizer = trl_config_and_data(["--preset", a.preset, *a.extra], a.threads)
    if args.eval_steps <= 0:
        raise SystemExit("error: --eval_steps must be at least 1: the curve is the held-out accuracy every N steps")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    eval_data = load_data(args, tokenizer, accelerator)[1]
    if eval_data is None:
        raise SystemExit(f"error: --preset {a.preset} has no held-out set to evaluate on")
    reward = get_reward_function(args.reward_funcs.split(",")[0])
    columns = {c: eval_data[c] for c in eval_data.column_names if c not in ("prompt", "prompt_text", "prompt_ids")}
    engine, curve, training = HFEngine(tokenizer, accelerator), [], []
    start = [time.perf_counter(), time.process_time()]

    def held_out(model, step: int) -> None:  # grpo.py's eval/accuracy (common/run.py evaluate), timed outside
        paused = time.perf_counter(), time.process_time()
        model.eval()
        ids = engine.generate(model, eval_data["prompt_ids"], [0] * len(eval_data), temperature=0.0, top_p=1.0,
                              max_tokens=args.max_completion_length)[0]
        model.train()
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        accuracy = sum(reward(eval_data["prompt"], texts, **columns)) / len(texts)
        # milliseconds: two tiny steps of a test take under 0.05 s, which a tenth of a second rounds to 0
        curve.append({"step": step, "accuracy": accuracy, "wall_s": round(paused[0] - start[0], 3),
                      "cpu_s": round(paused[1] - start[1], 3)})
        print(f"step {step}: held-out accuracy {accuracy:.1%} ({curve[-1]['wall_s']:.0f} s of training, "
              f"{curve[-1]['cpu_s']:.0f} s CPU)", flush=True)
        start[0] += time.perf_counter() - paused[0]  # evaluation time is not training time
        start[1] += time.process_time() - paused[1]

    class Evaluate(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kw):
            start[:] = [time.perf_counter(), time.process_time()]
            held_out(model, 0)

        def on_log(self, targs, state, control, logs=None, **kw):  # TRL's own per-step training metrics
            if logs and "reward" in logs:
                keep = ("reward", "completions/mean_length", "completions/clipped_ratio", "grad_norm", "entropy")
                training.append({"step": state.global_step, **{k: logs[k] for k in keep if k in logs}})

        def on_step_end(self, targs, state, control, model=None, **kw):
            if state.global_step % args.eval_steps == 0 or state.global_step == args.total_steps:
                held_out(model, state.global_step)

    funcs = [get_reward_function(name) for name in args.reward_funcs.split(",")]
    trainer = GRPOTrainer(model=args.model, reward_funcs=funcs, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Evaluate()])
    trainer.train()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"preset": a.preset, "argv": a.extra, "threads": a.threads, "curve": curve,
                   "training": training, "trl_version": __import__("trl").__version__}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
