"""The client of a rollout server: the engine interface of common/engines/rollout.py over HTTP, to
`vllm serve` (with common/engines/vllm_worker.py's disk engine) or to common/engines/serve.py
(transformers' engine, the exact-seed reference).

--server_url http://HOST:PORT switches a script to it (TRL's vllm_mode="server"); imported only
then. Weights reach the server through the filesystem: after each step the trainer writes the full
weights (LoRA merged) as safetensors to SYNC_DIR/.version_N.tmp, renames the folder to
SYNC_DIR/version_N once complete and tells the server N (vllm serve: its pause / start / update /
finish / resume handshake, SYNC_DIR the run's server_weights folder; common.engines.serve: POST
/sync, SYNC_DIR its --sync_dir); the server loads them before any later generate request, and
version N-1 is removed. Every answer names the weight version that sampled it, checked against the
one pushed last. Every request waits at most --server_timeout seconds for an answer: one that gets
none, or an error, stops the run with one line naming the server and the request (never a silent
hang).

One client per trainer: the main process sends every request, one at a time and in the order they
were made, from a thread of its own (the other processes' rows are gathered into its generate
requests, and their answers scattered back). A sync therefore reaches the server before any generate
request made after it, and a request can be made now and its answer taken later: with --rollout_lag
K >= 1, `OverlapQueue` makes the requests of steps s+1..s+K before step s trains, so the server
samples while the trainer trains.
"""

import json
import os
import queue
import re
import shutil
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http.client import HTTPException

import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list, gather_object


