"""End-to-end runs of grpo.py on the toy task (CPU): invariances, resume, LoRA, learning (bad input: test_rails.py)."""

import os
import select
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, launch, learning_bar, read_metrics, run_script, subprocess_env
from safetensors.torch import load_file

import grpo

# One small optimizer step: 4 prompts x G=4, a visible learning rate, no evaluation. The dense toy reward gives
# distinct completions distinct rewards, so the gradient is not zero whatever toy this machine built (TOY_SEED);
# toy_addition's 0/1 rewards are often equal in all four groups of a toy that is right or wrong on all of them.
SMALL = ["--preset", "toy", "--batch_size", "16", "--num_generations", "4", "--eval_steps", "0",
         "--learning_rate", "1e-3", "--total_steps", "1", "--micro_batch_size", "4", "--reward_funcs", "toy_closeness"]


def final_weights(run_dir: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(run_dir, "checkpoints", f"step_{step}", "model", "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float = 1e-6):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-5, msg=name)


def sgd_gradient(cwd, run_name: str, argv: list[str], num_processes: int = 1, script: str = "grpo.py",
                 lr: float = 1.0, config: str | None = None, env: dict | None = None) -> dict[str, torch.Tensor]:
    """Run one step with plain SGD (tests/sgd_runner.py) and read the update back: w0 - w1, the gradient at
    lr 1 (several optimizer steps with --mini_batch_size / --num_iterations: the sum of their lr * gradients).
    `config`: an accelerate config file (conftest.launch)."""
    launch(cwd, script, [*argv, "--learning_rate", str(lr), "--max_grad_norm", "1e9", "--run_name", run_name],
           num_processes, config=config, sgd=True, env=env)
    assert_mixed_rewards(os.path.join(cwd, "runs", run_name))
    w0 = load_file(os.path.join(cwd, "runs", "toy", "model", "model.safetensors"))
    w1 = final_weights(os.path.join(cwd, "runs", run_name), 1)
    return {name: w0[name] - w1[name] for name in w0}


def assert_mixed_rewards(run_dir: str):
    """The precondition of every gradient comparison: some group's rewards differ, else every advantage is 0."""
    m = read_metrics(run_dir)[-1]
    assert m["reward/frac_zero_std_groups"] < 1, (
        f"precondition: every group of {run_dir} has equal rewards, so the gradient is 0 and comparing it says "
        f"nothing; the toy's completions are all alike (reward/std {m['reward/std']}): use a dense reward")


def assert_same_gradient(a: dict, b: dict, atol: float = 5e-7):
    scale = max(g.abs().max().item() for g in a.values())
    assert scale > 100 * atol, (f"precondition: the largest gradient entry is {scale:.2e}, too close to the "
                                f"comparison's tolerance {atol:.0e} for equality to mean anything")
    for name in a:
        # read back as w0 - w1 in float32: a few ulps of weights near 1 (1.2e-7 each) is the floor
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)


@pytest.mark.slow
@pytest.mark.precondition
def test_micro_batch_size_does_not_change_the_gradient(in_toy_workdir):
    grads = {mb: sgd_gradient(in_toy_workdir, f"micro{mb}", SMALL + ["--micro_batch_size", str(mb)])
             for mb in (1, 4, 16)}
    assert_same_gradient(grads[1], grads[16])
    assert_same_gradient(grads[4], grads[16])


def test_sharing_prompts_changes_no_step(in_toy_workdir, monkeypatch):
    """--share_prompts false (each row's whole prompt in one forward, as TRL) against the default (a prompt's rows
    share one forward of it): the same completions and rewards, the same KL to the reference within rounding, over
    two stale steps that need every no-grad pass (old, reference); and the shared forwards happen only by default."""
    import common.logprobs

    calls = []
    plain = common.logprobs.shared_prompt_cache
    monkeypatch.setattr(common.logprobs, "shared_prompt_cache", lambda *a, **k: calls.append(1) or plain(*a, **k))
    import common.engines.rollout

    monkeypatch.setattr(common.engines.rollout, "shared_prompt_cache", common.logprobs.shared_prompt_cache)
    argv = SMALL + ["--total_steps", "2", "--beta", "0.1", "--num_iterations", "2", "--mini_batch_size", "8"]
    runs = {}
    for share in ("true", "false"):
        calls.clear()
        runs[share] = read_metrics(run_script(grpo, argv + ["--share_prompts", share, "--run_name", f"share_{share}"]))
        assert bool(calls) == (share == "true"), (share, len(calls))
    for a, b in zip(runs["true"], runs["false"]):
        assert a["reward/mean"] == b["reward/mean"] and a["completion/tokens"] == b["completion/tokens"]
        assert a["policy/kl"] == pytest.approx(b["policy/kl"], rel=1e-4, abs=1e-7)


@pytest.mark.slow
def test_two_processes_take_the_same_step_as_one(in_toy_workdir):
    argv = SMALL + ["--micro_batch_size", "2", "--beta", "0.1"]
    one = sgd_gradient(in_toy_workdir, "one_process", argv, num_processes=1)
    two = sgd_gradient(in_toy_workdir, "two_processes", argv, num_processes=2)
    m1, m2 = (read_metrics(os.path.join(in_toy_workdir, "runs", r))[-1] for r in ("one_process", "two_processes"))
    assert m1["reward/mean"] == m2["reward/mean"]  # the same completions: sampling does not depend on P
    assert_same_gradient(one, two)


@pytest.mark.slow
def test_mini_batches_and_iterations_match_across_process_counts(in_toy_workdir):
    """Two optimizer steps per batch, two passes: stale old_logp and per-mini-batch statistics. As its siblings, it
    compares the weight change: w0 - w1 after the step's four SGD steps (lr 0.003, the stale tests' STALE_LR,
    tests/test_snib.py) with 1 process and with 2, which is the sum of the four lr * gradients and so holds each."""
    argv = SMALL + ["--micro_batch_size", "2", "--mini_batch_size", "8", "--num_iterations", "2"]
    updates = {n: sgd_gradient(in_toy_workdir, f"mini{n}", argv, num_processes=n, lr=0.003) for n in (1, 2)}
    m1, m2 = (read_metrics(os.path.join("runs", f"mini{n}"))[-1] for n in (1, 2))
    # (the logged ratio mean is a mean over micro-batches, which hold other rows with 2 processes: not compared)
    for m in (m1, m2):
        assert m["policy/ratio_mean"] != 1.0, "precondition: the second pass is not stale: its ratios are all 1"
    assert_same_gradient(updates[1], updates[2], atol=2.4e-7)  # float32 w0 - w1: an ulp of the weights near 1


def run_interrupted(argv: list[str], monkeypatch, at_call: int) -> None:
    """grpo.py with `argv`, interrupted as by Ctrl-C (KeyboardInterrupt) at its `at_call`-th compute_advantages call
    (one per batch trained)."""
    calls, original = {"n": 0}, grpo.compute_advantages

    def interrupt(rewards, args):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise KeyboardInterrupt("simulated interruption")
        return original(rewards, args)

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(grpo, "compute_advantages", interrupt)
        run_script(grpo, argv)


@pytest.mark.slow
def test_resume_continues_exactly(in_toy_workdir, monkeypatch):
    argv = SMALL + ["--total_steps", "4", "--save_steps", "2", "--lr_scheduler_type", "linear", "--warmup_steps", "1"]
    straight = run_script(grpo, argv + ["--run_name", "straight"])

    run_interrupted(argv + ["--run_name", "interrupted"], monkeypatch, at_call=3)  # in step 3
    interrupted = os.path.join("runs", "interrupted")
    assert sorted(os.listdir(os.path.join(interrupted, "checkpoints"))) == ["step_2"]  # the completed one survives

    resumed = run_script(grpo, argv + ["--resume_from", interrupted])
    assert resumed == interrupted
    assert_same_weights(final_weights(straight, 4), final_weights(resumed, 4), atol=0)
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2, 3, 4]
    assert read_metrics(resumed)[-1]["reward/mean"] == read_metrics(straight)[-1]["reward/mean"]


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_or_skipped_for_the_intact_one_before(in_toy_workdir, capsys):
    """One file of the last checkpoint's state truncated to 0 bytes (a full disk, a killed copy): resuming the run
    folder warns and resumes from the checkpoint before it, to the same final weights; naming the damaged checkpoint
    itself is refused in one line, before any weights load."""
    argv = SMALL + ["--total_steps", "4", "--save_steps", "2"]
    straight = run_script(grpo, argv + ["--run_name", "intact"])
    damaged = os.path.join("runs", "damaged")
    shutil.copytree(straight, damaged)
    state = os.path.join(damaged, "checkpoints", "step_4", "state")
    victim = sorted(f for f in os.listdir(state) if f.endswith(".safetensors"))[0]
    open(os.path.join(state, victim), "w").close()
    with pytest.raises(SystemExit) as refused:
        run_script(grpo, argv + ["--resume_from", os.path.join(damaged, "checkpoints", "step_4")])
    assert f"state/{victim} has 0 bytes" in str(refused.value) and "is damaged" in str(refused.value)
    capsys.readouterr()
    resumed = run_script(grpo, argv + ["--resume_from", damaged])
    assert f"checkpoints/step_4 is damaged (state/{victim} has 0 bytes" in capsys.readouterr().err
    assert_same_weights(final_weights(straight, 4), final_weights(resumed, 4), atol=0)
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.precondition
def test_checkpointing_one_layer_in_two_takes_the_same_step(in_toy_workdir):
    """--gradient_checkpointing_every 2 reaches the policy's layers (the first recomputed, the second not) and
    changes no step: the run's gradient is the one without checkpointing."""
    from transformers import AutoTokenizer
    from transformers.modeling_layers import GradientCheckpointingLayer

    from common.args import parse_args
    from common.run import load_models

    flags = ["--gradient_checkpointing", "--gradient_checkpointing_every", "2"]
    args = parse_args(grpo.Args, SMALL + flags)
    model, _ = load_models(args, AutoTokenizer.from_pretrained(args.model))
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) >= 2 and [layer.gradient_checkpointing for layer in layers[:2]] == [True, False]
    assert_same_gradient(sgd_gradient(in_toy_workdir, "every2", SMALL + flags),
                         sgd_gradient(in_toy_workdir, "plain", SMALL))


