"""Run a script in one of the CPU processes that `accelerate launch` (without --cpu) starts through torchrun:
DDP over gloo, or FSDP2 over gloo when the launch asks for FSDP (--use_fsdp, or an FSDP config file).

Usage: accelerate launch --multi_gpu|--config_file F --num_processes 2 tests/dist_runner.py SCRIPT.py ARGS...
(SCRIPT may be tests/sgd_runner.py, which then runs the algorithm script with plain SGD.)

Why a runner: accelerate 1.15 has no multi-process CPU launch of its own. `accelerate launch --cpu --num_processes 2`
starts a single process (commands/launch.py simple_launcher: one `python SCRIPT` unless an MPI hostfile is given),
and torchrun's processes come up unconnected, each "rank 0 of 1", because the scripts' first `PartialState()` is
not told `cpu=True` (state.py _prepare_backend). And AcceleratorState turns on FSDP only for accelerator devices
(MULTI_GPU, MULTI_XPU, ...), never for MULTI_CPU. This runner makes exactly those two decisions for the CPU and
leaves everything else (the plugin built from the launch's FSDP_* variables, fully_shard, the state dicts) to
accelerate: `PartialState(cpu=True)` before the script, and FSDP in place of MULTI_CPU when a plugin was built.

SHARDING_REPORT=FILE: each process appends, after the script's `accelerator.prepare`, one JSON line per prepared
model: {rank, distributed_type, params: {name: [type, local numel, global numel]}} (tests/sharding_report.py).
"""

import os
import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from sharding_report import install_sharding_report

PartialState(cpu=True)  # MULTI_CPU over gloo, from torchrun's RANK / WORLD_SIZE
_accelerator_state_init = AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    """What AcceleratorState.__init__ does for an accelerator device when a FSDP plugin is given (state.py)."""
    _accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _fsdp_on_cpu

if os.environ.get("SHARDING_REPORT"):
    install_sharding_report()

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
# The script returned: its work is done, its files written and closed, its process group destroyed (finish). Leave
# without the interpreter's teardown, where under load a gloo thread has aborted an FSDP2 process after all of it
# ("terminate called without an active exception": docs/notes.md). A script that failed raised before this line.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
