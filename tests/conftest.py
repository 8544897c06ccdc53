import os
import sys
from pathlib import Path

import pytest
import torch

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
