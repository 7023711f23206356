"""Several nodes as users launch them (the README's multi-node command: `accelerate launch --num_machines N
--machine_rank R --main_process_ip ...`), simulated on one machine: two "nodes" of one process each on localhost,
two separate launches, gloo, one shared output folder."""

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, free_port, launch, read_metrics, subprocess_env
from test_train import SMALL, final_weights

pytestmark = pytest.mark.slow
ARGV = SMALL + ["--total_steps", "2", "--save_steps", "1"]


def start_node(cwd, rank: int, port: int, argv: list[str], rendezvous_s: int = 120) -> subprocess.Popen:
    """One node of two: the README's multi-node command with --num_processes 2 --num_machines 2 (one process per
    node), on the CPU through tests/dist_runner.py (as conftest.launch does for one node)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
           "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
           "--main_process_port", str(port), "--rdzv_conf", f"timeout={rendezvous_s}", "--mixed_precision", "no",
           "--dynamo_backend", "no", os.path.join(REPO, "tests", "dist_runner.py"), os.path.join(REPO, "grpo.py"),
           *argv]
    return subprocess.Popen(cmd, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(node: subprocess.Popen, timeout: int = 600) -> tuple[int, str]:
    out, _ = node.communicate(timeout=timeout)
    return node.returncode, out


def test_two_nodes_take_the_one_node_steps_and_write_each_file_once(in_toy_workdir):
    """Two nodes of one process each equal one node of two processes, step for step (every metric but time and
    memory, the final weights bit for bit); the shared folder holds one run: each step's metrics line once, one
    start in args_history.jsonl, each checkpoint once and complete."""
    port = free_port()
    nodes = [start_node(in_toy_workdir, rank, port, ARGV + ["--run_name", "two_nodes"]) for rank in (0, 1)]
    results = [finish(node) for node in nodes]
    assert all(code == 0 for code, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    launch(in_toy_workdir, "grpo.py", ARGV + ["--run_name", "one_node"], num_processes=2)
    two, one = (os.path.join(in_toy_workdir, "runs", name) for name in ("two_nodes", "one_node"))
    drop = ("time/", "memory/", "cpu/")
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith(drop)} for m in ms]  # noqa: E731
    assert strip(read_metrics(two)) == strip(read_metrics(one))
    assert [m["step"] for m in read_metrics(two)] == [1, 2]  # one writer: no line twice
    with open(os.path.join(two, "args_history.jsonl")) as f:
        assert len(f.readlines()) == 1
    assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["step_1", "step_2"]  # no temporary folder left
    a, b = final_weights(two, 2), final_weights(one, 2)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_node_started_with_other_arguments_stops_every_node_with_one_line(in_toy_workdir):
    """A node with another --learning_rate trained silently with it (its replica diverging from the others'): now
    every process compares its flags with process 0's before anything loads, and every node stops with the line."""
    port = free_port()
    nodes = [start_node(in_toy_workdir, rank, port, ARGV + ["--run_name", "other_args", "--learning_rate", lr])
             for rank, lr in ((0, "1e-3"), (1, "1e-2"))]
    results = [finish(node) for node in nodes]
    line = ("error: process 1 was started with --learning_rate 0.01, process 0 with 0.001: start every node with "
            "the same arguments")
    for code, out in results:
        assert code != 0 and line in out.splitlines(), out[-3000:]
    assert not os.path.exists(os.path.join(in_toy_workdir, "runs", "other_args"))  # nothing claimed, nothing loaded


def test_a_node_that_never_joins_stops_the_other_within_the_rendezvous_timeout(in_toy_workdir):
    """Node 0 alone: torchrun's static rendezvous (what --main_process_ip starts) waits --rdzv_conf timeout=S
    seconds (600 by default), then stops with one line naming how many nodes joined; never a hang."""
    start = time.monotonic()
    code, out = finish(start_node(in_toy_workdir, 0, free_port(), ARGV + ["--run_name", "alone"], rendezvous_s=10),
                       timeout=300)
    assert code != 0 and "Timed out after" in out and "1/2 clients joined" in out, out[-3000:]
    assert time.monotonic() - start < 200

