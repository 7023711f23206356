"""common/: data loading and templates, reproducible HF sampling, batch geometry, argument layers."""

import json
import os
import sys
import time

import datasets
import psutil
import pytest
import torch
from accelerate import Accelerator
from conftest import run_bounded
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.args import parse_args
from common.engines.rollout import HFEngine, SeededSampler, row_uniforms, sample_seed
from common.logprobs import completion_logprobs
from common.models.placement import padding_safe_attention, prepare_policy
from common.sampling import pad_rows, step_prompts
from common.tasks.data import load_prompts, resolve_dataset
from common.tasks.toy import TOY_DIR

ROWS = [{"q": "1+2=", "a": "3", "level": 1}, {"q": "10+20=", "a": "30", "level": 2}]


@pytest.fixture(scope="module")
def toy(toy_workdir):
    path = os.path.join(toy_workdir, TOY_DIR, "model")
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def test_presets_resolve_and_explicit_columns_win():
    spec = resolve_dataset("gsm8k", None, None, None)
    assert (spec["path"], spec["name"], spec["prompt_column"], spec["answer_column"]) == \
        ("openai/gsm8k", "main", "question", "answer")
    assert resolve_dataset("math", None, "question", None)["prompt_column"] == "question"
    assert resolve_dataset("my/data", None, None, None)["prompt_column"] == "prompt"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "folder", "save_to_disk"])
def test_local_formats_load_through_load_dataset(tmp_path, toy, fmt):
    tokenizer, _ = toy
    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / "data"
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif fmt == "folder":
        path.mkdir()
        ds.to_json(str(path / "train.jsonl"))
    else:
        datasets.DatasetDict({"train": ds}).save_to_disk(str(path))
    out = load_prompts(tokenizer, str(path), None, "train", "q", "a")
    assert out["prompt"] == ["1+2=", "10+20="] and out["answer"] == ["3", "30"]
    assert out["level"] == [1, 2]  # other columns travel to the reward functions
    assert out["prompt_ids"][0] == tokenizer("1+2=")["input_ids"]


def test_template_chat_template_and_length_filter(tmp_path, toy):
    tokenizer, _ = toy
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    raw = load_prompts(tokenizer, str(path), None, "train", "q", "a", template="Q:{prompt}", max_prompt_length=6)
    assert raw["prompt_text"] == ["Q:1+2="]  # the 8-character prompt was dropped
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                               "{% if enable_thinking %}T{% endif %}{% if add_generation_prompt %}A{% endif %}")
    chat = load_prompts(tokenizer, str(path), None, "train", "q", "a", system_prompt="S", enable_thinking=True)
    assert chat["prompt_text"][0] == "<system>S<user>1+2=TA"
    with pytest.raises(ValueError, match="must contain"):
        load_prompts(tokenizer, str(path), None, "train", "q", "a", template="no placeholder")


def test_hf_sampling_depends_only_on_the_seed(toy):
    tokenizer, model = toy
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "45+67=", "9+9=", "12+88="]]
    seeds = [sample_seed(7, 3, i, 0) for i in range(4)]
    kw = dict(max_tokens=6, temperature=1.0, top_p=1.0)
    together, logp = engine.generate(model, prompts, seeds, batch_size=4, **kw)
    one_by_one, _ = engine.generate(model, prompts, seeds, batch_size=1, **kw)
    reversed_, _ = engine.generate(model, prompts[::-1], seeds[::-1], batch_size=3, **kw)
    assert together == one_by_one == reversed_[::-1]
    many_a, _ = engine.generate(model, prompts * 8, list(range(32)), **kw)
    many_b, _ = engine.generate(model, prompts * 8, list(range(32, 64)), **kw)
    assert many_a != many_b  # other seeds, other samples
    with pytest.raises(ValueError, match="one seed per prompt"):
        engine.generate(model, prompts, seeds[:3], **kw)

    # the sampler's log-probs are the trainer's: log_softmax(logits / T) at the sampled tokens
    ids = torch.cat([pad_rows(prompts, tokenizer.pad_token_id, left=True),
                     pad_rows(together, tokenizer.pad_token_id)], dim=1)
    mask = pad_rows([[1] * len(c) for c in together], 0)
    attention = torch.cat([pad_rows([[1] * len(p) for p in prompts], 0, left=True), mask], dim=1)
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, ids, attention, mask.shape[1], 1.0)
    torch.testing.assert_close(trainer * mask, pad_rows(logp, 0.0) * mask, atol=1e-4, rtol=1e-4)