@pytest.mark.slow
def test_lora_trains_the_adapter_and_uses_the_base_as_reference(in_toy_workdir):
    run = run_script(grpo, SMALL + ["--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj,v_proj",
                                    "--beta", "0.1", "--total_steps", "2", "--run_name", "lora"])
    ckpt = os.path.join(run, "checkpoints", "step_2")
    assert os.path.exists(os.path.join(ckpt, "adapter", "adapter_config.json"))
    merged = load_file(os.path.join(ckpt, "model", "model.safetensors"))
    base = load_file(os.path.join("runs", "toy", "model", "model.safetensors"))
    assert not any("lora" in k for k in merged)
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)
    assert read_metrics(run)[-1]["policy/kl"] > 0  # the policy moved away from the adapter-free base


@pytest.mark.slow
def test_a_cpu_run_from_the_command_line_prints_no_library_warning(toy_workdir):
    """One toy step as a user runs it: stderr holds only the progress bar, and deepspeed (which accelerate imports)
    does not warn that it found no GPU (common/models/placement.py filters that one message)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), "--preset", "toy", "--total_steps", "1",
                           "--eval_steps", "0", "--run_name", "quiet"], cwd=toy_workdir, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert "WARNING" not in output and "Warning" not in output, output[-2000:]
    assert "final checkpoint:" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, said", [("SIGINT", "interrupted"), ("SIGTERM", "terminated (SIGTERM)")])
def test_ctrl_c_prints_one_line_with_the_checkpoint_and_how_to_resume(toy_workdir, signal_name, said):
    """SIGINT (Ctrl-C), or SIGTERM (what a scheduler sends before it kills a job), once the step-2 checkpoint exists:
    no traceback, one line naming it and the resume flag."""
    import signal
    import time

    name = f"ctrl_c_{signal_name}"
    run_dir = os.path.join(toy_workdir, "runs", name)
    argv = ["--preset", "toy", "--total_steps", "10000", "--save_steps", "2", "--eval_steps", "0", "--batch_size", "16",
            "--num_generations", "4", "--micro_batch_size", "16", "--run_name", name]
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "grpo.py"), *argv], cwd=toy_workdir,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not os.path.isdir(os.path.join(run_dir, "checkpoints", "step_2")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signal_name))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in out + err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{said}: the last checkpoint of runs/{name} is checkpoints/step_"), err[-3000:]
    assert last.endswith(f"resume with the same command and --resume_from runs/{name}"), last


def read_line(proc, timeout: float = 60) -> str:
    """The next line the process prints, or fail after `timeout` seconds (never hang the test)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("slow_unwind, library_handler", [(False, False), (True, False), (False, True)])
