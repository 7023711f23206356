"""Runs inside `vllm serve`'s workers: a weight-transfer engine that loads the trainer's weights
from disk.

    vllm serve MODEL --worker-extension-cls common.engines.vllm_worker.WorkerExtension \
        --weight-transfer-config '{"backend": "disk"}' ...    (docs/rollouts.md, "Server mode")

vLLM imports this module in every worker when it resolves --worker-extension-cls; importing it
registers the "disk" backend with vLLM's WeightTransferEngineFactory. A sync is then vLLM's own
handshake over HTTP (the trainer's side is common/engines/server_client.py): /pause,
/start_weight_update, /update_weights with {"path": a folder of safetensors files},
/finish_weight_update with the version, /reset_prefix_cache, /resume; every answer of
/inference/v1/generate names the weight version that produced it. vLLM 0.32's own backends (nccl,
ipc, ...) need CUDA; this one works on every build, the CPU's included, wherever the server can
read the folder the trainer writes.
"""

import os
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from common.engines.vllm_engine import reprocess_tied_layers


@dataclass
class DiskInitInfo:
    """Nothing to set up: the trainer and the server share a filesystem."""


@dataclass
class DiskUpdateInfo:
    path: str  # a folder of *.safetensors files holding every weight, in the checkpoint's names


def weight_files(path: str, expected: dict[str, torch.Size]) -> list[str]:
    """The *.safetensors files of `path`, after checking their tensors' names and shapes against the
    model's checkpoint (`expected`): a weight missing or of another shape is refused before any is
    loaded."""
    from safetensors import safe_open

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")) \
        if os.path.isdir(path) else []
    if not files:
        raise ValueError(f"disk weight transfer: no *.safetensors file in {path!r}")
    shapes = {}
    for name in files:
        with safe_open(name, framework="pt") as f:
            shapes.update({key: torch.Size(f.get_slice(key).get_shape()) for key in f.keys()})
    missing = sorted(set(expected) - set(shapes))
    wrong = sorted(k for k in set(expected) & set(shapes) if expected[k] != shapes[k])
    if missing or wrong:
        raise ValueError(f"disk weight transfer from {path}: missing {missing[:5]}, of another "
                         f"shape {[(k, tuple(shapes[k]), tuple(expected[k])) for k in wrong[:5]]}")
    return files


class DiskWeightTransferEngine(WeightTransferEngine[DiskInitInfo, DiskUpdateInfo]):
    """Loads a folder of safetensors files in place with vLLM's reload (each layer put back in
    checkpoint form, loaded, processed again), then reprocesses a tied head. One update is one whole
    set of weights."""

    init_info_cls = DiskInitInfo
    update_info_cls = DiskUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        # the served checkpoint's names and shapes
        self.expected: dict[str, torch.Size] | None = None

    def init_transfer_engine(self, init_info: DiskInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: DiskUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        if self.expected is None:  # the first update: what the served checkpoint holds
            self.expected = dict(checkpoint_shapes(self.model_config.model))
        # checked whole before the reload touches a layer
        files = weight_files(update_info.path, self.expected)
        # The iterator reads one tensor at a time: no second copy of the weights.
        reload_weights(self.vllm_config, self.model,
                       weights_iterator=safetensors_weights_iterator(files, False),
                       weights_path=None, is_checkpoint_format=True)
        reprocess_tied_layers(self.model)

    def shutdown(self) -> None:
        pass


def checkpoint_shapes(model: str):
    """(name, shape) of every tensor in the served model's safetensors files (a local folder or the
    hub cache)."""
    from safetensors import safe_open

    folder = model if os.path.isdir(model) else _hub_folder(model)
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():
                yield key, torch.Size(f.get_slice(key).get_shape())


def _hub_folder(model: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(model, allow_patterns=["*.safetensors"], local_files_only=True)


class WorkerExtension:
    """--worker-extension-cls: vLLM mixes it into every worker. Importing this module registered the
    "disk" backend; the workers need no method of ours beyond vLLM's own."""


if "disk" not in WeightTransferEngineFactory._registry:  # a module imported twice registers once
    WeightTransferEngineFactory.register_engine("disk", DiskWeightTransferEngine)
