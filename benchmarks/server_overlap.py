"""Server mode's overlap (--server_url with --rollout_lag K): the step time against K, with a sampler whose generate
takes G seconds and an update that takes T seconds (both stand-ins that sleep).

    python benchmarks/server_overlap.py                                   # G = T = 0.5 s; K = 0, 1, 2, 4
    python benchmarks/server_overlap.py --generate_s 1.0 --train_s 0.5 --lags 0,1,2 --steps 16

Everything else is the real thing: the client (common/engines/server_client.py: ServerEngine's in-order sender, the
weight sync through the filesystem after every step, OverlapQueue at K >= 1 and sampling.RolloutQueue at K = 0,
as common/run.py picks them) and the server's HTTP handler (common/engines/serve.py make_handler), in threads of this
process. The step time is the wall time of the steps after the first K + 1 (the start, where the requests of steps
0..K are all made at once), divided by their number. Expected: G + T at K = 0; max(G, T) at K >= 1, plus the
sync and HTTP overheads (the `overhead` column: step time - max(G, T) at K >= 1, - (G + T) at K = 0).
"""

import argparse
import os
import sys
import tempfile
import threading
import time
from http.server import HTTPServer
from types import SimpleNamespace

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.engines.serve import VersionError, make_handler  # noqa: E402
from common.engines.server_client import OverlapQueue, ServerEngine  # noqa: E402
from common.sampling import RolloutQueue  # noqa: E402


class SleepingSampler:
    """common.engines.serve.Sampler's interface: generate sleeps `generate_s` and returns one token per row; a sync
    checks that the version's folder is there and takes it."""

    def __init__(self, sync_dir: str, generate_s: float):
        self.sync_dir, self.generate_s, self.version = sync_dir, generate_s, 0

    def info(self) -> dict:
        return {"model": "sleeping stand-in", "dtype": "float32", "engine": "sleep", "sync_dir": self.sync_dir,
                "version": self.version}

    def sync(self, version: int) -> dict:
        assert os.path.isdir(os.path.join(self.sync_dir, f"version_{version}"))
        self.version = version
        return {"version": version}

    def generate(self, request: dict) -> dict:
        if request["version"] != self.version:
            raise VersionError(f"asked for version {request['version']}, holding {self.version}")
        time.sleep(self.generate_s)
        n = len(request["seeds"])
        return {"completion_ids": [[1]] * n, "sampler_logp": [[-0.5]] * n, "version": self.version}


def step_time(lag: int, steps: int, generate_s: float, train_s: float) -> tuple[float, list[int]]:
    """Seconds per step after the first lag + 1, and each step's staleness."""
    with tempfile.TemporaryDirectory() as sync_dir:
        server = HTTPServer(("127.0.0.1", 0), make_handler(SleepingSampler(sync_dir, generate_s)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        args = SimpleNamespace(server_url=f"http://127.0.0.1:{server.server_port}", server_timeout=60.0)
        model = torch.nn.Linear(64, 64)  # what each push writes and the server's sync checks
        engine = ServerEngine(args, Accelerator(cpu=True), model)
        requests = lambda index: ([[5, 6, 7]] * 8, [1000 * index + j for j in range(8)])  # noqa: E731
        sampling = dict(max_tokens=4, temperature=1.0, top_p=1.0)
        queue = OverlapQueue(lag, engine, requests, **sampling) if lag > 0 else RolloutQueue(0)
        stale, start = [], None
        for step in range(steps):
            if step == lag + 1:
                start = time.perf_counter()
            for index in queue.steps_to_sample(step, steps):
                ids, logps = engine.generate(None, *requests(index), **sampling)
                queue.put(SimpleNamespace(ids=ids, logps=logps), sampled_at=step)
            stale.append(queue.take(step).staleness)
            time.sleep(train_s)  # the update
            with torch.no_grad():
                model.weight.add_(1.0)
            engine.push_weights(model)
        engine.shutdown()
        server.shutdown()
        return (time.perf_counter() - start) / (steps - lag - 1), stale


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generate_s", type=float, default=0.5, help="seconds each generate request takes (G)")
    p.add_argument("--train_s", type=float, default=0.5, help="seconds each update takes (T)")
    p.add_argument("--lags", default="0,1,2,4", help="values of --rollout_lag K")
    p.add_argument("--steps", type=int, default=12, help="steps per lag")
    a = p.parse_args(argv)
    G, T = a.generate_s, a.train_s
    lines = [f"G = {G} s per generate, T = {T} s per update, {a.steps} steps (sum {G + T:.2f}, max {max(G, T):.2f})",
             "", "| K | step time (s) | overhead (s) | staleness per step |", "| --- | --- | --- | --- |"]
    for lag in map(int, a.lags.split(",")):
        seconds, stale = step_time(lag, a.steps, G, T)
        lines.append(f"| {lag} | {seconds:.3f} | {seconds - (G + T if lag == 0 else max(G, T)):+.3f} | "
                     f"{' '.join(map(str, stale))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
