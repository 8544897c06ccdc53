"""docs/integrations.md's Accelerate recipe, run as written with real Accelerators on 2 CPU
processes started by the documented `accelerate launch --multi_gpu --num_processes 2`
(tests/cases_accelerate.py): the hook registered after prepare
compresses; a gradzip optimizer beside DDP's noop_hook trains, and a resume through
accelerator.save_state / load_state with gradzip.integrations.accelerate.PerRank continues bit for bit."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'gradzip[accelerate]')")

import gradzip  # noqa: E402
import gradzip.integrations.accelerate  # noqa: E402
import gradzip.integrations.ddp  # noqa: E402
from gradzip.integrations.accelerate import PerRank  # noqa: E402

CASES = Path(__file__).parent / "cases_accelerate.py"


def _epochs(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^epoch (\d) digest (\S+)$", text, re.M)


@pytest.mark.slow
def test_the_accelerate_recipe_runs_as_written_and_resumes_exactly(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(gradzip.__file__).parents[1]), OMP_NUM_THREADS="1")
    # the command docs/integrations.md gives (port 0: a free one, beside other runs)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", "0", str(CASES), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    main, other = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    straight, first, resumed = _epochs(main["straight"][0]), _epochs(main["first"][0]), _epochs(main["resumed"][0])
    assert [e for e, _ in straight] == ["0", "1"] and [e for e, _ in first] == ["0"]
    assert [e for e, _ in resumed] == ["1"]                       # started after the saved epoch
    assert resumed[0][1] == straight[1][1]                        # the same parameters, to the bit
    assert other["straight"][0] == ""                             # accelerator.print: main process only
    assert main["straight"][1]["bytes"] > 0
    # 512 / 2 ranks / 32 per batch = 8 micro-batches an epoch, 2 per step (issue 36 item 2: 16 steps before)
    assert main["straight"][1]["steps"] == 8
    assert main["hook"][1]["hook_iter"] == 4 and main["hook"][1]["bytes"] > 0
    for res in (main, other):     # stepped on every micro-batch inside accumulate(): refused on both ranks
        assert res["every"].startswith("GradzipError: EFSGD.step() inside DistributedDataParallel.no_sync()")


def test_per_rank_state_refuses_what_it_cannot_restore():
    opt = gradzip.optim.SSGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    state = PerRank(opt).state_dict()
    assert list(state) == ["ranks"] and len(state["ranks"]) == 1
    PerRank(opt).load_state_dict(state)
    with pytest.raises(gradzip.GradzipError, match="as many processes"):
        PerRank(opt).load_state_dict({"ranks": state["ranks"] * 2})
    with pytest.raises(gradzip.GradzipError, match="not a PerRank state"):
        PerRank(opt).load_state_dict(opt.state_dict())
    with pytest.raises(gradzip.GradzipError, match="state_dict"):
        PerRank(object())


def _two_micro_batches_then_step(cls, ddp_no_sync: bool):
    """One step of ``cls`` over two micro-batches, accumulated inside a no-op-hook DDP
    wrapper's ``no_sync()`` (what Accelerate's accumulate() enters) or inside the optimizer's
    own ``accumulate()`` (no DDP); the parameters after it."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model = net
    if ddp_no_sync:
        model = DistributedDataParallel(net)
        model.register_comm_hook(None, noop_hook)
    opt = cls(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))
    with model.no_sync() if ddp_no_sync else opt.accumulate():
        model(x[0]).square().mean().backward()
    model(x[1]).square().mean().backward()
    opt.step()
    assert opt.steps == 1
    return [p.detach().clone() for p in net.parameters()], model, opt


@pytest.mark.parametrize("cls", [gradzip.optim.EFSGD, gradzip.optim.LocalSGD])
def test_a_ddp_no_sync_window_accumulates_and_a_step_inside_it_is_refused(world_of_one, cls):
    """issue 36 item 2: Accelerate's accumulate() enters DDP's no_sync() on every micro-batch
    but the last, and skips step() there only for optimizers it prepared. A gradzip optimizer
    beside a no-op-hook DDP takes no_sync() as its accumulate() (EF-SGD's backward hooks
    idle) and refuses a step() inside it, which would step and communicate on every micro-batch."""
    inside_ddp, model, opt = _two_micro_batches_then_step(cls, ddp_no_sync=True)
    alone, _, _ = _two_micro_batches_then_step(cls, ddp_no_sync=False)
    assert all(torch.equal(a, b) for a, b in zip(inside_ddp, alone))
    with model.no_sync():
        model(torch.ones(1, 4)).sum().backward()
        with pytest.raises(gradzip.GradzipError) as exc:
            opt.step()
    text = str(exc.value)
    assert "step() inside DistributedDataParallel.no_sync()" in text and "accelerator.sync_gradients" in text
    assert "\n" not in text and opt.steps == 1
    model(torch.ones(1, 4)).sum().backward()      # the micro-batch that synchronises: the step goes on
    opt.step()
    assert opt.steps == 2


def test_register_hook_says_why_a_model_is_not_ddp_and_registers_on_one(world_of_one):
    """issue 36 item 7: one process (`accelerate launch --cpu --num_processes 2` starts one)
    leaves the model unwrapped; the helper names that and the command that starts two,
    instead of an AttributeError from model.register_comm_hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    with pytest.raises(gradzip.GradzipError) as exc:
        gradzip.integrations.accelerate.register_hook(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    text = str(exc.value)
    assert "Sequential, not DistributedDataParallel" in text and "this run has 1 process" in text
    assert "accelerate launch --multi_gpu --num_processes 2" in text and "\n" not in text
    for state, hook in ((None, noop_hook), (gradzip.integrations.ddp.hook("topk:ratio=0.5"), gradzip.integrations.ddp.codec_hook),
                        (gradzip.integrations.ddp.PowerSGDState(), gradzip.integrations.ddp.powersgd_hook)):
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        gradzip.integrations.accelerate.register_hook(ddp, state)
        assert [h for h, _ in ddp._comm_hooks] == [hook]
    with pytest.raises(gradzip.GradzipError, match="hook state"):
        gradzip.integrations.accelerate.register_hook(DistributedDataParallel(torch.nn.Linear(2, 2)), object())
