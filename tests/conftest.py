"""Shared fixtures: the toy model and data, built once per test session in a temporary folder (TOY_SEED=N builds
it from another seed: common/tasks/toy.py), and the skip rules of tests that need the code sandbox or a peer."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import datasets  # noqa: F401  (see below)
import pytest
from accelerate.state import AcceleratorState, GradientState, PartialState

from common.tasks.toy import TOY_DIR, prepare_toy

# datasets' logging handler writes to the sys.stderr of the moment datasets is first imported. The code imports it
# lazily (a refusal need not wait for it), so a first import inside a test would bind the handler to that test's
# captured stream, closed afterwards: a later test's log line would then print a "Logging error" traceback. Imported
# here, before any capture, it writes to the real stderr, as in a user's process.

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    """Tests marked `sandbox` run model-written code in bubblewrap (common/engines/sandbox.py); tests marked `peer`
    compare an estimator with a peer's own code (TRL, from requirements-test.txt). Where the sandbox cannot start or the
    peer is not installed they are skipped, with the reason naming the fix, unless REQUIRE_SANDBOX=1 / REQUIRE_PEERS=1
    (CI sets both): then they run and fail, so a CI machine that lost either cannot pass by skipping them. Tests marked
    `vllm` likewise, with REQUIRE_VLLM=1 (CI's vLLM stage): require_vllm."""
    sandboxed = [item for item in items if item.get_closest_marker("sandbox")]
    if sandboxed and os.environ.get("REQUIRE_SANDBOX") != "1":
        from common.engines.sandbox import SandboxUnavailable, isolation

        try:
            isolation()
        except SandboxUnavailable as e:
            for item in sandboxed:
                item.add_marker(pytest.mark.skip(reason=f"no code sandbox on this machine: {e}".replace("\n", " ")))
    peers = [item for item in items if item.get_closest_marker("peer")]
    if peers and os.environ.get("REQUIRE_PEERS") != "1" and importlib.util.find_spec("trl") is None:
        for item in peers:
            item.add_marker(pytest.mark.skip(reason="TRL is not installed: pip install -r requirements-test.txt"))
    require_vllm([item for item in items if item.get_closest_marker("vllm")])
    # Tests that read the toy's weights (its fixture, toy_workdir, directly or through another): the ones whose
    # outcome could hang on one build's floats, which CI runs on a second toy too (.ci/run: -m toy, TOY_SEED=1).
    for item in items:
        if "toy_workdir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.toy)


VLLM_PROBLEM = pytest.StashKey[str]()


def require_vllm(items) -> None:
    """Tests marked `vllm` need vLLM with a device (common/engines/vllm_engine.py vllm_unavailable_reason). Where it is
    not installed, or has no device, they are skipped with the reason, unless REQUIRE_VLLM=1 (CI's vLLM stage, .ci/run):
    then each fails with the reason, so that stage cannot pass with every test skipped. Where vLLM is installed but
    cannot be imported, each fails with the import's error whatever REQUIRE_VLLM says: a broken install is an
    error, never a skip. The failures come in pytest_runtest_setup, before the tests' fixtures are built."""
    if not items:
        return
    from common.engines.vllm_engine import VLLMBroken, vllm_unavailable_reason

    try:
        reason = vllm_unavailable_reason()
    except VLLMBroken as e:
        for item in items:
            item.stash[VLLM_PROBLEM] = str(e)
        return
    if reason is None:
        return
    for item in items:
        if os.environ.get("REQUIRE_VLLM") == "1":
            item.stash[VLLM_PROBLEM] = f"REQUIRE_VLLM=1, and {reason}"
        else:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The failures require_vllm decided: before the skip markers (a GPU-only vLLM test fails too) and fixtures."""
    problem = item.stash.get(VLLM_PROBLEM, None)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def toy_workdir(tmp_path_factory):
    """A working directory holding runs/toy (the scripts find the toy preset there). With TOY_CACHE=DIR set (.ci/run
    sets it), the toy is built in DIR once, or reused from there if an earlier session built the same version, and
    copied in: CI's vLLM stage reuses the CPU stage's build (about 2 minutes)."""
    workdir = tmp_path_factory.mktemp("work")
    if os.environ.get("TOY_CACHE"):
        cache = os.path.abspath(os.environ["TOY_CACHE"])
        prepare_toy(cache)  # under its lock: CI's stages run side by side, one builds, the others wait for it
        shutil.copytree(cache, workdir / TOY_DIR)
    else:
        prepare_toy(str(workdir / TOY_DIR))
    return workdir


@pytest.fixture(scope="session")
def smollm2_workdir(tmp_path_factory):
    """A working directory holding runs/smollm2, the real model and its task (common/tasks/smollm2.py; the preset's
    paths are relative to it). Downloaded (98 MB) and converted once: into SMOLLM2_CACHE=DIR when it is set (.ci/run
    sets it; a later session reuses the folder), else into a temporary folder."""
    from common.tasks.smollm2 import SMOLLM2_DIR, prepare_smollm2

    workdir = tmp_path_factory.mktemp("real")
    target = workdir / SMOLLM2_DIR
    target.parent.mkdir(parents=True)
    if os.environ.get("SMOLLM2_CACHE"):
        cache = os.path.abspath(os.environ["SMOLLM2_CACHE"])
        prepare_smollm2(cache)
        os.symlink(cache, target)  # read only: the runs write their own folders beside it
    else:
        prepare_smollm2(str(target))
    return workdir


@pytest.fixture
def in_toy_workdir(toy_workdir, monkeypatch):
    monkeypatch.chdir(toy_workdir)
    return toy_workdir


def run_script(module, argv: list[str]) -> str:
    """Run `module.main` in this process, as `python script.py ARGV` would; returns the run folder."""
    from common.args import parse_args

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return module.main(parse_args(module.Args, argv))


LEARNING_BARS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "learning_bars.json")
# The spread of one toy's seeds counted for at least this much: three seeds underestimate it (their std was
# 0.002-0.037 on the toys measured).
LEARNING_SPREAD = 0.01


def learning_bar(name: str, toy: str = TOY_DIR, digest: str | None = None) -> float:
    """The gain in held-out accuracy an estimator's 50-step toy run must reach (its test_toy_learns), from the runs of
    benchmarks/learning_bars.py (tests/data/learning_bars.json): the mean gain less 3 standard deviations (at least
    LEARNING_SPREAD) over the seeds run on this very toy, known by the sha256 of its weights; on a toy not measured
    (another CPU's build), over all runs; and at least 0.04, two standard errors of a 500-prompt evaluation."""
    import hashlib
    import statistics

    with open(LEARNING_BARS) as f:
        runs = [r for r in json.load(f)["runs"] if r["name"] == name]
    if digest is None:
        with open(os.path.join(toy, "model", "model.safetensors"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    gains = [r["gain"] for r in runs if r["toy_sha256"] == digest] or [r["gain"] for r in runs]
    spread = max(statistics.stdev(gains), LEARNING_SPREAD)
    return max(statistics.mean(gains) - 3 * spread, 0.04)


def step_files_named(script: str = "grpo.py") -> set[str]:
    """The common/ files a script's docstring names in its "One step" paragraph: the files one step
    calls into (benchmarks/step_path.py records them; tests/test_siblings.py holds the two equal)."""
    with open(os.path.join(REPO, script)) as f:
        docstring = f.read().split('"""')[1]
    paragraph = docstring[docstring.index("One step"):].split("\n\n")[0]
    return set(re.findall(r"common/[\w/]+\.py", " ".join(paragraph.split())))


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# torch.distributed's variables: a VLLMEngine in the test process sets them (external_launcher reads them), and a
# child that inherited them would join, or collide with, the test process's group instead of starting its own.
DIST_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env() -> dict:
    """The environment of a script run by a test: this one, less torch.distributed's variables, one thread."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARIABLES}
    path = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)  # packages installed by PYTHONPATH too
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def launch(cwd, script: str, argv: list[str], num_processes: int = 1, config: str | None = None, sgd: bool = False,
           env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`accelerate launch` of a script (a path under the repository) in `cwd`, on the CPU, in fp32.

    One process: `--cpu`. Several: torchrun's processes through tests/dist_runner.py, which connects them over gloo
    (`accelerate launch --cpu --num_processes 2` would start only one) and applies an FSDP `config` on the CPU. A
    `config` file from configs/accelerate/ is read as it is, with what cannot hold on a CPU test machine overridden
    on the command line: --num_processes, --mixed_precision no (exact comparisons in fp32), a free port.
    `sgd`: plain SGD instead of AdamW (tests/sgd_runner.py)."""
    env = {**subprocess_env(), **(env or {})}
    if config and uses_deepspeed(config):
        env["TORCH_EXTENSIONS_DIR"] = deepspeed_cpu_op_built()
    how = ["--config_file", config] if config else ["--cpu"] if num_processes == 1 else ["--multi_gpu"]
    runners = ([os.path.join(REPO, "tests", "dist_runner.py")] if num_processes > 1 else []) + (
        [os.path.join(REPO, "tests", "sgd_runner.py")] if sgd else [])
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_processes", str(num_processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), *runners, os.path.join(REPO, script), *argv]
    proc = run_bounded(cmd, timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if sgd:  # every process reports its rank: the processes formed one group of num_processes
        # searched, not matched per line: two processes share the pipe, and a line may follow another's partial one
        ranks = sorted(re.findall(r"sgd_runner: process \d+ of \d+", proc.stdout))
        expected = [f"sgd_runner: process {i} of {num_processes}" for i in range(num_processes)]
        assert ranks == expected, proc.stdout[-3000:]
    return proc


def run_bounded(cmd: list[str], timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` for a command that starts processes of its own (torchrun's
    workers, a vLLM server): past `timeout` seconds the command and every process under it are killed and the test
    fails with their output so far. subprocess.run's own timeout kills the command alone; torchrun's workers, in
    sessions of their own, would go on (a worker waiting in a collective for gloo's 30 minutes), holding a core or a
    port while the next tests run."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, err = proc.communicate()
            pytest.fail(f"timed out after {timeout} s, killed with the processes it started: {' '.join(cmd)}\n"
                        f"{out[-3000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL to a process and to every process under it (psutil: accelerate's own dependency)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        tree = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


DEEPSPEED_OP_BUILT = []  # this session's folder of DeepSpeed's CPU op, once built


def uses_deepspeed(config: str) -> bool:
    """An accelerate config file that launches DeepSpeed (configs/accelerate/zero2.yaml, zero3.yaml)."""
    with open(config) as f:
        return "deepspeed_config" in f.read()


def deepspeed_cpu_op_built() -> str:
    """The folder (for TORCH_EXTENSIONS_DIR) where DeepSpeed's shared-memory CPU op is built, once per session, for
    this Python environment: ZeRO on a CPU builds it in every process that starts (torch.utils.cpp_extension, 30-90 s
    of compiling where it is not yet built), under a lock file that a process killed while building leaves behind,
    and every later ZeRO process then waits for that file to go, for ever (a killed CI run left one here).
    Built here first, the launched processes find it up to date and hold the lock a moment only. One folder per
    environment: two environments' builds differ (their include paths), and sharing one folder rebuilt it at each
    switch (CI runs two side by side). A lock file found here, under this session's own lock (fcntl's, released
    with its process), is such a leftover and is removed first."""
    if DEEPSPEED_OP_BUILT:
        return DEEPSPEED_OP_BUILT[0]
    import fcntl
    import hashlib

    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    folder = os.path.join(base, "tests-" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:12])
    os.makedirs(folder, exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        leftover = os.path.join(folder, "deepspeed_shm_comm", "lock")
        if os.path.exists(leftover):
            os.remove(leftover)
        build = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"  # DeepSpeed's own call, its rules
        done = run_bounded([sys.executable, "-c", build], 600, env={**subprocess_env(), "TORCH_EXTENSIONS_DIR": folder})
        assert done.returncode == 0, f"DeepSpeed's CPU op did not build:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    DEEPSPEED_OP_BUILT.append(folder)
    return folder
