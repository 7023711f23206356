"""reinforcepp.compute_advantages / whiten / compute_loss by hand, against loops from the definitions (float64), and
against verl 0.5.0's own `verl/trainer/ppo/core_algos.py` (its `reinforce_plus_plus` and
`reinforce_plus_plus_baseline` advantage estimators and its PPO `compute_policy_loss`), on identical tensors, then
end-to-end runs.

verl is not a dependency: the `peer` tests download its wheel (`pip download --no-deps verl==0.5.0`, 0.9 MB) into
VERL_CACHE=DIR (else a temporary folder) and load just those two files, `core_algos.py` and the
`torch_functional.py` it imports (masked_mean / masked_var / masked_whiten), with stubs for their heavy imports
(tensordict, verl's device helpers and config classes), none of which the compared functions call."""

import dataclasses
import glob
import importlib.util
import math
import os
import subprocess
import sys
import types
import zipfile
from dataclasses import replace

import pytest
import torch
from conftest import learning_bar, read_metrics, run_script
from test_snib import STALE, assert_stale_updates_agree
from test_train import SMALL, assert_same_gradient, sgd_gradient

import grpo
import landscape
import reinforcepp

ARGS = reinforcepp.Args(num_generations=2)
VERL = "0.5.0"


def whitened(advantages, mask):
    """What main() does on one process: the returns whitened with the batch's own sums."""
    return reinforcepp.whiten(advantages, mask)


def test_defaults_and_there_are_no_other_switches():
    args = reinforcepp.Args()
    # OpenRLHF's init_kl_coef 0.01 (k1, in the reward), eps_clip 0.2; verl's clip_ratio 0.2 and clip_ratio_c 3
    assert (args.beta, args.epsilon, args.epsilon_high, args.clip_ratio_c, args.baseline) == (0.01, 0.2, 0.2, 3.0,
                                                                                                False)
    shared = {f.name for f in dataclasses.fields(grpo.Args)} - {"beta", "epsilon", "epsilon_high"}
    assert {f.name for f in dataclasses.fields(reinforcepp.Args)} - shared == {
        "beta", "epsilon", "epsilon_high", "clip_ratio_c", "baseline"}


def test_returns_and_the_baseline_by_hand():
    """Rewards (1, 0), token k1 KLs (0.5, 1, pad) and (2, -1, 1): with beta 0.1 the return of a token is R minus 0.1
    times the KL from it to the end; --baseline: one value per row, R - 0.1 KL_i less its group's mean."""
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = torch.tensor([[0.5, 1.0, 0.0], [2.0, -1.0, 1.0]], dtype=torch.float64) * mask
    args = replace(ARGS, beta=0.1)
    G = reinforcepp.compute_advantages(rewards, args, kl)
    torch.testing.assert_close(G[mask.bool()], torch.tensor([1 - 0.15, 1 - 0.1, -0.2, 0.0, -0.1], dtype=torch.float64))
    torch.testing.assert_close(reinforcepp.compute_advantages(rewards, args), rewards)  # no KL: R_i on every token
    base = reinforcepp.compute_advantages(rewards, replace(args, baseline=True), kl)  # R' = (0.85, -0.2), mean 0.325
    torch.testing.assert_close(base, torch.tensor([0.525, -0.525], dtype=torch.float64))
    torch.testing.assert_close(reinforcepp.compute_advantages(torch.tensor([1.0, 0, 3, 3]), replace(
        ARGS, baseline=True)), torch.tensor([0.5, -0.5, 0, 0]))