def test_a_second_ctrl_c_exits_at_once_during_a_slow_shutdown(tmp_path, slow_unwind, library_handler):
    """After the first Ctrl-C, the shutdown may hang (an engine or a process group that does not answer, here an
    exit handler that shrugs off KeyboardInterrupt): the second Ctrl-C ends the process at once, with code 130;
    also while the first one's KeyboardInterrupt is still unwinding the run, before `launch` catches it (here a
    `finally` that hangs), and when a library replaced the SIGINT handler during the run (its own handler raised the
    first one). The second Ctrl-C is sent once the process says it is in the slow part: two signals sent in the same
    instant merge into one (the kernel keeps one pending SIGINT, Python one flag), which no handler can tell apart."""
    import signal
    import time

    script = tmp_path / "slow_exit.py"
    script.write_text(f"""import atexit, dataclasses, signal, sys, time
sys.path.insert(0, {REPO!r})
from common.run import launch

def stubborn_cleanup():
    print("exiting", flush=True)
    while True:
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            pass

@dataclasses.dataclass
class Args:
    pass

def main(args):
    atexit.register(stubborn_cleanup)
    if {library_handler!r}:  # as a library might: its own handler, which raises KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        print("ready", flush=True)  # inside the try: a Ctrl-C right after it still unwinds through finally
        time.sleep(60)
    finally:
        if {slow_unwind!r}:  # a cleanup on the way out that hangs (an engine's context manager, say)
            print("unwinding", flush=True)
            time.sleep(60)

launch(main, Args)
""")
    proc = subprocess.Popen([sys.executable, str(script)], env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert read_line(proc) == "ready", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGINT)
        assert read_line(proc) == ("unwinding" if slow_unwind else "exiting")  # in the slow part now
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()  # without the rule, the stubborn handler would outlive the test
    assert proc.returncode == 130 and time.monotonic() - start < 5, (proc.returncode, err[-2000:])
    if not slow_unwind:
        assert "interrupted before training started" in err


