"""Weight sync to `vllm serve` over NCCL (GPUs): vLLM's own trainer-side engine, imported only when
the server was started with --weight-transfer-config '{"backend": "nccl"}'
(common/engines/server_client.py reads that from /server_info).

The main training process joins the server's workers in one NCCL group (it is rank 0 and hosts the
rendezvous; the workers are ranks 1..N) and broadcasts the full weights (HF checkpoint names, LoRA
merged, FSDP2 / ZeRO-3 shards gathered on every process) each step. vLLM drives its side:
/init_weight_transfer_engine once, then /start_weight_update, /update_weights (the workers receive
while the trainer sends) and /finish_weight_update with the weight version, which every later answer
names.

UNTESTED: NCCL cannot put two ranks on one GPU, so this path needs a trainer GPU and a server GPU
(two GPUs at least); no session so far had them. tests/test_gpu.py::test_vllm_serve_nccl_sync is the
acceptance test to run.
"""

import socket
from urllib.parse import urlparse

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from common.engines.vllm_engine import checkpoint_params, iter_weight_buckets


class CheckpointSource(WeightSource):
    """The training model's weights as vLLM loads them: what iter_weight_buckets yields, declared up
    front (global shapes, no gather) so the workers can size their receive buffers."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def metadata(self) -> list[ParamMeta]:
        # ZeRO-3: the full shape
        return [ParamMeta(name, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                for name, p in checkpoint_params(self.model)]

    def __iter__(self):
        for bucket in iter_weight_buckets(self.model):  # collective: every process iterates in step
            yield from bucket


class VersionedClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP control-plane client, finishing each update with the version the trainer is about
    to check."""

    version: str | None = None

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version or self.version)


def address_toward(url: str) -> str:
    """This machine's address on the route to the server (where the server's workers reach the
    rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        # UDP: no packet is sent, the kernel only picks the route
        s.connect((urlparse(url).hostname, 9))
        return s.getsockname()[0]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def nccl_sender(url: str, timeout: float, model: torch.nn.Module, rank: int,
                server_world_size: int):
    """vLLM's NCCL trainer engine for this process (every process: the main one sends, the others
    take part in the gathers); the rendezvous with the server's workers happens here, on the main
    process."""
    host = address_toward(url) if rank == 0 else ""
    info = NCCLTrainerInitInfo(master_address=host, master_port=free_port(host) if rank == 0 else 0,
                               world_size=1 + server_world_size, rank=rank)
    return WeightTransferTrainerFactory.trainer_init(info, client=VersionedClient(url, timeout),
                                                     source=CheckpointSource(model))
