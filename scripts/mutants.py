"""One-line mutants of the estimators, each to be caught by its estimator's own fast tests.

    python scripts/mutants.py                  # apply each in a copy of the repository, run its tests there
    python scripts/mutants.py --only ctpo,ipo  # the mutants of these scripts
    python scripts/mutants.py --list           # the mutants

A mutant is a line of a script and the same line made wrong in one way a careless edit could: a clip bound, the
direction of the k3 estimator, a normaliser, a stop-gradient, a mask, a rule for groups without signal. Each must
make `python -m pytest -m "not slow" tests/test_<estimator>.py` fail: a green fast check of one estimator then means
that estimator is whole. The mutants are applied in a temporary copy of the repository, never to these files, so the
script can run beside anything else (CI runs it beside its other stages: .ci/run). It prints CAUGHT or MISSED per
mutant and exits 1 if one is missed. tests/test_lint.py checks that each mutant's line is still in its script.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (script, the line's text as it is, as the mutant has it, what it breaks)
MUTANTS = [
    ("grpo", "clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)",
     "clamp(ratio, 1 - args.epsilon, 1 + 2 * args.epsilon_high)  # (B, T)", "the upper clip bound"),
    ("grpo", "kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1",
     "kl = torch.exp(logp - ref_logp) - (logp - ref_logp) - 1", "the k3 estimator's direction"),
    ("grpo", "return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()",
     "return (centered / (grouped.std(dim=1, keepdim=True) + 1e-5)).flatten()", "the z-score's epsilon"),
    ("snib", "n_g = kept.sum(1).clamp(min=1).to(u.dtype)", "n_g = torch.full_like(kept.sum(1), G).to(u.dtype)",
     "SNIB's normaliser over the rows left in a group"),
    ("snib", "return args.self_normalize and not args.stop_grad_norm and (args.beta > 0 or args.tis_cap > 0)",
     "return False", "SNIB-fg's whole groups per micro-batch (with a KL term or TIS)"),
    ("covpo", "valid & (clipped == 0) & (cov > args.clip_cov_lb)", "valid & (cov > args.clip_cov_lb)",
     "Clip-Cov's exclusion of clipped tokens"),
    ("reinforcepp", "* n / (n - 1).clamp(min=1)", "* 1", "REINFORCE++'s unbiased variance"),
    ("reinforcepp", "kl.flip(-1).cumsum(-1).flip(-1)", "kl.cumsum(-1)", "REINFORCE++'s return direction"),
    ("maxrl", "A = (grouped - mean) / (mean + 1e-6)",
     "A = (grouped - mean) / (grouped.std(dim=1, keepdim=True) + 1e-6)", "MaxRL's divisor"),
    ("maxrl", "torch.where(mean > 0, A, torch.zeros_like(A))", "torch.where(mean >= 0, A, torch.zeros_like(A))",
     "MaxRL's zero rule"),
    ("p3o", "if stats.sum_r is None:  # --ess_scope micro_batch: these rows' own", "if True:",
     "P3O's ESS over the whole batch"),
    ("cispo", "clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high).detach()",
     "clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)", "CISPO's stop-gradient"),
    ("dppo", "high = default if args.delta_high is None else args.delta_high",
     "high = default if args.delta_low is None else args.delta_low", "DPPO's upper bound"),
    ("rloo", "/ (args.num_generations - 1)", "/ args.num_generations", "RLOO's leave-one-out divisor"),
    ("grpo", "clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)",
     "clamp(ratio, 1 - 2 * args.epsilon, 1 + args.epsilon_high)  # (B, T)", "the lower clip bound"),
    ("grpo", "(centered / (grouped.std(dim=1, keepdim=True) + 1e-6))",
     "(centered / (grouped.std(dim=1, keepdim=True, correction=0) + 1e-6))", "the std's form (unbiased, as TRL's)"),
    ("grpo", "(centered / (grouped.std(dim=1, keepdim=True) + 1e-6))",
     "(centered / (grouped.var(dim=1, keepdim=True) + 1e-6).sqrt())", "the std's epsilon outside the root"),
    ("grpo", "return Stats(num_rows=total((mask.sum(-1) > 0).sum().float()))",
     "return Stats(num_rows=total(torch.ones_like(mask[:, 0]).sum().float()))",
     "GRPO's removed rows (no valid token) out of the denominator"),
    ("landscape", "return (mask.sum(-1) > 0) & sign  # (B,)",
     "return torch.ones_like(mask[:, 0], dtype=torch.bool) & sign", "the removed rows out of the kept rows"),
    ("landscape", "return centered.sign().flatten()  # (B,)", "return centered.flatten()  # (B,)",
     "CL's sign advantages"),
    ("landscape", 'sign = {"positive": advantages > 0, "negative": advantages < 0}',
     'sign = {"positive": advantages >= 0, "negative": advantages < 0}', "PL's strictly positive rows"),
    ("landscape", 'lengths = {"token-sum-norm": args.max_completion_length, "token-mean": 1}',
     'lengths = {"token-sum-norm": args.max_completion_length - 1, "token-mean": 1}', "TNCL's normaliser T"),
    ("landscape", 'denominator = stats.num_tokens if args.loss_agg == "token-mean" else stats.num_rows',
     'denominator = stats.num_rows', "token-mean's denominator, the batch's valid tokens"),
    ("ctpo", "cum_logratio = torch.cumsum(mask * delta, dim=-1).detach()",
     "cum_logratio = torch.cumsum(delta, dim=-1).detach()", "CTPO's cumulative ratio skipping tool tokens"),
    ("ctpo", "position = torch.cumsum(mask, dim=-1)", "position = torch.cumsum(torch.ones_like(mask), dim=-1)",
     "CTPO's positions counting only valid tokens"),
    ("ctpo", "cum_logratio = torch.cumsum(mask * delta, dim=-1).detach()",
     "cum_logratio = torch.cumsum(mask * delta, dim=-1)", "CTPO's stop-gradient on the prefix"),
    ("dppo", "low = default if args.delta_low is None else args.delta_low",
     "low = default if args.delta_high is None else args.delta_high", "DPPO's lower bound"),
    ("dppo", "is_low = (A <= 0) & (p < p_old) & (divergence > low)", "is_low = (A <= 0) & (divergence > low)",
     "DPPO's mask on the side the advantage pushes"),
    ("gspo", "seq_ratio = torch.exp(log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))  # (B,)  GSPO: s_i",
     "seq_ratio = torch.exp(log_ratio.sum(-1))  # (B,)  GSPO: s_i", "GSPO's geometric mean (a product instead)"),
    ("gmpo", "torch.where(A > 0, torch.minimum(log_ratio, clamped),",
     "torch.where(A < 0, torch.minimum(log_ratio, clamped),", "GMPO's clip on the side the advantage pushes"),
    ("sapo", "tau = torch.full_like(A, args.tau_neg).masked_fill(A > 0, args.tau_pos)",
     "tau = torch.full_like(A, args.tau_pos).masked_fill(A > 0, args.tau_neg)", "SAPO's temperature by sign"),
    ("sapo", "surrogate = 4 / tau * gate * A", "surrogate = gate * A", "SAPO's 4 / tau (gradient 1 on policy)"),
    ("ipo", "moved = (torch.exp(logp.detach()) - torch.exp(old_logp)).abs()",
     "moved = torch.exp(logp.detach()) - torch.exp(old_logp)", "IPO's trust region on both sides"),
    ("ipo", "return mask.float() * (advantages != 0).float()[:, None]  # (B, T)", "return mask.float()  # (B, T)",
     "IPO's rows with A = 0 out of the token mean"),
    ("dro", "per_token = surrogate - 0.5 * args.tau * log_ratio**2", "per_token = surrogate - args.tau * log_ratio**2",
     "DRO's penalty tau / 2"),
    ("vespo", "phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))",
     "phi = torch.exp(k * log_w - lam * torch.exp(log_w))", "VESPO's normalisation phi(1) = 1"),
    ("vespo", "log_ratio = log_ratio.detach().clamp(-20.0, 20.0)", "log_ratio = log_ratio.clamp(-20.0, 20.0)",
     "VESPO's stop-gradient on the weight"),
    ("luspo", "per_seq = (per_token * mask).sum(-1)  # (B,)",
     "per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)", "LUSPO's length scaling"),
    ("gdpo", "/ (n + 1e-8) * n / (n - 1)  # ()", "/ (n + 1e-8)  # ()", "GDPO's unbiased batch variance"),
    ("gdpo", "normalised = centered / (grouped.std(dim=1, keepdim=True) + 1e-6)  # (N, G, K)",
     "normalised = centered  # (N, G, K)", "GDPO's z-score per reward"),
    ("sdpo", "gap = (logp - teacher_logp).detach()  # (B, T)  logp_t - q_t",
     "gap = (teacher_logp - logp).detach()  # (B, T)  logp_t - q_t", "SDPO's reverse-KL direction, to the teacher"),
    ("sdpo", "log_ratio = (logp - old_logp).detach().clamp(-20.0, 20.0)  # (B, T)",
     "log_ratio = (logp - old_logp).clamp(-20.0, 20.0)  # (B, T)", "SDPO's stop-gradient on the IS weight"),
    ("sdpo", "if success[j] and not (own and j == i)]", "if success[j]]",
     "SDPO's dont_reprompt_on_self_success: a success is not its own demonstration"),
    ("sdpo", "told_text = args.feedback_template.format(feedback_raw=raw) if told[-1] else \"\"",
     "told_text = args.feedback_template.format(feedback_raw=raw)", "SDPO's feedback text only where it is given"),
]


def copy_of_repository(folder: str) -> str:
    """The repository's files (no .git, runs or caches) copied into `folder`; returns the copy's root."""
    root = os.path.join(folder, "repo")
    ignore = shutil.ignore_patterns(".git", "runs", "site", "__pycache__", ".pytest_cache", ".whl", "gpu_report")
    shutil.copytree(REPO, root, ignore=ignore)
    return root


def fast_tests(names, root: str) -> subprocess.CompletedProcess:
    """`python -m pytest -m "not slow"` on these estimators' test files, in the copy at `root`, stopping at the
    first failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
               *[f"tests/test_{name}.py" for name in names]]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)