def test_a_signal_after_the_run_ended_exits_quietly(tmp_path):
    """A refused multi-process run: every process raises the refusal, the first to exit makes the launcher SIGTERM
    the others, and one may get it while it is still exiting (its atexit handlers, here one that waits). That signal
    ends it at once, without a traceback of ours; it raised KeyboardInterrupt outside `launch` before."""
    import signal

    script = tmp_path / "refused.py"
    script.write_text(f"""import atexit, dataclasses, sys, time
sys.path.insert(0, {REPO!r})
from common.run import launch

def exiting():
    print("exiting", flush=True)
    time.sleep(60)

@dataclasses.dataclass
class Args:
    pass

def main(args):
    atexit.register(exiting)
    raise SystemExit("error: refused")

launch(main, Args)
""")
    proc = subprocess.Popen([sys.executable, str(script)], env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert read_line(proc) == "exiting", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "error: refused" in err, err[-2000:]


@pytest.mark.slow
def test_a_reward_function_that_raises_mid_run_names_step_function_sample_and_shows_only_its_own_frames(
        toy_workdir, tmp_path):
    """It passes the trial call (the reference answers as completions) and raises on the first wrong completion: the
    run stops with the user's traceback (their frames only), one error naming the step, the function and the sample,
    and the resume line."""
    (tmp_path / "flaky_reward.py").write_text(
        "def parse(completion, answer):\n"
        "    if completion.strip() != str(answer):\n"
        "        raise ValueError('boom: ' + completion)\n"
        "    return 1.0\n\n\n"
        "def reward(prompts, completions, answer, **_):\n"
        "    return [parse(c, a) for c, a in zip(completions, answer)]\n")
    argv = SMALL + ["--reward_funcs", "flaky_reward:reward", "--run_name", "flaky"]
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), *argv], cwd=toy_workdir, env=env,
                          capture_output=True, text=True, timeout=600)
    err = done.stderr
    assert done.returncode == 1, err[-3000:]
    assert 'flaky_reward.py", line 3, in parse' in err and "ValueError: boom" in err, err[-3000:]
    assert "common/tasks/rewards.py" not in err and "common/run.py" not in err, err[-3000:]  # our frames stay out
    assert "error: step 1: reward function 'reward' raised ValueError: boom" in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("runs/flaky has no checkpoint yet"), err[-3000:]


