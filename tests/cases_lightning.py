"""A torchrun script for tests/test_lightning.py: real Lightning Trainers on 2 CPU processes.

For each strategy: an uninterrupted run of 2 epochs, and a run of 1 epoch, checkpointed,
resumed by a new Trainer for the second; each rank writes what it ended with to OUT/rank<r>.pt.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gradzip
import gradzip.integrations.ddp
from gradzip.integrations.lightning import DDPHookStrategy, GradzipStrategy


class Net(pl.LightningModule):
    def __init__(self, optimizer: str):
        super().__init__()
        self.optimizer = optimizer
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        with torch.no_grad():   # the same start on every rank and in every run, no RNG
            for i, p in enumerate(self.body.parameters()):
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).reshape(p.shape).roll(i))

    def training_step(self, batch, index):
        x, y = batch
        return F.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.optimizer == "localsgd":   # replicas differ between averagings (every 3 steps)
            return gradzip.optim.LocalSGD(self.parameters(), lr=0.1, momentum=0.9, H=3)
        return gradzip.optim.EFSGD(self.parameters(), lr=0.1, momentum=0.9, compressor="topk:ratio=0.25")


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, :4] * 3).argmax(1)), batch_size=4)


def fit(strategy, optimizer, epochs, ckpt_in=None, ckpt_out=None, accumulate=1):
    model = Net(optimizer)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate, num_sanity_val_steps=0)
    trainer.fit(model, loader(), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return [p.detach().clone() for p in model.parameters()], trainer


def doc_script(out: str) -> str:
    """docs/integrations.md's Lightning script, as written, in this process (``optimizer``)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## PyTorch Lightning"):], re.S).group(1)
    path = Path(out) / f"lit{dist.get_rank()}.py"
    path.write_text(code)
    os.chdir(out)
    sys.argv = [str(path), "optimizer"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(path), run_name="__main__")
    return printed.getvalue()


def main(out: str) -> None:
    result = {}
    # Lightning's own DDPStrategy with a gradzip hook on CPU: the hook never runs
    state = gradzip.integrations.ddp.hook("topk:ratio=0.25")
    fit(pl.strategies.DDPStrategy(ddp_comm_state=state, ddp_comm_hook=gradzip.integrations.ddp.codec_hook), "sgd", 1)
    result["lightning_ddp_hook_steps"] = state.iter

    def hook_strategy():
        return DDPHookStrategy(gradzip.integrations.ddp.hook("topk:ratio=0.25"))
    straight, trainer = fit(hook_strategy(), "sgd", 2)
    result["hook_steps"] = trainer.strategy.hook_state.iter
    result["hook_bytes"] = trainer.strategy.hook_state.bytes_sent
    ckpt = os.path.join(out, "hook.ckpt")
    fit(hook_strategy(), "sgd", 1, ckpt_out=ckpt)
    resumed, trainer = fit(hook_strategy(), "sgd", 2, ckpt_in=ckpt)
    result["hook"] = (straight, resumed)
    result["hook_resumed_counters"] = (trainer.strategy.hook_state.iter, trainer.strategy.hook_state.bytes_sent)

    straight, trainer = fit(GradzipStrategy(), "efsgd", 2, accumulate=2)
    result["gradzip_steps"] = trainer.optimizers[0].steps
    ckpt = os.path.join(out, "gradzip.ckpt")
    fit(GradzipStrategy(), "efsgd", 1, ckpt_out=ckpt, accumulate=2)
    resumed, _ = fit(GradzipStrategy(), "efsgd", 2, ckpt_in=ckpt, accumulate=2)
    # control: rank 0's state on every rank (what Lightning keeps by itself) does not resume exactly
    saved = torch.load(ckpt, weights_only=False)
    for rank_state in saved["gradzip"]["ranks"]:
        rank_state["optimizers"] = saved["gradzip"]["ranks"][0]["optimizers"]
    if dist.get_rank() == 0:
        torch.save(saved, os.path.join(out, "rank0-only.ckpt"))
    dist.barrier()
    rank0_only, _ = fit(GradzipStrategy(), "efsgd", 2, ckpt_in=os.path.join(out, "rank0-only.ckpt"), accumulate=2)
    result["gradzip"] = (straight, resumed, rank0_only)
    # local SGD: the checkpoint (after 4 steps, 1 past an averaging) holds each rank's own replica
    straight, _ = fit(GradzipStrategy(), "localsgd", 2, accumulate=2)
    ckpt = os.path.join(out, "localsgd.ckpt")
    fit(GradzipStrategy(), "localsgd", 1, ckpt_out=ckpt, accumulate=2)
    resumed, _ = fit(GradzipStrategy(), "localsgd", 2, ckpt_in=ckpt, accumulate=2)
    result["localsgd"] = (straight, resumed)
    result["doc"] = doc_script(out)
    torch.save(result, os.path.join(out, f"rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