def call(url: str, path: str, body: dict | None, timeout: float, what: str) -> dict:
    """POST `body` (GET without one) to url + path; the JSON answer, or SystemExit with one line
    saying why none."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        try:
            return json.loads(body)
        except ValueError:  # another kind of service at that address (a web page, a proxy's notice)
            raise SystemExit(f"error: the service at {url} answered the {what} with "
                             f"{body[:60]!r}, not JSON: is vllm serve (or python -m "
                             f"common.engines.serve) running at this address?") from None
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read())["error"]
            # vllm serve's form
            reason = reason.get("message", reason) if isinstance(reason, dict) else reason
        except Exception:
            reason = f"HTTP {e.code}"
        raise SystemExit(
            f"error: the rollout server at {url} refused the {what}: {reason}") from None
    except (TimeoutError, socket.timeout):
        why = f"within {timeout:g} s (--server_timeout): it is hung, or slower than the limit"
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            why = f"within {timeout:g} s (--server_timeout): it is hung, or slower than the limit"
        else:
            why = (f"({e.reason}): is vllm serve (or python -m "
                   f"common.engines.serve) running at this address?")
    except (ConnectionError, HTTPException) as e:
        # it closed the connection: it died while answering
        why = f"({type(e).__name__}: the connection closed: the server stopped?)"
    raise SystemExit(f"error: the rollout server at {url} did not answer the {what} {why}")


# vllm serve: rows of one generate request in flight at once (its scheduler batches them)
GENERATE_CONCURRENCY = 64


def served_by_vllm(url: str, timeout: float) -> bool:
    """Whether `vllm serve` answers at url (its /health has an empty body; common.engines.serve's is
    JSON), refusing one started without VLLM_SERVER_DEV_MODE=1 (no weight-update routes then)."""
    request = urllib.request.Request(url.rstrip("/") + "/health")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except Exception:
        # raises SystemExit with the reason in one line
        call(url, "/health", None, timeout, "health check")
        raise
    if body.strip():
        return False
    try:
        call(url, "/weight_info", None, timeout, "weight query")
    except SystemExit:
        raise SystemExit(f"error: vllm serve at {url} has no weight-update routes: start it with "
                         f"VLLM_SERVER_DEV_MODE=1 (docs/rollouts.md, \"Server mode\")") from None
    return True


def weight_transfer_backend(url: str, timeout: float) -> str | None:
    """vllm serve's --weight-transfer-config backend ("disk": common/engines/vllm_worker.py's;
    "nccl": GPUs), read from its configuration (/server_info, a VLLM_SERVER_DEV_MODE route)."""
    config = call(url, "/server_info?config_format=json", None, timeout,
                  "configuration query")["vllm_config"]
    return (config.get("weight_transfer_config") or {}).get("backend")


def server_problems(args) -> list[str]:
    """Before any weights load (common/rails/checks.py): the address is http(s)://HOST:PORT, a
    rollout server answers there, and it runs the trainer's --dtype."""
    if not re.fullmatch(r"https?://[^/\s:]+(:\d+)?/?", args.server_url):
        return [f"--server_url {args.server_url!r}: give http://HOST:PORT, where vllm serve (or "
                f"python -m common.engines.serve) listens"]
    try:
        vllm = served_by_vllm(args.server_url, args.server_timeout)
        info = None if vllm else call(args.server_url, "/health", None, args.server_timeout,
                                      "health check")
    except SystemExit as e:
        return [str(e).removeprefix("error: ")]
    if info is not None and not (isinstance(info, dict) and {"dtype", "sync_dir"} <= info.keys()):
        return [f"--server_url {args.server_url}: the service there is neither vllm serve nor "
                f"python -m common.engines.serve (its /health answered {str(info)[:60]})"]
    problems = []
    backend = weight_transfer_backend(args.server_url, args.server_timeout) if vllm else None
    if vllm and backend not in ("disk", "nccl"):
        if backend:
            runs = f"the weight-transfer backend {backend!r}"
        else:
            runs = "without --weight-transfer-config"
        problems.append(f"--server_url {args.server_url}: vllm serve runs {runs}; start it with "
                        f"--weight-transfer-config '{{\"backend\": \"disk\"}}' (a filesystem it "
                        f"shares with the trainer) or '{{\"backend\": \"nccl\"}}' (GPUs) "
                        f"(docs/rollouts.md)")
    if backend == "nccl" and not torch.cuda.is_available():
        problems.append(f"--server_url {args.server_url}: vllm serve takes its weights "
                        f"over NCCL, which needs a CUDA GPU in the trainer too (this "
                        f"process sees none); start the server with "
                        f"--weight-transfer-config '{{\"backend\": \"disk\"}}'")
    if info is not None and info["dtype"] != args.dtype:
        problems.append(f"--server_url {args.server_url}: the server runs --dtype {info['dtype']}, "
                        f"the trainer --dtype {args.dtype}; start it with the trainer's")
    if args.rollout_lag > 0:  # OverlapQueue: the server samples while the trainer trains
        if args.old_logp_source != "sampler":
            problems.append(f"--server_url with --rollout_lag {args.rollout_lag}: the trainer no "
                            f"longer holds the weights that sampled a batch when it arrives; add "
                            f"--old_logp_source sampler (the server's log-probs are the behaviour "
                            f"policy's), or use --rollout_lag 0")
        for flag, on in [("--dynamic_sampling", args.dynamic_sampling),
                         (f"--max_turns {args.max_turns}", args.max_turns > 1)]:
            if on:
                problems.append(f"{flag} with --server_url and --rollout_lag "
                                f"{args.rollout_lag}: its later requests depend on earlier "
                                f"answers, so they cannot be sent ahead; use --rollout_lag 0 in "
                                f"server mode, or the colocated engine")
    return problems