def test_default_generate_batch_is_a_token_budget(toy, monkeypatch):
    """Rows per `generate` call: as many as fit GENERATE_BATCH_TOKENS of (longest prompt + max_tokens)."""
    import common.engines.rollout

    tokenizer, model = toy
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "45+67=", "9+9=", "12+88=", "3+4="]]  # longest: 6
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(len(kw["input_ids"])) or generate(**kw))
    kw = dict(max_tokens=4, temperature=1.0, top_p=1.0)
    together, _ = engine.generate(model, prompts, list(range(5)), **kw)
    assert calls == [5]
    monkeypatch.setattr(common.engines.rollout, "GENERATE_BATCH_TOKENS", 2 * (6 + 4))
    calls.clear()
    assert engine.generate(model, prompts, list(range(5)), **kw)[0] == together
    assert calls == [2, 2, 1]


def test_repeated_prompts_are_prefilled_once(toy):
    """G samples of a prompt share one prefill of it (common.logprobs.shared_prompt_cache); the samples and their
    log-probs are those of a plain `generate` (--share_prompts false), left padding included."""
    tokenizer, model = toy
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    distinct = [tokenizer(p)["input_ids"] for p in ["1+2=", "45+67=", "9+9="]]  # lengths 4, 6, 4: left padding
    prompts = [p for p in distinct for _ in range(4)] + [distinct[0]]  # a repeat that is not next to its group
    seeds, kw = list(range(len(prompts))), dict(max_tokens=5, temperature=1.0, top_p=1.0)
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    try:
        shared, shared_logp = engine.generate(model, prompts, seeds, **kw)
        assert shapes[0] == (3, 5) and shapes[1] == (13, 1)  # 3 distinct prompts less their last token, then 1 token
        shapes.clear()
        plain, plain_logp = HFEngine(tokenizer, Accelerator(cpu=True), share_prompts=False).generate(
            model, prompts, seeds, **kw)  # --share_prompts false
        assert shapes[0] == (13, 6)  # every row's whole prompt
    finally:
        hook.remove()
    assert shared == plain
    torch.testing.assert_close(pad_rows(shared_logp, 0.0), pad_rows(plain_logp, 0.0), atol=1e-5, rtol=1e-5)


def test_sampling_follows_the_temperature(toy):
    """Inverse-CDF sampling: the empirical frequency of the first token matches softmax(logits / T)."""
    tokenizer, model = toy
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    prompt = tokenizer("37+48=")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.7, -1)
    n = 4000
    out, _ = engine.generate(model, [prompt] * n, list(range(n)), max_tokens=1, temperature=0.7, top_p=1.0,
                             batch_size=n)
    freq = torch.bincount(torch.tensor([c[0] for c in out]), minlength=len(probs)).float() / n
    assert (freq - probs).abs().max() < 0.03


def draw(sampler: SeededSampler, logits: torch.Tensor) -> torch.Tensor:
    """(B,) the tokens the sampler picks from logits (B, V): generate's greedy choice on its scores."""
    return sampler(torch.zeros(len(logits), 1, dtype=torch.long), logits).argmax(-1)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_the_sampler_draws_from_the_kept_distribution(top_p):
    """Hand-made logits: each token's frequency over 20,000 rows (one seed each) is its probability under
    softmax(logits / T), renormalised over the kept set at top_p < 1; a dropped token is never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    p = torch.softmax(logits / 0.8, -1)
    if top_p < 1:  # p = [.65, .19, .10, .05, .02, 0]: .65 < .7 <= .65 + .19, so the two most probable are kept
        p = torch.tensor([p[0], p[1], 0, 0, 0, 0]) / (p[0] + p[1])
    n = 20_000
    sampler = SeededSampler(list(range(n)), 0.8, top_p, tokens=1)
    freq = torch.bincount(draw(sampler, logits.expand(n, -1)), minlength=6).double() / n
    assert (freq - p.double()).abs().max() < 0.015, (freq, p)
    assert (freq[p == 0] == 0).all()


def test_a_uniform_next_to_1_draws_the_last_token_that_can_be_drawn():
    """The largest double below 1 draws the last token of non-zero probability, never one top_p dropped after it
    (the cdf is normalised to end at exactly 1; scaling the uniform by the sum instead can round up to it)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0, 2.5]])
    for top_p, last_kept in [(1.0, 4), (0.8, 4), (0.5, 1)]:
        sampler = SeededSampler([0], 1.0, top_p, tokens=1)
        sampler.uniforms.fill_(1 - 2**-53)  # (tokens, rows)
        assert draw(sampler, logits).item() == last_kept
        sampler = SeededSampler([0], 1.0, top_p, tokens=1)
        sampler.uniforms.fill_(0.0)
        assert draw(sampler, logits).item() == (0 if top_p == 1 else 1)  # the first token that can be drawn


