"""SHARDING_REPORT=FILE: after each `accelerator.prepare` (and `prepare_model`) of the script, every process appends one
JSON line per prepared model to FILE: {rank, distributed_type, params: {name: [type, local numel, global numel]}}, the
type "DTensor" (FSDP2), "ZeRO-3" (a DeepSpeed partition) or the parameter's class. tests/dist_runner.py installs it
for its CPU processes; as a runner of its own it serves a launch that dist_runner's CPU decisions must not touch (one
process on a GPU: tests/test_gpu.py).

Usage: SHARDING_REPORT=FILE accelerate launch --config_file F --num_processes 1 tests/sharding_report.py SCRIPT.py ARGS
"""

import json
import os
import runpy
import sys

import torch
from accelerate import Accelerator

_prepare, _prepare_model = Accelerator.prepare, Accelerator.prepare_model
_reported = set()  # prepare() calls prepare_model() for DDP, not for FSDP2: report each model once


def _report(accelerator, model) -> None:
    from torch.distributed.tensor import DTensor

    if id(model) in _reported:
        return
    _reported.add(id(model))
    def shard(p):  # [kind, elements held by this process, elements of the whole parameter]
        if isinstance(p, DTensor):
            return ["DTensor", p.to_local().numel(), p.numel()]
        if hasattr(p, "ds_id"):  # a DeepSpeed ZeRO-3 partitioned parameter: its part is ds_tensor (padded)
            return ["ZeRO-3", p.ds_tensor.numel(), p.ds_numel]
        return [type(p).__name__, p.numel(), p.numel()]

    params = {name: shard(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
    with open(os.environ["SHARDING_REPORT"], "a") as f:
        f.write(json.dumps({"rank": accelerator.process_index, "distributed_type": str(accelerator.distributed_type),
                            "params": params}) + "\n")


def _prepare_and_report(self, *objects, **kwargs):
    prepared = _prepare(self, *objects, **kwargs)
    for obj in prepared if isinstance(prepared, (tuple, list)) else (prepared,):  # FSDP2: a list
        if isinstance(obj, torch.nn.Module):
            _report(self, obj)
    return prepared


def _prepare_model_and_report(self, model, *args, **kwargs):
    prepared = _prepare_model(self, model, *args, **kwargs)
    _report(self, prepared)
    return prepared


def install_sharding_report() -> None:
    """Report every model prepared from now on (SHARDING_REPORT names the file)."""
    Accelerator.prepare = _prepare_and_report
    Accelerator.prepare_model = _prepare_model_and_report


if __name__ == "__main__":
    install_sharding_report()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
