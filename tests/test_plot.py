"""evals/plot.py: metrics.jsonl, args.json and stats/ dumps (synthetic, in the loop's formats) -> valid PNG figures."""

import json
import math
import os

import pytest
import torch
from conftest import run_script

from evals import plot

BUCKETS = ["pos_1-16", "pos_17-64", "pos_65-256", "pos_257-1024", "pos_1025+"]
MIDDLES = [4, 33, 129, 513, 1449]  # roughly the geometric middles


def write_run(root, name: str, metrics: list[dict], args: dict | None = None, dumps: dict | None = None) -> str:
    """A run folder as the training loop writes it; dumps: {(step, rank): [dict of (rows,) tensors, ...]}."""
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if args is not None:
        (run_dir / "args.json").write_text(json.dumps(args))
    for (step, rank), stats in (dumps or {}).items():
        (run_dir / "stats").mkdir(exist_ok=True)
        torch.save(stats, run_dir / "stats" / f"step_{step:06d}.rank{rank}.pt")
    return str(run_dir)


def curves(steps: int = 20, kl: bool = True, clip: bool = True, reward_end: float = 0.6) -> list[dict]:
    """The loop's lines: an evaluation-only line at step 0, then one line per step."""
    lines = [{"step": 0, "eval/accuracy": 0.3}]
    for s in range(1, steps + 1):
        m = {"step": s, "reward/mean": 0.2 + (reward_end - 0.2) * s / steps, "policy/entropy": 1.0 - 0.02 * s,
             "completion/length_mean": 100.0 + s, "loss/policy": 0.1}
        m.update({"policy/kl": 0.01 * s} if kl else {})
        m.update({"policy/clip_frac": 0.05} if clip else {})
        m.update({"eval/accuracy": 0.3 + 0.01 * s} if s % 5 == 0 else {})
        lines.append(m)
    return lines


def assert_png(path: str, min_kib: float = 8):
    assert path is not None and os.path.isfile(path), path
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR
    assert width >= 400 and height >= 300, (width, height)
    assert len(data) > min_kib * 1024, f"{path}: {len(data)} bytes, an empty figure?"


def test_learning_curves_overlay_runs_and_skip_panels_no_run_logged(tmp_path):
    runs = [plot.load_run(write_run(tmp_path, "a", curves(kl=False, clip=False))),
            plot.load_run(write_run(tmp_path, "b", curves(kl=True, clip=False)))]
    keys = [key for key, _ in plot.curve_panels(runs)]
    assert keys == ["reward/mean", "eval/accuracy", "policy/entropy", "completion/length_mean", "policy/kl"]
    assert_png(plot.plot_learning_curves(runs, str(tmp_path / "out" / "curves.png"), smooth=3))


def test_no_known_metric_draws_nothing(tmp_path):
    run = plot.load_run(write_run(tmp_path, "a", [{"step": 1, "time/step": 1.0}]))
    assert plot.plot_learning_curves([run], str(tmp_path / "curves.png")) is None
    assert not (tmp_path / "curves.png").exists()


def ctpo_metrics(power: float, steps: int = 9, fixed: bool = True) -> list[dict]:
    """cum log-ratio std ~ sqrt(p); the fixed window's rate grows with position, the adaptive one's stays flat."""
    lines = []
    for s in range(1, steps + 1):
        m = {"step": s, "reward/mean": 0.5, "policy/clip_frac": 0.05}
        for name, p in zip(BUCKETS, MIDDLES):
            m[f"ctpo/cum_logratio_std/{name}"] = 0.01 * s * math.sqrt(p)
            m[f"ctpo/clip_frac/{name}"] = 0.06 if power else min(0.2, 0.0002 * p)
            m.update({f"ctpo/fixed_clip_frac/{name}": min(0.2, 0.0001 * p)} if fixed else {})
        lines.append(m)
    return lines


def test_ctpo_fig1_fixed_vs_adaptive(tmp_path):
    runs = [plot.load_run(write_run(tmp_path, f"ctpo_p{p}", ctpo_metrics(p), {"exp_name": "ctpo", "clip_power": p}))
            for p in (0.5, 0.0)]
    names = [name for name, _ in plot.position_buckets(runs)]
    assert names == BUCKETS  # ordered by position, the open bucket last
    assert plot.clip_label(runs[0]).endswith("adaptive clip (p^0.5)")
    assert plot.clip_label(runs[1]).endswith("fixed log-space bounds (clip_power 0)")
    # the paper's "fixed clip" curve is the adaptive run's own fixed_clip_frac, not another run's clip rate
    row = plot.nearest_row(runs[0], 9, "ctpo/")
    (own, own_points), (fixed, fixed_points) = plot.clip_rate_lines(runs[0], row, plot.position_buckets(runs))
    assert own.endswith("adaptive clip (p^0.5)") and fixed == "ctpo_p0.5: fixed clip, ratio in [0.5, 5]"
    assert [y for _, y in own_points] == [0.06] * 5
    assert [y for _, y in fixed_points] == [row[f"ctpo/fixed_clip_frac/{name}"] for name in BUCKETS]
    older = plot.load_run(write_run(tmp_path, "ctpo_old", ctpo_metrics(0.5, fixed=False), {"clip_power": 0.5}))
    assert len(plot.clip_rate_lines(older, plot.nearest_row(older, 9, "ctpo/"), plot.position_buckets([older]))) == 1
    assert_png(plot.plot_ctpo_fig1(runs, str(tmp_path / "fig1.png")))
    assert_png(plot.plot_ctpo_fig1(runs, str(tmp_path / "fig1_steps.png"), steps=[2, 8]))


