import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Worker processes are spawned: keep them from oversubscribing the two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a CUDA device the Triton kernels run under Triton's interpreter, on CPU tensors
# (read when a kernel module is imported: set before any test imports one).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/cases.py for spawned workers

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture()
def world_of_one(tmp_path):
    """A real gloo group of one process (DDP needs a process group), torn down after."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
