"""Run an algorithm script with plain SGD, so that saved weights give the exact gradient: g = (w0 - w1) / lr.

Adam's first step is lr * g / (|g| + eps), which hides gradient differences where |g| is tiny;
the invariance tests compare gradients instead. Usage: python tests/sgd_runner.py grpo.py ARGS...
At the end each process prints "sgd_runner: process i of n", so a test can check the processes formed one group.
"""

import runpy
import sys

import torch
from accelerate import PartialState


class SGD(torch.optim.SGD):
    """AdamW's signature, plain SGD's step; a class, since libraries subclass torch.optim.AdamW (DeepSpeed does)."""

    def __init__(self, params, lr, weight_decay=0.0, **kwargs):
        super().__init__(params, lr=lr)


torch.optim.AdamW = SGD
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
print(f"sgd_runner: process {PartialState().process_index} of {PartialState().num_processes}", flush=True)