def test_bucket_names_match_the_ones_ctpo_logs():
    import ctpo

    assert all(plot.BUCKET.fullmatch(name) for name in ctpo.POSITION_BUCKETS)


def test_ctpo_fig1_needs_ctpo_metrics(tmp_path):
    run = plot.load_run(write_run(tmp_path, "grpo", curves()))
    assert plot.plot_ctpo_fig1([run], str(tmp_path / "fig1.png")) is None


def snib_dumps(rows: int = 64, G: int = 8, spread: float = 3.0, seed: int = 0) -> list[dict]:
    """One RL step's dump on one process: a dict per optimizer step, as batch_stats returns it."""
    gen = torch.Generator().manual_seed(seed)
    dicts = []
    for _ in range(2):
        u = spread * torch.randn(rows, generator=gen) ** 3  # heavy tails
        log_wbar = (torch.logsumexp(u.view(-1, G), 1) - math.log(G)).repeat_interleave(G)
        dicts.append({"num_rows": torch.tensor(float(rows)), "log_weight": u, "log_wbar": log_wbar,
                      "group_ess": torch.ones(rows)})
    return dicts


def test_snib_fig2_reads_every_rank_of_the_last_dumped_step(tmp_path):
    dumps = {(2, 0): snib_dumps(seed=0), (2, 1): snib_dumps(seed=1), (4, 0): snib_dumps(seed=2),
             (4, 1): snib_dumps(seed=3)}
    run = plot.load_run(write_run(tmp_path, "snib", curves(), {"exp_name": "snib", "epsilon": 0.2}, dumps))
    step, raw, normalised = plot.load_weight_dumps(run)
    assert step == 4 and raw.shape == (2 * 2 * 64,)
    expected = torch.cat([d["log_weight"] - d["log_wbar"] for rank in (0, 1) for d in dumps[(4, rank)]])
    torch.testing.assert_close(normalised, expected)
    assert plot.load_weight_dumps(run, step=2)[0] == 2
    with pytest.raises(SystemExit, match="no dump of step 3"):
        plot.load_weight_dumps(run, step=3)
    assert_png(plot.plot_snib_fig2([run], str(tmp_path / "fig2.png")))


def test_snib_fig2_on_policy_dump_and_runs_without_dumps(tmp_path):
    zeros = [{"log_weight": torch.zeros(16), "log_wbar": torch.zeros(16)}]  # first optimizer step: u_i = 0
    on_policy = plot.load_run(write_run(tmp_path, "a", curves(), {}, {(1, 0): zeros}))
    assert_png(plot.plot_snib_fig2([on_policy], str(tmp_path / "fig2.png")))
    grpo_dump = [{"num_rows": torch.tensor(16.0)}]  # other scripts dump no SNIB weights
    others = [plot.load_run(write_run(tmp_path, "b", curves())),
              plot.load_run(write_run(tmp_path, "c", curves(), {}, {(1, 0): grpo_dump}))]
    assert plot.plot_snib_fig2(others, str(tmp_path / "none.png")) is None


def test_snib_fig1a_final_reward_against_reward_noise(tmp_path):
    runs = [plot.load_run(write_run(tmp_path, f"snib_s{sigma}", curves(reward_end=0.6 - sigma / 2),
                                    {"exp_name": "snib", "beta": 0.1, "reward_noise": sigma}))
            for sigma in (0.0, 0.2, 0.5, 1.0)]
    gspo = plot.load_run(write_run(tmp_path, "gspo", curves(), {"exp_name": "gspo", "beta": 0.1}))  # no such flag
    lines = plot.sweep_lines(runs + [gspo], "reward_noise", "beta", None, last=1)
    assert list(lines) == ["snib (beta=0.1)"]
    assert [sigma for sigma, _, _ in lines["snib (beta=0.1)"]] == [0.0, 0.2, 0.5, 1.0]
    assert lines["snib (beta=0.1)"][-1][2] == pytest.approx(0.1)  # the final reward of sigma = 1
    assert_png(plot.plot_snib_fig1a(runs + [gspo], str(tmp_path / "fig1a.png"), last=3))
    assert plot.plot_snib_fig1a(runs[:1], str(tmp_path / "none.png")) is None  # one sigma is not a sweep