def test_a_rows_draws_depend_only_on_its_seed_and_position():
    """Row r's t-th uniform is its generator's t-th draw: the same in a call of any length, beside any rows."""
    alone = row_uniforms([11], 5)
    together = row_uniforms([3, 11, 7], 40)
    assert torch.equal(together[1, :5], alone[0])
    assert together.dtype == torch.float64 and 0 <= together.min() and together.max() < 1
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    batch = draw(SeededSampler([3, 11, 7], 1.0, 1.0, tokens=1), logits)
    assert draw(SeededSampler([11], 1.0, 1.0, tokens=1), logits[1:2]).item() == batch[1].item()


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_samplers_work_per_token_does_not_grow_with_the_batch(top_p):
    """Issue 50: the sampler dispatches as many operations (kernel launches on a GPU) per token for 64 rows as for
    one; one generator per row drawing each token's noise made ~77 launches a token at 64 rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for rows in (1, 64):
        sampler = SeededSampler(list(range(rows)), 1.0, top_p, tokens=3)
        logits = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows))
        input_ids = torch.zeros(rows, 1, dtype=torch.long)
        sampler(input_ids, logits)  # the first token: nothing to record yet
        with Count() as count:
            sampler(input_ids, logits)  # a later token: records the previous one's log-prob, then draws
        counts.append(count.ops)
    assert counts[0] == counts[1] and counts[0] <= 30, counts


def test_the_trainer_and_the_engine_turn_off_the_attention_kernel_that_padding_breaks(monkeypatch):
    """cuDNN's attention returns NaN for left padding's query rows (docs/gpu.md): the HF engine and prepare_policy
    (every script calls it before its first forward) turn it off; the flag is global, so it is read on the CPU."""
    class Accelerator:
        state = None  # no DeepSpeed

        def prepare(self, *objects):
            return objects

    for turn_off in [lambda: HFEngine(None, None), lambda: prepare_policy(Accelerator(), 1, 1.0, None, None, None),
                     padding_safe_attention]:
        torch.backends.cuda.enable_cudnn_sdp(True)
        turn_off()
        assert not torch.backends.cuda.cudnn_sdp_enabled()


def checkpointed_step(every: int) -> tuple[list[bool], int, torch.Tensor]:
    """A 4-layer Qwen3 with random weights (the same each call), one forward and backward under
    `checkpoint_layers(model, every)` (0: no checkpointing): which layers are checkpointed, the bytes
    autograd keeps for the backward (the tensors saved outside a checkpointed layer, the ones that stay
    in memory until the backward), and the gradient of every parameter, flattened."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    from common.run import checkpoint_layers

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128, tie_word_embeddings=True,
                         attn_implementation="sdpa", use_cache=False)
    model = Qwen3ForCausalLM(config).train()
    if every:
        checkpoint_layers(model, every)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    input_ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    kept = []

    def pack(tensor):
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids).logits.logsumexp(-1).mean()
    loss.backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    return [layer.gradient_checkpointing for layer in layers], sum(kept), gradient


def test_checkpointing_one_layer_in_k_keeps_the_gradient_and_part_of_the_memory():
    """--gradient_checkpointing_every K: layers 0, K, 2K, ... recompute their forward in the backward, the others
    keep their activations. The gradient is the same at every K; the kept bytes fall with the share of layers
    checkpointed, so K = 2 keeps the midpoint of K = 1 and none (the layers are alike)."""
    _, kept_none, gradient = checkpointed_step(0)
    flags, kept_all, gradient_all = checkpointed_step(1)
    assert flags == [True, True, True, True]
    torch.testing.assert_close(gradient_all, gradient, rtol=1e-5, atol=1e-8)
    flags, kept_half, gradient_half = checkpointed_step(2)
    assert flags == [True, False, True, False]
    torch.testing.assert_close(gradient_half, gradient, rtol=1e-5, atol=1e-8)
    flags, kept_quarter, _ = checkpointed_step(4)
    assert flags == [True, False, False, False]
    assert kept_all < kept_half < kept_quarter < kept_none, (kept_all, kept_half, kept_quarter, kept_none)
    assert kept_all < kept_none / 4  # checkpointing saves most of the memory, or this measures nothing
    assert abs(kept_half - (kept_all + kept_none) / 2) < 0.02 * kept_none
    assert abs(kept_quarter - (kept_all + 3 * kept_none) / 4) < 0.02 * kept_none


