"""Run an algorithm script with plain SGD, so that saved weights give the exact gradient: g = (w0 - w1) / lr.

Adam's first step is lr * g / (|g| + eps), which hides gradient differences where |g| is tiny;
the invariance tests compare gradients instead. Usage: python tests/sgd_runner.py grpo.py ARGS...
At the end each process prints "sgd_runner: process i of n", so a test can check the processes formed one group.
"""

import runpy
import sys

import torch
from accelerate import PartialState

torch.optim.AdamW = lambda params, lr, weight_decay, **kwargs: torch.optim.SGD(params, lr=lr)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
print(f"sgd_runner: process {PartialState().process_index} of {PartialState().num_processes}", flush=True)