def run(mutant, root: str) -> bool:
    """Apply a mutant in the copy at `root`, run its estimator's fast tests there, restore the script; True when
    a test failed. Anything else that stops pytest (the mutant's line no longer parses, a collection error) is an
    error of the mutant, never a catch."""
    name, line, wrong, _ = mutant
    path = os.path.join(root, f"{name}.py")
    with open(path) as f:
        source = f.read()
    if source.count(line) != 1:
        raise SystemExit(f"error: {name}.py holds {source.count(line)} copies of the mutant's line {line!r}")
    try:
        with open(path, "w") as f:
            f.write(source.replace(line, wrong))
        done = fast_tests([name], root)
    finally:
        with open(path, "w") as f:
            f.write(source)
    if done.returncode not in (0, 1):  # pytest: 0 all passed, 1 a test failed, 2-5 it could not run them
        raise SystemExit(f"error: the mutant {wrong!r} of {name}.py stopped pytest (exit {done.returncode}), "
                         f"not a test:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return done.returncode == 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    p.add_argument("--only", default="", help="comma-separated scripts whose mutants to run (default: all)")
    a = p.parse_args(argv)
    only = set(filter(None, a.only.split(",")))
    unknown = only - {m[0] for m in MUTANTS}
    if unknown:
        raise SystemExit(f"error: --only names scripts with no mutant: {sorted(unknown)}")
    chosen = [m for m in MUTANTS if not only or m[0] in only]
    if a.list:
        for name, line, wrong, what in chosen:
            print(f"{name:12s} {what}: {line!r} -> {wrong!r}")
        return 0
    missed = 0
    with tempfile.TemporaryDirectory() as folder:
        root = copy_of_repository(folder)
        # The control: unmutated, the same test files pass in the copy, so a failure below is the mutant's.
        names = sorted({m[0] for m in chosen})
        control = fast_tests(names, root)
        if control.returncode != 0:
            raise SystemExit(f"error: the unmutated fast tests of {', '.join(names)} fail in the copy (exit "
                             f"{control.returncode}); fix them first:\n{control.stdout[-3000:]}")
        print(f"control: the unmutated fast tests of {len(names)} estimators pass", flush=True)
        for mutant in chosen:
            caught = run(mutant, root)
            missed += not caught
            print(f"{'CAUGHT' if caught else 'MISSED'} {mutant[0]:12s} {mutant[3]}", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} mutants caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
