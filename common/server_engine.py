"""The client of a rollout server (common/serve.py): the engine interface of common/rollout.py over HTTP.

--server_url http://HOST:PORT switches a script to it (TRL's vllm_mode="server"); imported only then. Weights reach
the server through the filesystem: after each optimizer step the trainer writes the full weights (LoRA merged) as
safetensors to SYNC_DIR/.version_N.tmp, renames the folder to SYNC_DIR/version_N once complete, tells the server N,
and waits for its answer, which comes once the server has loaded them; it then removes version N-1. Every request
waits at most --server_timeout seconds for an answer: one that gets none, or an error, stops the run with one line
naming the server and the request (never a silent hang).
"""

import json
import os
import re
import shutil
import socket
import urllib.error
import urllib.request
from http.client import HTTPException

import torch
from accelerate.utils import broadcast_object_list


def call(url: str, path: str, body: dict | None, timeout: float, what: str) -> dict:
    """POST `body` (GET without one) to url + path; the JSON answer, or SystemExit with one line saying why none."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read())["error"]
        except Exception:
            reason = f"HTTP {e.code}"
        raise SystemExit(f"error: the rollout server at {url} refused the {what}: {reason}") from None
    except (TimeoutError, socket.timeout):
        why = f"within {timeout:g} s (--server_timeout): it is hung, or slower than the limit"
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            why = f"within {timeout:g} s (--server_timeout): it is hung, or slower than the limit"
        else:
            why = f"({e.reason}): is python -m common.serve running at this address?"
    except (ConnectionError, HTTPException) as e:  # it closed the connection: it died while answering
        why = f"({type(e).__name__}: the connection closed: the server stopped?)"
    raise SystemExit(f"error: the rollout server at {url} did not answer the {what} {why}")


def server_problems(args) -> list[str]:
    """Before any weights load (common/checks.py): the address is http(s)://HOST:PORT, a rollout server answers
    there, and it runs the trainer's --dtype."""
    if not re.fullmatch(r"https?://[^/\s:]+(:\d+)?/?", args.server_url):
        return [f"--server_url {args.server_url!r}: give http://HOST:PORT, where python -m common.serve listens"]
    try:
        info = call(args.server_url, "/health", None, args.server_timeout, "health check")
    except SystemExit as e:
        return [str(e).removeprefix("error: ")]
    if info["dtype"] != args.dtype:
        return [f"--server_url {args.server_url}: the server runs --dtype {info['dtype']}, the trainer --dtype "
                f"{args.dtype}; start it with the trainer's"]
    return []


def write_version(tensors, sync_dir: str, version: int) -> str:
    """Write (name, tensor) buckets to sync_dir/version_N, one safetensors file per bucket, in a temporary folder
    renamed into place once every file is complete: a reader sees the whole version or none of it."""
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
    shutil.rmtree(final, ignore_errors=True)  # a version of an earlier trainer run against this folder
    os.rename(tmp, final)
    return final


class ServerEngine:
    """generate() asks the server; push_weights() writes a version, has the server load it, and waits for that."""

    def __init__(self, args, accelerator, model):
        self.url, self.timeout, self.accelerator = args.server_url, args.server_timeout, accelerator
        info = call(self.url, "/health", None, self.timeout, "health check")
        self.sync_dir, self.version = info["sync_dir"], info["version"]
        self.push_weights(model)  # a resumed or LoRA-wrapped policy differs from the server's --model files

    def generate(self, model, prompt_ids: list[list[int]], seeds: list[int], *, max_tokens: int | list[int],
                 temperature: float, top_p: float, batch_size: int | None = None,
                 stop: list[str] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """As rollout.HFEngine.generate, sampled by the server with the version last pushed (`model` unused)."""
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"one seed per prompt: got {len(seeds)} seeds for {len(prompt_ids)} prompts")
        answer = call(self.url, "/generate", dict(prompt_ids=prompt_ids, seeds=seeds, max_tokens=max_tokens,
                                                  temperature=temperature, top_p=top_p, stop=stop,
                                                  version=self.version), self.timeout,
                      f"generate request ({len(prompt_ids)} prompts, weights version {self.version})")
        return answer["completion_ids"], answer["sampler_logp"]

    @torch.no_grad()
    def push_weights(self, model) -> None:
        """Collective (FSDP and ZeRO-3 gather every parameter): every process iterates the weights, the main one
        writes and syncs them; every process then knows the new version, or stops with the main one's message."""
        from common.vllm_engine import iter_weight_buckets  # HF checkpoint names, LoRA merged, shards gathered

        buckets = iter_weight_buckets(self.accelerator.unwrap_model(model))
        outcome = [None, None]  # version, error
        if self.accelerator.is_main_process:
            version = self.version + 1
            write_version(buckets, self.sync_dir, version)
            try:
                acked = call(self.url, "/sync", {"version": version}, self.timeout,
                             f"weight sync (version {version} in {self.sync_dir})")["version"]
                bad = f"error: the rollout server at {self.url} acknowledged version {acked}, not {version}"
                outcome = [version, None] if acked == version else [None, bad]
            except SystemExit as e:
                outcome[1] = str(e)
            shutil.rmtree(os.path.join(self.sync_dir, f"version_{self.version}"), ignore_errors=True)
        else:
            for _ in buckets:  # the collective gathers, in step with the main process
                pass
        broadcast_object_list(outcome)
        if outcome[1]:
            raise SystemExit(outcome[1])
        self.version = outcome[0]

    def collective(self) -> bool:
        return False

    def wake_up(self) -> None: ...
    def sleep(self) -> None: ...
    def shutdown(self) -> None: ...
