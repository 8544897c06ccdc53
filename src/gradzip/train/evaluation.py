"""What the harness evaluates, and how: the model every worker agrees on (rank 0's, or the
workers' average for methods whose replicas differ), on the test set split among the
workers, so that no worker waits in a collective while another evaluates the whole set
(``--timeout`` bounds waiting in collectives: docs/reliability.md). Which model:
:func:`gradzip.optim.evaluation.evaluation_model`, the library's.

Accuracy and loss are means over *targets*: one per sample for classification, one per
position for a language model (targets ``(N, T)``, logits ``(N, classes, T)``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import Group
from ..optim.evaluation import evaluation_model  # noqa: F401  (the library's; the loop calls it from here)


#: Samples per forward pass of the evaluation; sequences: as many as hold this many targets.
EVAL_BATCH, EVAL_TARGETS = 1024, 16384


def _batch(y: torch.Tensor) -> int:
    per_sample = y[0].numel() if y.dim() > 1 and len(y) else 1
    return EVAL_BATCH if per_sample == 1 else max(1, EVAL_TARGETS // per_sample)


@torch.no_grad()
def evaluation_sums(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int | None = None) -> tuple[int, float]:
    """(correct predictions, summed cross-entropy) of ``model`` on ``(x, y)``, over every
    target; ``batch`` samples per forward pass (default: :data:`EVAL_BATCH`, or for
    sequences as many as hold :data:`EVAL_TARGETS` targets)."""
    batch = batch or _batch(y)
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), batch):
        out = model(x[i:i + batch])
        loss += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
        correct += (out.argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct, loss


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int | None = None) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on ``(x, y)``, per target."""
    correct, loss = evaluation_sums(model, x, y, batch)
    return correct / y.numel(), loss / y.numel()


def evaluate_shared(model: torch.nn.Module, comm: Group, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """:func:`evaluate` of a model that is the same on every worker, each worker taking an
    equal share of ``(x, y)`` (one allreduce of two numbers): no worker waits in a
    collective while another evaluates the whole set. Collective."""
    if comm.world_size == 1:
        return evaluate(model, x, y)
    lo, hi = len(x) * comm.rank // comm.world_size, len(x) * (comm.rank + 1) // comm.world_size
    correct, loss = evaluation_sums(model, x[lo:hi], y[lo:hi]) if hi > lo else (0, 0.0)
    total = comm.allreduce(torch.tensor([float(correct), loss], dtype=torch.float64)).tolist()
    return total[0] / y.numel(), total[1] / y.numel()