def test_toy_learns(in_toy_workdir):
    """A shortened toy run: held-out greedy accuracy must rise (the full preset is measured in README)."""
    run = run_script(grpo, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25", "--run_name", "learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("grpo"), evals


def test_a_reward_function_that_never_returns_stops_the_run_naming_it(toy_workdir, tmp_path):
    """A reward that answers the trial call, then hangs (a grading service that stopped answering): the run stops
    after --reward_timeout with one error naming the step and the function, then the resume line; no hang."""
    (tmp_path / "hanging_reward.py").write_text(
        "import time\n\n\n"
        "def reward(prompts, completions, answer, **_):\n"
        "    if completions != [str(a) for a in answer]:  # the trial call passes the answers as completions\n"
        "        time.sleep(3600)\n"
        "    return [1.0] * len(completions)\n")
    argv = SMALL + ["--reward_funcs", "hanging_reward:reward", "--reward_timeout", "3", "--run_name", "hanging"]
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), *argv], cwd=toy_workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    err = done.stderr
    assert done.returncode == 1, err[-3000:]
    assert ("error: step 1: reward function 'reward' did not return within 3 s (--reward_timeout): it hangs, or it "
            "needs a higher --reward_timeout") in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("runs/hanging has no checkpoint yet"), err[-3000:]


def test_a_stopped_run_offers_a_resume_only_from_a_complete_checkpoint(tmp_path):
    """Issue 68, item 3: the line a stopped run ends with offers --resume_from only where a
    complete checkpoint exists (the toy's quick start, which saved nothing before, said "resume
    with ... --resume_from", and that resume was refused); an interrupted save (step_N.tmp) is no
    checkpoint."""
    from common.run import where_to_resume

    run_dir = str(tmp_path / "run")
    os.makedirs(os.path.join(run_dir, "checkpoints", "step_100.tmp"))
    assert where_to_resume(run_dir, 100) == (
        f"{run_dir} has no checkpoint yet (--save_steps 100: the first at step 100), so there is "
        f"nothing to resume: run the command again")
    assert "(--save_steps 0: only at the end)" in where_to_resume(run_dir, 0)
    os.makedirs(os.path.join(run_dir, "checkpoints", "step_100"))
    assert where_to_resume(run_dir, 100) == (
        f"the last checkpoint of {run_dir} is checkpoints/step_100; resume with the same command "
        f"and --resume_from {run_dir}")


def test_the_toy_quick_start_keeps_a_checkpoint_to_resume_from():
    """`python grpo.py --preset toy` saves at least five times in its run (every 100 of its 500
    steps, under a minute on a 2-core CPU), so a stop loses less than a fifth of it."""
    from common.args import parse_args

    args = parse_args(grpo.Args, ["--preset", "toy"])
    assert 0 < args.save_steps <= args.total_steps // 5, (args.save_steps, args.total_steps)


def test_step_0_held_out_accuracy_is_printed(in_toy_workdir, capsys):
    """Issue 68, item 3: the accuracy before training is on the console (it was in metrics.jsonl
    only), before the first step's line."""
    argv = SMALL + ["--eval_steps", "1", "--eval_num_prompts", "8", "--run_name", "step_0"]
    run = run_script(grpo, argv)
    out = capsys.readouterr().out
    [step_0] = [m["eval/accuracy"] for m in read_metrics(run) if m["step"] == 0]
    assert f"step 0: held-out accuracy {step_0:.1%}\n" in out, out[-2000:]
    first = out.index("step 0: held-out accuracy")
    assert first < out.index("step 1: held-out accuracy"), out[-2000:]
