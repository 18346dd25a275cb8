"""A CPU run's model is prepared in place, and without DistributedDataParallel in a launch of one process."""

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch import nn

from colograd.engine.launch import free_port
from colograd.grpo.placement import prepare_on_cpu


@pytest.fixture
def world_of_one(monkeypatch):
    """The variables `torchrun --nproc_per_node 1` sets; accelerate's shared state undone after, and the process
    group if accelerate made it (an in-process engine built by an earlier test may hold the one it uses)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else accelerate sets the threads
    AcceleratorState._reset_state(True)
    own_group = not dist.is_initialized()
    yield
    if own_group and dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(True)


def _prepared(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
    prepared, _ = accelerator.prepare(model, optimizer)
    return prepared


def test_a_world_of_one_trains_its_model_unwrapped_and_in_place(world_of_one):
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == 1
    model = Recording()
    weight = model.weight.data_ptr()
    # What accelerate does by itself: DDP over one process (the check has something to catch).
    assert isinstance(
        _prepared(accelerator, nn.Linear(8, 8), _sgd(nn.Linear(8, 8))), nn.parallel.DistributedDataParallel
    )

    prepare_on_cpu(accelerator, torch.device("cpu"))
    prepared = _prepared(accelerator, model, _sgd(model))
    assert prepared is model and model.weight.data_ptr() == weight
    prepared(torch.ones(2, 8))
    assert model.autocast == [True]  # mixed precision still applied
    assert accelerator.unwrap_model(prepared) is model
    with accelerator.no_sync(prepared):  # the Trainer's accumulation context: nothing to skip
        accelerator.backward(prepared(torch.ones(2, 8)).sum())
    assert model.weight.grad is not None


def test_a_gpu_device_is_left_to_accelerate(world_of_one):
    accelerator = Accelerator(cpu=True)
    prepare_on_cpu(accelerator, torch.device("cuda", 0))
    assert accelerator.device_placement
    assert isinstance(
        _prepared(accelerator, nn.Linear(8, 8), _sgd(nn.Linear(8, 8))), nn.parallel.DistributedDataParallel
    )


class Recording(nn.Linear):
    """A linear layer that records whether each forward ran under CPU autocast."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.autocast: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        return super().forward(x)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)