def test_snib_fig1b_reward_against_kl_over_beta(tmp_path):
    noise = {"snib": {"reward_noise": 0.0}, "gspo": {}}  # gspo.py has no --reward_noise
    runs = [plot.load_run(write_run(tmp_path, f"{algo}_b{beta}", curves(reward_end=0.7 - beta),
                                    {"exp_name": algo, "beta": beta, **noise[algo]}))
            for algo in ("snib", "gspo") for beta in (0.02, 0.1, 0.5)]
    lines = plot.sweep_lines(runs, "beta", "reward_noise", "policy/kl", last=2)
    assert list(lines) == ["gspo", "snib"] and len(lines["snib"]) == 3
    assert lines["snib"][0][1] == pytest.approx(0.195)  # mean KL of the last two steps
    assert_png(plot.plot_snib_fig1b(runs, str(tmp_path / "fig1b.png"), last=2))


LANDSCAPE = {"GRPO": ("zscore", "all", "seq-mean-token-mean"), "PL": ("sign", "positive", "seq-mean-token-mean"),
             "NL": ("sign", "negative", "seq-mean-token-mean"), "CL": ("sign", "all", "seq-mean-token-mean"),
             "TNCL": ("sign", "all", "token-sum-norm"), "PL (token norm)": ("sign", "positive", "token-sum-norm")}


@pytest.mark.parametrize("name, switches", LANDSCAPE.items())
def test_landscape_variant_names_seed_003_objectives(name, switches):
    args = dict(zip(("advantage", "train_on", "loss_agg"), switches), batch_size=1024, mini_batch_size=0)
    assert plot.landscape_variant(args) == name
    assert plot.landscape_variant({**args, "mini_batch_size": 256}) == name + ", off-policy"


def test_landscape_figure_groups_landscape_runs_by_switches(tmp_path):
    runs = []
    for name in ("GRPO", "PL", "NL", "CL", "TNCL"):
        args = dict(zip(("advantage", "train_on", "loss_agg"), LANDSCAPE[name]), exp_name="landscape", batch_size=64)
        runs.append(plot.load_run(write_run(tmp_path, name, curves(), args)))
    snib = plot.load_run(write_run(tmp_path, "snib", curves(), {"exp_name": "snib"}))  # not a landscape.py run: ignored
    assert_png(plot.plot_landscape(runs + [snib], str(tmp_path / "landscape.png")))
    assert plot.plot_landscape(runs[:1] + [snib], str(tmp_path / "none.png")) is None


def test_cli_writes_every_figure_the_runs_have_data_for(tmp_path):
    sweep = [write_run(tmp_path, f"snib_b{beta}", curves(), {"exp_name": "snib", "beta": beta, "reward_noise": 0.0},
                       {(20, 0): snib_dumps()}) for beta in (0.05, 0.1)]
    run_dirs, args = plot.parse_cli([*sweep, "--out", str(tmp_path / "figs"), "--smooth", "2"])
    assert run_dirs == sweep and args.smooth == 2
    written = plot.main(run_dirs, args)
    assert [os.path.basename(p) for p in written] == ["learning_curves.png", "snib_fig2_logweights.png",
                                                       "snib_fig1b_reward_kl.png"]
    for path in written:
        assert_png(path)
    single, _ = plot.parse_cli([sweep[0]])
    assert os.path.dirname(plot.main(single, plot.PlotArgs())[0]) == os.path.join(sweep[0], "plots")


def test_a_folder_without_metrics_fails_clearly(tmp_path):
    (tmp_path / "not_a_run").mkdir()
    with pytest.raises(SystemExit, match="not_a_run.*has no metrics.jsonl"):
        plot.load_run(str(tmp_path / "not_a_run"))
    good = write_run(tmp_path, "good", curves())
    with pytest.raises(SystemExit, match="has no metrics.jsonl"):
        plot.main([good, str(tmp_path / "not_a_run")], plot.PlotArgs(out=str(tmp_path / "figs")))


@pytest.mark.slow
def test_a_real_snib_run_plots(in_toy_workdir, tmp_path):
    """The loop's own files: two stale optimizer steps per batch, so the dumped weights differ from 1."""
    import snib

    run_dir = run_script(snib, ["--preset", "toy", "--batch_size", "16", "--num_generations", "4", "--eval_steps", "0",
                                "--total_steps", "2", "--micro_batch_size", "4", "--mini_batch_size", "8",
                                "--num_iterations", "2", "--learning_rate", "1e-3", "--dump_stats_steps", "1",
                                "--run_name", "plot_snib"])
    written = plot.main([run_dir], plot.PlotArgs(out=str(tmp_path)))
    assert [os.path.basename(p) for p in written] == ["learning_curves.png", "snib_fig2_logweights.png"]
    for path in written:
        assert_png(path)
    step, raw, normalised = plot.load_weight_dumps(plot.load_run(run_dir))
    assert step == 2 and raw.shape == (2 * 2 * 8,)  # 2 passes x 2 mini-batches of 8 rows
    assert torch.isfinite(raw).all() and raw.abs().max() > 0
    assert normalised.max() <= math.log(4) + 1e-5  # w_i <= G


def test_the_fixed_window_label_is_ctpos():
    import ctpo

    assert plot.FIXED_WINDOW == ctpo.FIG1_FIXED_WINDOW