def test_step_prompts_partition_the_global_batch():
    args = dict(batch_size=32, num_generations=4, mini_batch_size=16, dataset_size=10, seed=3)
    one_pos, one_rows = step_prompts(5, num_processes=1, process_index=0, **args)
    parts = [step_prompts(5, num_processes=2, process_index=p, **args) for p in range(2)]
    assert sorted(parts[0][0] + parts[1][0]) == list(range(8))
    assert parts[0][0] == [0, 1, 4, 5]  # a contiguous half of each mini-batch
    by_position = dict(zip(one_pos, one_rows))
    assert all(by_position[pos] == row for pos, row in zip(*parts[0]))
    whole = step_prompts(0, num_processes=1, process_index=0, **{**args, "batch_size": 40, "mini_batch_size": 0})
    assert len(set(whole[1])) == 10


def test_preset_then_config_then_command_line(tmp_path):
    import grpo

    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 0.5\nbatch_size: 64\n")
    args = parse_args(grpo.Args, ["--preset", "toy", "--config", str(recipe), "--batch_size", "32"])
    assert (args.reward_funcs, args.learning_rate, args.batch_size) == ("toy_addition", 0.5, 32)
    bad = tmp_path / "bad.yaml"
    bad.write_text("not_a_field: 1\n")
    with pytest.raises(SystemExit, match="not_a_field"):
        parse_args(grpo.Args, ["--config", str(bad)])


def test_a_pad_token_inside_a_prompt_is_attended_to():
    """Chat templates end each turn with a token that is often also the pad token (SmolLM2: <|im_end|> is EOS and
    pad). The prompt's attention mask comes from its length, not from `!= pad`, or the trainer would read a prompt
    without its turn ends while the sampler read them: a log-prob gap of 0.12 per token on SmolLM2-135M-Instruct."""
    from common.sampling import Rollouts, to_tensors

    pad = 2
    rollouts = Rollouts(prompt_ids=[[5, 2, 7], [2, 9]], completion_ids=[[4, 2], [6]],
                        sampler_logp=[[-1.0, -2.0], [-3.0]], rewards=torch.zeros(2), per_func={},
                        truncated=torch.zeros(2, dtype=torch.bool),
                        action_mask=[[1, 1], [1]])
    batch = to_tensors(rollouts, torch.zeros(2, dtype=torch.bool), pad)
    assert batch.input_ids.tolist() == [[5, 2, 7, 4, 2], [2, 2, 9, 6, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    assert batch.mask.tolist() == [[1, 1], [1, 0]]


def test_the_toy_is_built_once_by_one_builder_that_says_so(tmp_path, monkeypatch, capsys):
    """Two processes asking for the toy at once (here threads, each with its own lock file handle: flock excludes
    them alike): one announces the build and builds, on one thread; the other waits and reuses it."""
    import threading
    import time

    import common.tasks.toy as toy

    calls = []

    def slow_build(path, seed, settings, target_accuracy):
        calls.append(torch.get_num_threads())
        time.sleep(0.5)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "toy.json"), "w") as f:
            json.dump(settings, f)
        return settings

    monkeypatch.setattr(toy, "build_toy", slow_build)
    threads = torch.get_num_threads()
    results = []
    workers = [threading.Thread(target=lambda: results.append(toy.prepare_toy(str(tmp_path / "toy"), seed=5)))
               for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert calls == [1] and len(results) == 2 and results[0] == results[1]
    assert torch.get_num_threads() == threads  # put back after the build
    out = capsys.readouterr().out
    assert out.count("toy: building ") == 1 and "once (a 300k-parameter Qwen3" in out, out


def test_a_bounded_run_kills_what_its_command_started(tmp_path):
    """tests/conftest.py run_bounded, which launches the tests' distributed runs: past its timeout the command and a
    process it started in a session of its own (as torchrun starts its workers) are both killed, and the test fails
    at once, with the output so far."""
    pid_file = tmp_path / "pid"
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "print('started', flush=True)\n"
            "time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)timed out after 5 s.*started"):
        run_bounded([sys.executable, "-c", code], 5)
    assert time.monotonic() - start < 60
    child = psutil.Process(int(pid_file.read_text()))  # reparented, so not ours to wait for: polled
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert not alive or child.status() == psutil.STATUS_ZOMBIE