def test_whitening_by_hand():
    """Rows of 1 and 3 valid tokens with returns 1 and 0: token mean 1/4, unbiased token variance (3/16 * 4/3) = 1/4,
    so A = (1 - 1/4) / 1/2 = 1.5 and (0 - 1/4) / 1/2 = -0.5; padding 0. Equal returns everywhere whiten to 0."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    A = whitened(torch.tensor([1.0, 0.0], dtype=torch.float64), mask)
    eps = 1 / math.sqrt(0.25 + 1e-8)
    torch.testing.assert_close(A, torch.tensor([[0.75, 0, 0], [-0.25, -0.25, -0.25]], dtype=torch.float64) * eps)
    assert whitened(torch.ones(2, dtype=torch.float64), mask).abs().max() == 0
    valid = A[mask.bool()]
    assert valid.mean().item() == pytest.approx(0, abs=1e-15) and valid.var().item() == pytest.approx(1, rel=1e-7)


def test_the_sums_of_two_processes_give_the_whole_batchs_whitening():
    """main() whitens with sums taken over every process (`total`, its all-reduce): whitening each half with the
    halves' sums added up equals whitening the whole batch."""
    _, _, _, rewards, kl, mask, _ = random_batch(seed=5)
    args = replace(ARGS, num_generations=4, beta=0.05)
    returns = reinforcepp.compute_advantages(rewards, args, kl)
    whole = whitened(returns, mask)
    halves = [slice(0, 4), slice(4, 8)]
    recorded = [[], []]  # each process's own sums, in the order whiten takes them
    for half, s in enumerate(halves):
        reinforcepp.whiten(returns[s], mask[s], total=lambda x, half=half: recorded[half].append(x) or x)
    summed = [a + b for a, b in zip(*recorded)]  # what the all-reduce gives both processes
    assert len(summed) == 3
    two = [reinforcepp.whiten(returns[s], mask[s], total=lambda x, it=iter(summed): next(it)) for s in halves]
    torch.testing.assert_close(torch.cat(two), whole)
    own = torch.cat([whitened(returns[s], mask[s]) for s in halves])  # each process's own statistics: wrong
    assert (own - whole).abs().max() > 1e-3


def test_on_policy_loss_and_gradient_by_hand():
    """old_logp == logp: every r_t = 1, nothing clipped, the loss -(1/n) sum_{i,t} A_it over the n valid tokens and
    its gradient -A_it / n: the token-mean policy gradient, GRPO's --loss_agg token-mean for one value per row."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-0.1, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    A = torch.tensor([[1.0, 2.0, 0.0], [-2.0, -1.0, 0.5], [0.5, 0.0, 0.0]])
    loss, metrics = reinforcepp.compute_loss(logp, logp.detach(), None, A, mask, replace(ARGS, beta=0.0))
    assert loss.item() == pytest.approx(-(1.0 + 2.0 - 2.0 - 1.0 + 0.5 + 0.5) / 6)
    assert metrics["policy/ratio_mean"].item() == 1.0 and metrics["policy/clip_frac"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -A * mask / 6)
    rows = torch.tensor([1.0, -2.0, 0.5])
    ours = reinforcepp.compute_loss(logp, logp.detach(), None, rows, mask, replace(ARGS, beta=0.0))[0]
    theirs = landscape.compute_loss(logp, logp.detach(), None, rows, mask, landscape.Args(
        num_generations=1, beta=0.0, loss_agg="token-mean"))[0]
    assert ours.item() == pytest.approx(theirs.item())
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])


def test_the_dual_clip_caps_a_negative_advantages_loss_at_c():
    """A = -1 and r = e^1.5 = 4.48: the PPO clip keeps -r A (the pessimistic side, 4.48 > c = 3), the dual clip
    caps the token's loss at c |A| = 3, without gradient; r = e^1 = 2.72 < 3: the PPO term -r A and its gradient."""
    logp = torch.tensor([[1.5, 1.0]], dtype=torch.float64, requires_grad=True)
    old, mask = torch.zeros(1, 2, dtype=torch.float64), torch.tensor([[1, 1]])
    A = torch.tensor([-1.0], dtype=torch.float64)
    loss, metrics = reinforcepp.compute_loss(logp, old, None, A, mask, replace(ARGS, beta=0.0))
    assert loss.item() == pytest.approx((3.0 + math.e) / 2, rel=1e-12)
    assert metrics["policy/dual_clip_frac"].item() == 0.5
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0],
                               torch.tensor([[0.0, math.e / 2]], dtype=torch.float64))


# Against loops straight from the definitions, and micro-batches


