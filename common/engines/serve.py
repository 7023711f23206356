"""A rollout server: the policy's sampler in a process (and on devices) of its own (--server_url).

    python -m common.engines.serve --model Qwen/Qwen3-4B --port 8000 --sync_dir weights/
        [--engine hf|vllm]

It serves the engine interface of common/engines/rollout.py over HTTP, JSON in and out, one request
at a time in the order they arrive (a weight sync is loaded before any later generate request is
answered):

    GET  /health    -> {"model", "dtype", "engine", "sync_dir", "version"}
    POST /generate  {"prompt_ids", "seeds", "max_tokens", "temperature", "top_p", "stop", "version"}
                    -> {"completion_ids", "sampler_logp", "version"}
                    refused (409) unless "version" is the one loaded
    POST /sync      {"version": N} -> loads sync_dir/version_N/*.safetensors (the trainer wrote
                    them and renamed the folder into place: common/engines/server_client.py), then
                    answers {"version": N}
    any error       -> status 4xx/5xx and {"error": "one line"}

Version 0 is the --model files as loaded at start; a server that restarted is back at 0, so a
trainer that pushed version N is refused rather than sampled from the initial weights. The transport
is the filesystem: trainer and server must see --sync_dir at the same path (one node, or a shared
filesystem). No NCCL weight transfer.

`--engine hf` (transformers' generate, rollout.HFEngine) runs anywhere and samples exactly what the
colocated HF engine samples for the same seeds and weights; `--engine vllm` runs one colocated-style
vLLM (vllm_engine.VLLMEngine) and pushes each loaded version into it from a copy of the weights kept
in this process.
"""

import argparse
import glob
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class WeightError(Exception):
    """A version that cannot be loaded: missing, incomplete, or not this model's parameters."""


def version_dir(sync_dir: str, version: int) -> str:
    return os.path.join(sync_dir, f"version_{version}")


def load_version(model: torch.nn.Module, sync_dir: str, version: int) -> None:
    """Copy sync_dir/version_N/*.safetensors into `model`'s parameters: every parameter (tied ones
    once, as named_parameters lists them), nothing else, same shapes."""
    from safetensors.torch import load_file

    folder = version_dir(sync_dir, version)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise WeightError(f"no weights in {folder}: trainer and server must see "
                          f"--sync_dir at the same path")
    tensors = {name: t for f in files for name, t in load_file(f).items()}
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise WeightError(f"{folder} does not hold this model's parameters (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}): the trainer's --model is not the "
                          f"server's")
    with torch.no_grad():
        for name, t in tensors.items():
            if t.shape != params[name].shape:
                raise WeightError(f"{folder}: {name} has shape {list(t.shape)}, here "
                                  f"{list(params[name].shape)}")
            params[name].copy_(t)


class Sampler:
    """The server's state: the weights (an HF model), the engine that samples with them and the
    loaded version."""

    def __init__(self, model_path: str, sync_dir: str, engine: str, dtype: str, seed: int,
                 max_model_len: int, gpu_memory_utilization: float = 0.9):
        from accelerate import Accelerator
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.sync_dir = sync_dir
        self.engine_name = engine
        self.dtype = dtype
        self.accelerator = Accelerator()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        if self.tokenizer.pad_token is None:  # as common/run.py load_models
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # vLLM: a CPU copy to push from
        device = self.accelerator.device if engine == "hf" else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
        self.model = self.model.to(device).eval()
        if engine == "hf":
            from common.engines.rollout import HFEngine

            self.engine = HFEngine(self.tokenizer, self.accelerator)
        else:
            from common.engines.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(model_path, accelerator=self.accelerator, seed=seed,
                                     dtype=dtype, max_model_len=max_model_len,
                                     enable_sleep_mode=False,
                                     gpu_memory_utilization=gpu_memory_utilization)
        self.version = 0

    def info(self) -> dict:
        return {"model": self.model_path, "dtype": self.dtype, "engine": self.engine_name,
                "sync_dir": os.path.abspath(self.sync_dir), "version": self.version}

    def sync(self, version: int) -> dict:
        load_version(self.model, self.sync_dir, version)
        if self.engine_name == "vllm":
            self.engine.push_weights(self.model)
        self.version = version
        return {"version": version}

    def generate(self, request: dict) -> dict:
        if request.get("version") != self.version:
            raise VersionError(f"the trainer expects weights version "
                               f"{request.get('version')}, this server holds version "
                               f"{self.version} (restarted, or another trainer pushed?)")
        ids, logps = self.engine.generate(self.model, request["prompt_ids"], request["seeds"],
                                          max_tokens=request["max_tokens"],
                                          temperature=request["temperature"],
                                          top_p=request["top_p"], stop=request.get("stop"))
        return {"completion_ids": ids, "sampler_logp": logps, "version": self.version}


class VersionError(Exception):
    pass


def make_handler(sampler: Sampler):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                return self.answer(200, sampler.info())
            self.answer(404, {"error": f"no such path {self.path}"})

        def do_POST(self):
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self.path == "/generate":
                    return self.answer(200, sampler.generate(request))
                if self.path == "/sync":
                    return self.answer(200, sampler.sync(int(request["version"])))
                self.answer(404, {"error": f"no such path {self.path}"})
            except VersionError as e:
                self.answer(409, {"error": str(e)})
            except (WeightError, KeyError, TypeError, ValueError) as e:
                self.answer(400, {"error": f"{type(e).__name__}: {e}"})
            except Exception as e:  # the server keeps serving; the trainer stops with this line
                print(f"common.engines.serve: {self.path} failed: {type(e).__name__}: {e}",
                      file=sys.stderr)
                self.answer(500, {"error": f"{type(e).__name__}: {e}"})

        def answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()  # floats round-trip exactly (repr)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # one line per request would bury the errors
            pass

    return Handler


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m common.engines.serve",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="hub id or local folder: the trainer's --model")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface, no auth)")
    p.add_argument("--sync_dir", required=True,
                   help="folder the trainer writes weight versions to (shared path)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="transformers' generate or vLLM")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="the trainer's --dtype")
    p.add_argument("--seed", type=int, default=0,
                   help="vLLM's engine seed (each request carries its own)")
    p.add_argument("--max_model_len", type=int, default=4096,
                   help="vLLM: prompt + completion tokens at most")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.9,
                   help="vLLM: GPU memory fraction it may take")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    from common.engines.rollout import vllm_installed

    if args.engine == "vllm" and not vllm_installed():
        raise SystemExit("error: --engine vllm needs vLLM (pip install -r "
                         "requirements.txt); or use --engine hf")
    os.makedirs(args.sync_dir, exist_ok=True)
    sampler = Sampler(args.model, args.sync_dir, args.engine, args.dtype, args.seed,
                      args.max_model_len, args.gpu_memory_utilization)
    server = HTTPServer((args.host, args.port), make_handler(sampler))
    print(f"common.engines.serve: {args.engine} engine for {args.model} on "
          f"http://{args.host}:{server.server_port}, weights from {os.path.abspath(args.sync_dir)}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
