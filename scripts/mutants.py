"""One-line mutants of the estimators, each to be caught by its estimator's own fast tests.

    python scripts/mutants.py              # apply each, run tests/test_<estimator>.py -m "not slow", restore
    python scripts/mutants.py --list       # the mutants

A mutant is a line of a script and the same line made wrong in one way a careless edit could: a clip bound, the
direction of the k3 estimator, a normaliser, a stop-gradient, a mask, a rule for groups without signal. Each must
make `python -m pytest -m "not slow" tests/test_<estimator>.py` fail: a green fast check then means the estimator is
whole. The script restores every file it touches, even when interrupted; it prints CAUGHT or MISSED per mutant and
exits 1 if one is missed. tests/test_lint.py checks that each mutant's line is still in its script.
"""

import argparse
import os
import subprocess
import sys

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
]


def run(mutant) -> bool:
    """Apply a mutant, run its estimator's fast tests, restore the script; True when the tests failed."""
    name, line, wrong, _ = mutant
    path = os.path.join(REPO, f"{name}.py")
    with open(path) as f:
        source = f.read()
    if source.count(line) != 1:
        raise SystemExit(f"error: {name}.py holds {source.count(line)} copies of the mutant's line {line!r}")
    try:
        with open(path, "w") as f:
            f.write(source.replace(line, wrong))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                   f"tests/test_{name}.py"]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    finally:
        with open(path, "w") as f:
            f.write(source)
    return done.returncode != 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    a = p.parse_args(argv)
    missed = 0
    for mutant in MUTANTS:
        if a.list:
            print(f"{mutant[0]:12s} {mutant[3]}: {mutant[1]!r} -> {mutant[2]!r}")
            continue
        caught = run(mutant)
        missed += not caught
        print(f"{'CAUGHT' if caught else 'MISSED'} {mutant[0]:12s} {mutant[3]}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