def reference_advantages(rewards, kl, mask, G, beta, baseline):
    """REINFORCE++'s advantages token by token: the return sum_{k>=t} r_k of rewards r_k = -beta kl_k (+ R_i at the
    last valid token), gamma 1 (with --baseline: R'_i - mean_g R' on every token), then whitened over all valid
    tokens with the unbiased variance: (x - mu) / sqrt(var + 1e-8)."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    shaped = [rewards[i] - beta * sum(kl[i, t] for t in range(T) if mask[i, t]) for i in range(B)]
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            if baseline:
                g = i // G
                out[i, t] = shaped[i] - sum(shaped[g * G: g * G + G]) / G
            else:
                out[i, t] = rewards[i] - beta * sum(kl[i, k] for k in range(t, T) if mask[i, k])
    values = [out[i, t] for i in range(B) for t in range(T) if mask[i, t]]
    mu = sum(values) / len(values)
    var = sum((v - mu) ** 2 for v in values) / (len(values) - 1)
    return torch.stack([torch.stack([(out[i, t] - mu) / torch.sqrt(var + 1e-8) if mask[i, t] else out[i, t] * 0
                                     for t in range(T)]) for i in range(B)])


def reference_loss(logp, old, A, mask, args, tis=None):
    """verl's PPO token loss term by term: -max(min(r A, clip(r) A), c A) for A < 0, -min(r A, clip(r) A) else, times
    the TIS weight, summed over the valid tokens and divided by their number."""
    total, n = 0.0, 0
    B, T = logp.shape
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            a = A[i, t]
            s = torch.minimum(r * a, torch.clamp(r, 1 - args.epsilon, 1 + args.epsilon_high) * a)
            if a < 0:
                s = torch.maximum(s, args.clip_ratio_c * a)
            total, n = total + (s if tis is None else s * tis[i, t]), n + 1
    return -total / n


def random_batch(seed=0, B=8, T=5, spread=0.4):
    torch.manual_seed(seed)
    logp = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=torch.float64) * spread  # ratios on both sides of the clip
    ref = logp.detach() + torch.randn(B, T, dtype=torch.float64) * 0.3
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 1])  # row 6 removed (no valid token)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()  # (B, T) unequal lengths, right-padded
    rewards = (torch.rand(B, dtype=torch.float64) > 0.5).double()
    kl = mask * (old - ref)  # (B, T) the sampler's k1 (old_logp stands in for the sampler's log-probs)
    tis = (torch.rand(B, T, dtype=torch.float64) + 0.5) * mask
    return logp, old, ref, rewards, kl, mask, tis


@pytest.mark.parametrize("beta, baseline", [(0.0, False), (0.01, False), (0.3, False), (0.0, True), (0.3, True)])
@pytest.mark.parametrize("with_tis", [False, True])
@pytest.mark.parametrize("epsilon, epsilon_high", [(0.2, 0.2), (0.1, 0.28)])
def test_matches_the_definitions_and_micro_batches_sum_to_the_full_batch(beta, baseline, with_tis, epsilon,
                                                                          epsilon_high):
    args = replace(ARGS, num_generations=4, beta=beta, baseline=baseline, epsilon=epsilon, epsilon_high=epsilon_high)
    logp, old, ref, rewards, kl, mask, tis = random_batch()
    A = whitened(reinforcepp.compute_advantages(rewards, args, kl if beta > 0 else None), mask)
    torch.testing.assert_close(A, reference_advantages(rewards, kl, mask, 4, beta, baseline), rtol=1e-10, atol=1e-12)
    tis = tis if with_tis else None
    loss, metrics = reinforcepp.compute_loss(logp, old, ref, A, mask, args, tis_weights=tis)
    (full_grad,) = torch.autograd.grad(loss, logp)
    expected = reference_loss(logp, old, A, mask, args, tis)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(full_grad, torch.autograd.grad(expected, logp)[0])
    assert 0 < metrics["policy/clip_frac"] < 1  # some tokens clipped, not all
    stats = reinforcepp.batch_stats(A, mask, args)
    assert [f.name for f in dataclasses.fields(stats)] == ["num_tokens"]
    assert stats.per_row_values() == {} and stats.num_tokens.item() == 21
    micro = sum(reinforcepp.compute_loss(logp[s], old[s], ref[s], A[s], mask[s], args, stats=stats,
                                         tis_weights=None if tis is None else tis[s])[0]
                for s in [slice(0, 1), slice(1, 4), slice(4, 8)])
    assert micro.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(micro, logp)[0], full_grad)


def test_gradient_check_in_float64():
    """torch.autograd.gradcheck on the loss as a function of logp (away from the clips' kinks)."""
    logp, old, ref, rewards, kl, mask, tis = random_batch(seed=3, spread=0.02)
    A = whitened(reinforcepp.compute_advantages(rewards, replace(ARGS, num_generations=4), kl), mask)
    assert torch.autograd.gradcheck(lambda x: reinforcepp.compute_loss(x, old, ref, A, mask, ARGS,
                                                                       tis_weights=tis)[0],
                                    (logp.detach().requires_grad_(),))


# Against verl 0.5.0's own code


@pytest.fixture(scope="session")
def verl_core_algos(tmp_path_factory):
    """verl 0.5.0's core_algos module, loaded from its wheel with stubs for what the compared functions never call."""
    return load_verl_core_algos(tmp_path_factory, VERL)


def load_verl_core_algos(tmp_path_factory, version: str):
    """verl `version`'s core_algos module, from its wheel (`pip download --no-deps verl==version`, cached in
    VERL_CACHE), with stubs for the imports the compared functions never call (0.9's too: omegaconf, verl's config
    classes and helpers)."""
    cache = os.environ.get("VERL_CACHE") or str(tmp_path_factory.mktemp(f"verl-{version}"))
    wheels = glob.glob(os.path.join(cache, f"verl-{version}-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"verl=={version}", "-d", cache],
                              capture_output=True, text=True)
        wheels = glob.glob(os.path.join(cache, f"verl-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            if os.environ.get("REQUIRE_PEERS") == "1":
                pytest.fail(f"could not download verl=={version}: {done.stderr[-500:]}")
            pytest.skip(f"could not download verl=={version} (no network?)")
    folder = os.path.join(cache, version)
    with zipfile.ZipFile(wheels[0]) as z:
        for name in ("verl/utils/torch_functional.py", "verl/trainer/ppo/core_algos.py"):
            z.extract(name, folder)
    stubs = {name: types.ModuleType(name) for name in ("verl", "verl.utils", "verl.trainer", "verl.trainer.ppo",
                                                       "verl.trainer.config", "verl.utils.device", "tensordict",
                                                       "verl.utils.import_utils", "verl.workers",
                                                       "verl.workers.config", "omegaconf")}
    stubs["verl.trainer.config"].AlgoConfig = object
    stubs["verl.utils.device"].get_device_name = lambda: "cpu"
    stubs["verl.utils.device"].get_torch_device = lambda: torch.cpu
    stubs["verl.utils"].as_torch_index = stubs["verl.utils"].group_mean_std = None
    stubs["verl.utils.import_utils"].deprecated = lambda *args, **kwargs: (lambda f: f)
    stubs["verl.workers.config"].ActorConfig = object
    stubs["omegaconf"].DictConfig = object
    stubs["tensordict"].TensorDict = object
    saved = {name: sys.modules.get(name) for name in [*stubs, "verl.utils.torch_functional"]}
    try:
        sys.modules.update({k: v for k, v in stubs.items()
                            if k not in ("tensordict", "omegaconf") or saved[k] is None})
        modules = {}
        for name, path in (("verl.utils.torch_functional", "verl/utils/torch_functional.py"),
                           ("verl.trainer.ppo.core_algos", "verl/trainer/ppo/core_algos.py")):
            spec = importlib.util.spec_from_file_location(name, os.path.join(folder, path))
            modules[name] = importlib.util.module_from_spec(spec)
            sys.modules[name] = modules[name]
            spec.loader.exec_module(modules[name])
        return modules["verl.trainer.ppo.core_algos"]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.modules.pop("verl.trainer.ppo.core_algos", None)


def verl_token_level_rewards(rewards, kl, mask, beta):
    """verl's token_level_rewards: the score at each row's last valid token, minus beta * kl on every token
    (apply_kl_penalty with use_kl_in_reward, kl_penalty 'kl': k1 of old_log_prob and ref_log_prob, times the mask)."""
    scores = torch.zeros_like(kl)
    last = (mask.sum(-1) - 1).clamp(min=0)
    scores[torch.arange(len(rewards)), last] = rewards * (mask.sum(-1) > 0)
    return scores - beta * kl * mask


@pytest.mark.peer
@pytest.mark.parametrize("beta", [0.0, 0.01, 0.3])
@pytest.mark.parametrize("baseline", [False, True])
def test_equals_verls_advantages_on_the_same_rewards(verl_core_algos, beta, baseline):
    """verl's reinforce_plus_plus (gamma 1) and reinforce_plus_plus_baseline on the same rewards and KLs. verl's
    baseline takes its group means in float32 (torch.tensor of a list), and its masked_mean divides by n + 1e-8:
    equal to about 1e-6. A row without valid tokens would make verl's whitening raise: none here."""
    _, old, ref, rewards, kl, mask, _ = random_batch(seed=4)
    mask[6, :3] = 1
    kl = mask * (old - ref)
    args = replace(ARGS, num_generations=4, beta=beta, baseline=baseline)
    ours = whitened(reinforcepp.compute_advantages(rewards, args, kl if beta > 0 else None), mask)
    token_rewards = verl_token_level_rewards(rewards, kl, mask, beta)
    if baseline:
        index = [i // 4 for i in range(len(rewards))]
        theirs, _ = verl_core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(token_rewards, mask, index)
    else:
        theirs, _ = verl_core_algos.compute_reinforce_plus_plus_outcome_advantage(
            token_rewards, mask, config=types.SimpleNamespace(gamma=1.0))
    torch.testing.assert_close(ours, theirs * mask, rtol=1e-5, atol=1e-6)


@pytest.mark.peer
@pytest.mark.parametrize("epsilon, epsilon_high, c", [(0.2, 0.2, 3.0), (0.1, 0.28, 1.5)])
def test_equals_verls_policy_loss_and_gradient_given_the_advantages(verl_core_algos, epsilon, epsilon_high, c):
    """verl's compute_policy_loss (PPO clip, dual clip c, loss_agg_mode token-mean) on the same whitened advantages
    and log-probs; ratios spread so that both clips act. verl's token mean divides by n + 1e-8."""
    logp, old, _, rewards, kl, mask, _ = random_batch(seed=2, spread=1.0)
    args = replace(ARGS, num_generations=4, epsilon=epsilon, epsilon_high=epsilon_high, clip_ratio_c=c)
    A = whitened(reinforcepp.compute_advantages(rewards, args, kl), mask)
    ours, metrics = reinforcepp.compute_loss(logp, old, None, A, mask, replace(args, beta=0.0))
    theirs, clipfrac, _, lower = verl_core_algos.compute_policy_loss(
        old, logp, A, mask, cliprange=0.2, cliprange_low=epsilon, cliprange_high=epsilon_high, clip_ratio_c=c,
        loss_agg_mode="token-mean")
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-8)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0],
                               rtol=1e-8, atol=1e-12)
    assert metrics["policy/dual_clip_frac"].item() == pytest.approx(lower.item(), rel=1e-6)
    assert 0 < metrics["policy/clip_frac"] < 1 and metrics["policy/dual_clip_frac"] > 0  # every branch is covered


# End to end


@pytest.mark.slow
@pytest.mark.precondition
def test_micro_batch_size_does_not_change_the_on_policy_gradient(in_toy_workdir):
    """On-policy (one optimizer step, old_logp = logp): the batch is whitened once, before the update, and the token
    mean has the batch's denominator: micro-batches of 1 and of the whole batch take the same gradient."""
    grads = {mb: sgd_gradient(in_toy_workdir, f"reinforcepp_micro{mb}", SMALL + ["--micro_batch_size", str(mb)],
                              script="reinforcepp.py") for mb in (1, 16)}
    assert_same_gradient(grads[1], grads[16])


@pytest.mark.slow
@pytest.mark.precondition
@pytest.mark.parametrize("variant, flags", [("rpp", []), ("baseline", ["--baseline", "true"])])
def test_stale_updates_do_not_depend_on_micro_batches_or_processes(in_toy_workdir, variant, flags):
    """Two passes over each batch in two mini-batches, a clip tight enough that tokens are clipped: the whitening
    (over both processes' tokens) and the token mean are the batch's, whatever the micro-batches and processes."""
    flags = STALE + flags + ["--epsilon", "0.02", "--epsilon_high", "0.02"]
    assert_stale_updates_agree(in_toy_workdir, "reinforcepp.py", f"reinforcepp_{variant}", flags,
                               lambda m: m["policy/clip_frac"] > 0.05)


@pytest.mark.slow
def test_toy_learns(in_toy_workdir):
    """A shortened toy run with the shared toy preset (the default beta 0.01, the KL in the reward): held-out greedy
    accuracy must rise."""
    run = run_script(reinforcepp, ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25",
                                   "--run_name", "reinforcepp_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3
    assert evals[-1] >= evals[0] + learning_bar("reinforcepp"), evals