def write_version(tensors, sync_dir: str, version: int) -> str:
    """Write (name, tensor) buckets to sync_dir/version_N, one safetensors file per bucket, in a
    temporary folder renamed into place once every file is complete: a reader sees the whole version
    or none of it."""
    from safetensors.torch import save_file

    final = os.path.join(sync_dir, f"version_{version}")
    tmp = os.path.join(sync_dir, f".version_{version}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for i, bucket in enumerate(tensors):
            save_file({name: t.detach().to("cpu").contiguous() for name, t in bucket},
                      os.path.join(tmp, f"model-{i:05d}.safetensors"))
    except BaseException:  # a full disk, Ctrl-C: no half-written folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # a version of an earlier trainer run against this folder
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


@dataclass
class Sent:
    """A generate request made and not yet taken: the main process's future answer (None on the
    others) and how many rows each process put into it."""

    future: Future | None
    sizes: list[int]


class ServerEngine:
    """generate() and push_weights() as rollout.HFEngine's, through the server; send_ahead() makes a
    generate request whose answer a later generate() of the same rows takes (OverlapQueue). Every
    method is collective: each process calls it at the same point."""

    def __init__(self, args, accelerator, model=None, sync_dir: str | None = None):
        self.url = args.server_url
        self.timeout = args.server_timeout
        self.accelerator = accelerator
        self.vllm = served_by_vllm(self.url, self.timeout)
        # vllm serve: weights go to a folder of the trainer's that the server can read (sync_dir)
        if self.vllm:
            self.sync_dir = sync_dir
            version = call(self.url, "/weight_info", None, self.timeout, "weight query")
            weight_version = str(version["weight_version"])
            self.version = int(version["weight_version"]) if weight_version.isdigit() else 0
            self.backend = weight_transfer_backend(self.url, self.timeout)
            self.sender = None  # nccl: built once
            if accelerator.is_main_process:
                os.makedirs(self.sync_dir, exist_ok=True)
        else:  # python -m common.engines.serve names its folder
            info = call(self.url, "/health", None, self.timeout, "health check")
            self.sync_dir = info["sync_dir"]
            self.version = info["version"]
        # the rows' seeds -> their request, or its answer (ids, logps)
        self.ahead: dict[tuple, Sent | tuple] = {}
        self.outbox = queue.SimpleQueue()
        self.failure = None
        self.last = None
        if accelerator.is_main_process:
            threading.Thread(target=self.send_in_order, name="rollout-server-client",
                             daemon=True).start()
        if model is not None:
            # a resumed or LoRA-wrapped policy differs from the server's --model files
            self.push_weights(model)

    def send_in_order(self) -> None:
        """The main process's sender: each request in turn; after the first failure every later one
        fails with its message (a generate behind a failed sync would meet the wrong weights)."""
        while True:
            future, path, body, what, then = self.outbox.get()
            if self.failure is None:
                try:
                    if callable(path):
                        answer = path(body)
                    else:
                        answer = call(self.url, path, body, self.timeout, what)
                    future.set_result(then(answer) if then else answer)
                    continue
                except SystemExit as e:
                    self.failure = str(e)
                except Exception as e:
                    # an answer without its fields: the thread must not die with it
                    self.failure = (f"error: the answer of the rollout server at "
                                    f"{self.url} to the {what}: {e!r}")
            future.set_exception(SystemExit(self.failure))

    def post(self, path, body: dict, what: str, then=None) -> Future:
        """Queue a request (main process): a path of the server, or a function of ours making
        several (vllm serve); its answer, passed through `then`, comes in the returned future."""
        self.last = future = Future()
        self.outbox.put((future, path, body, what, then))
        return future

    def send_ahead(self, prompt_ids: list[list[int]], seeds: list[int], *,
                   max_tokens: int | list[int], temperature: float, top_p: float,
                   stop: list[str] | None = None) -> None:
        """Make the generate request of these rows now, sampled with the weights last pushed; a
        later generate() of the same rows (seeds) takes its answer. Every process's rows go in one
        request."""
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"one seed per prompt: got {len(seeds)} seeds for "
                             f"{len(prompt_ids)} prompts")
        shares = [(prompt_ids, seeds, max_tokens)]
        if self.accelerator.num_processes > 1:
            shares = gather_object(shares)
        future = None
        if self.accelerator.is_main_process:
            budgets = [m for ids, _, b in shares
                       for m in (b if isinstance(b, list) else [b] * len(ids))]
            one_budget = all(isinstance(b, int) for _, _, b in shares) and len(set(budgets)) <= 1
            version = self.version
            body = dict(prompt_ids=[p for ids, _, _ in shares for p in ids],
                        seeds=[s for _, row_seeds, _ in shares for s in row_seeds],
                        max_tokens=max_tokens if one_budget else budgets, temperature=temperature,
                        top_p=top_p, stop=stop, version=version)

            # the canary: these rows came from those weights
            def sampled_by_that_version(answer: dict) -> dict:
                if answer.get("version") != version:
                    raise SystemExit(f"error: the rollout server at {self.url} answered a request "
                                     f"for weights version {version} with version "
                                     f"{answer.get('version')}")
                return answer

            future = self.post(self.vllm_generate if self.vllm else "/generate", body,
                               f"generate request ({len(body['seeds'])} prompts, "
                               f"weights version {version})", sampled_by_that_version)
        self.ahead[tuple(seeds)] = Sent(future, [len(ids) for ids, _, _ in shares])

    def answer(self, seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """The answer to the request of these rows (waiting for it), this process's share; kept
        until generate() takes it (a checkpoint saves it: OverlapQueue.save)."""
        key = tuple(seeds)
        sent = self.ahead[key]
        if not isinstance(sent, Sent):
            return sent
        outcome = [None, None]  # answer, error
        if self.accelerator.is_main_process:
            try:
                outcome[0] = sent.future.result()
            except SystemExit as e:
                outcome[1] = str(e)
        if self.accelerator.num_processes > 1:  # each process gets its rows (or the error)
            shares = []
            start = 0
            for size in sent.sizes if self.accelerator.is_main_process else []:
                rows = slice(start, start + size)
                if outcome[1]:
                    shares.append([None, outcome[1]])
                else:
                    share = {k: outcome[0][k][rows] for k in ("completion_ids", "sampler_logp")}
                    shares.append([share, None])
                start += size
            received = [None]
            dist.scatter_object_list(received, shares or None, src=0)
            outcome = received[0]
        if outcome[1]:
            raise SystemExit(outcome[1])
        self.ahead[key] = outcome[0]["completion_ids"], outcome[0]["sampler_logp"]
        return self.ahead[key]

    def generate(self, model, prompt_ids: list[list[int]], seeds: list[int], *,
                 max_tokens: int | list[int], temperature: float, top_p: float,
                 batch_size: int | None = None,
                 stop: list[str] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """As rollout.HFEngine.generate, sampled by the server (`model` unused): the answer of the
        request sent ahead for these rows, or of one made now, answered after the requests before
        it."""
        if tuple(seeds) not in self.ahead:
            self.send_ahead(prompt_ids, seeds, max_tokens=max_tokens, temperature=temperature,
                            top_p=top_p, stop=stop)
        answer = self.answer(seeds)
        del self.ahead[tuple(seeds)]
        return answer

    @torch.no_grad()
    def push_weights(self, model) -> None:
        """Collective (FSDP and ZeRO-3 gather every parameter): every process iterates the weights,
        the main one writes them and queues the sync, which the server loads before any generate
        request made after it."""
        # HF checkpoint names, LoRA merged, shards gathered
        from common.engines.vllm_engine import iter_weight_buckets

        if self.vllm and self.backend == "nccl":
            return self.nccl_push(model)
        buckets = iter_weight_buckets(self.accelerator.unwrap_model(model))
        version = self.version + 1
        error = [None]
        if self.accelerator.is_main_process:
            try:
                write_version(buckets, self.sync_dir, version)
            except OSError as e:  # a full disk: every process stops with the main one's message
                error[0] = f"error: cannot write weights version {version} to {self.sync_dir}: {e}"
            previous = os.path.join(self.sync_dir, f"version_{self.version}")

            def loaded(answer: dict) -> dict:
                if answer["version"] != version:
                    raise SystemExit(f"error: the rollout server at {self.url} acknowledged "
                                     f"version {answer['version']}, not {version}")
                shutil.rmtree(previous, ignore_errors=True)
                return answer

            if error[0] is None:
                self.post(self.vllm_sync if self.vllm else "/sync", {"version": version},
                          f"weight sync (version {version} in {self.sync_dir})", loaded)
        else:
            for _ in buckets:  # the collective gathers, in step with the main process
                pass
        if self.accelerator.num_processes > 1:
            broadcast_object_list(error)
        if error[0]:
            raise SystemExit(error[0])
        self.version = version

    def vllm_generate(self, body: dict) -> dict:
        """A generate request to vllm serve (the sender thread): one POST /inference/v1/generate per
        row, with its own seed and budget (a batched /v1/completions request shares one seed),
        GENERATE_CONCURRENCY at a time; the answer in common.engines.serve's form, with the weight
        version every row was sampled by (a row's tokens may span versions only if a sync landed
        mid-row: then it names both and is refused)."""
        n = len(body["seeds"])
        # 0: the server's own --model weights
        version = str(body["version"] or "default")
        if isinstance(body["max_tokens"], list):
            budgets = body["max_tokens"]
        else:
            budgets = [body["max_tokens"]] * n
        if not body["stop"]:
            text = dict(detokenize=False)
        else:
            text = dict(stop=body["stop"], include_stop_str_in_output=True)

        def one(i: int) -> tuple[list[int], list[float], set[str]]:
            params = dict(n=1, seed=body["seeds"][i], max_tokens=budgets[i],
                          temperature=body["temperature"], top_p=body["top_p"], logprobs=0, **text)
            answer = call(self.url, "/inference/v1/generate",
                          {"token_ids": body["prompt_ids"][i], "sampling_params": params},
                          self.timeout,
                          f"generate request (row {i} of {n}, weights version {version})")
            choice = answer["choices"][0]
            logps = [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
            versions = {w["version"] for w in choice.get("weight_versions") or []}
            return choice["token_ids"], logps, versions

        with ThreadPoolExecutor(GENERATE_CONCURRENCY) as pool:
            rows = list(pool.map(one, range(n)))
        versions = set().union(*(v for _, _, v in rows))
        return {"completion_ids": [ids for ids, _, _ in rows],
                "sampler_logp": [lp for _, lp, _ in rows],
                "version": (body["version"] if versions <= {version}
                            else ", ".join(sorted(versions)))}

    def vllm_sync(self, body: dict) -> dict:
        """A weight sync with vllm serve (the sender thread), vLLM's own handshake: pause (letting
        running requests finish), start, update from the version's folder
        (common/engines/vllm_worker.py's disk engine), finish with the version, drop the prefix
        cache (its blocks hold the old weights' keys and values), resume."""
        version = body["version"]
        what = f"weight sync (version {body['version']})"
        path = os.path.abspath(os.path.join(self.sync_dir, f"version_{version}"))
        try:
            for route, payload in [("/pause?mode=wait", {}), ("/start_weight_update", {}),
                                   ("/update_weights", {"update_info": {"path": path}}),
                                   ("/finish_weight_update", {"weight_version": str(version)}),
                                   ("/reset_prefix_cache", {})]:
                call(self.url, route, payload, self.timeout, f"{what}: {route.split('?')[0]}")
        finally:
            # a refused update leaves the server unpaused (vLLM ends the
            # update itself), for the next client
            call(self.url, "/resume", {}, self.timeout, f"{what}: /resume")
        return {"version": version}

    def nccl_push(self, model) -> None:
        """A weight sync over NCCL (GPUs; common/engines/nccl_sync.py, vLLM's own trainer engine).
        The requests made before it are answered first (their rows belong to the weights before
        it); then the server pauses, its workers receive the broadcast, it finishes with the
        version, drops its prefix cache and resumes. Collective, and the trainer waits for it: no
        second copy of the weights is kept for a sync queued behind requests."""
        from common.engines.nccl_sync import nccl_sender

        main = self.accelerator.is_main_process
        version = self.version + 1
        what = f"weight sync (version {version}, NCCL)"
        self.wait()
        # the rendezvous of the trainer's main process with every worker of the server
        if self.sender is None:
            size = 0
            if main:
                size = call(self.url, "/get_world_size", None, self.timeout,
                            "world size query")["world_size"]
            self.sender = nccl_sender(self.url, self.timeout, self.accelerator.unwrap_model(model),
                                      self.accelerator.process_index, size)
        if main:
            call(self.url, "/pause?mode=wait", {}, self.timeout, f"{what}: /pause")
            self.sender.client.version = str(version)
        try:
            # start / update (while the main process broadcasts) / finish, with version
            self.sender.send_weights()
        except Exception as e:
            raise SystemExit(
                f"error: the {what} to the rollout server at {self.url} failed: {e}") from None
        finally:
            if main:
                try:
                    call(self.url, "/reset_prefix_cache", {}, self.timeout,
                         f"{what}: /reset_prefix_cache")
                finally:
                    call(self.url, "/resume", {}, self.timeout, f"{what}: /resume")
        self.version = version

    def collective(self) -> bool:
        """Under several processes every generate call gathers the rows of all of them (multi-turn
        rollouts then make the same number of calls everywhere: common/engines/multiturn.py)."""
        return self.accelerator.num_processes > 1

    def wait(self) -> None:
        """Until the server has answered every request made so far (main process); its error, if one
        failed."""
        if self.accelerator.is_main_process and self.last is not None:
            self.last.result()

    def wake_up(self) -> None: ...
    def sleep(self) -> None: ...

    def shutdown(self) -> None:
        """The server holds the final weights once the run ends (or the run stops with the reason it
        does not)."""
        self.wait()
        if getattr(self, "sender", None) is not None:  # NCCL: leave the transfer group
            self.sender.shutdown()


class OverlapQueue:
    """Server mode at --rollout_lag K >= 1, in place of sampling.RolloutQueue: before step s
    trains, the generate requests of steps s+1..s+K have been made, so the server samples them while
    the trainer trains (verl's one-step-off and fully async modes, prime-rl's async level). The
    request of step s+K is made at step s, after the push of step s's weights: the weights the
    colocated queue samples it with, so a run matches a colocated run at the same lag, step for
    step. The rewards and the batch's tensors are made when the answer is taken. No batch is more
    than K steps stale: asserted here, logged as rollout/staleness."""

    def __init__(self, lag: int, engine: ServerEngine, requests, **sampling):
        self.lag = lag
        self.engine = engine
        self.requests = requests
        self.sampling = sampling
        # step -> (the step its request was made at, its seeds)
        self.sent: dict[int, tuple[int, list[int]]] = {}
        self.ready = None  # the batch of the step being trained, between `put` and `take`

    def steps_to_sample(self, step: int, total_steps: int) -> list[int]:
        """Makes the generate requests of steps step..step+K not yet made (never one at or past
        `total_steps`); the batch of `step` alone is made now, its generate call taking the answer
        of the request made for it."""
        for index in range(step, min(step + self.lag, total_steps - 1) + 1):
            if index not in self.sent:
                prompt_ids, seeds = self.requests(index)
                self.engine.send_ahead(prompt_ids, seeds, **self.sampling)
                self.sent[index] = (step, seeds)
        return [step]

    def put(self, batch, sampled_at: int) -> None:
        # made now from an answer sampled when its request was made (`take` says when)
        self.ready = batch

    def take(self, step: int):
        batch = self.ready
        self.ready = None
        staleness = step - self.sent.pop(step)[0]
        if not 0 <= staleness <= self.lag:
            raise RuntimeError(f"step {step + 1}: its batch is {staleness} steps stale, "
                               f"--rollout_lag is {self.lag}")
        batch.sampled_at = step - staleness
        batch.staleness = staleness
        return batch

    def save(self, state_dir: str, process_index: int) -> None:
        """Collective: the answers of the requests made ahead (waiting for them), so a resumed run
        trains on what this one would have."""
        saved = {index: (at, seeds, *self.engine.answer(seeds))
                 for index, (at, seeds) in sorted(self.sent.items())}
        if saved:
            torch.save(saved, os.path.join(state_dir, f"rollout_requests_{process_index}.pt"))

    def load(self, state_dir: str, process_index: int) -> None:
        path = os.path.join(state_dir, f"rollout_requests_{process_index}.pt")
        saved = torch.load(path, weights_only=True) if os.path.exists(path) else {}
        for index, (at, seeds, ids, logps) in saved.items():
            self.sent[index] = (at, seeds)
            self.engine.ahead[tuple(seeds)] = ids, logps


def overlap_queue(run, requests) -> OverlapQueue:
    """The queue of a server-mode run at --rollout_lag K >= 1: `requests(index)`, step index's
    prompt ids and seeds (common/sampling.py round_prompts, first round)."""
    args = run.args
    return OverlapQueue(args.rollout_lag, run.engine, requests,
                        max_tokens=args.max_completion_length, temperature=args.temperature,
                        top_p=args.top_p)
