"""docs/integrations.md's Accelerate recipe, run as written with real Accelerators on 2 CPU
processes under torchrun (tests/cases_accelerate.py): the hook registered after prepare
compresses; a gradzip optimizer beside DDP's noop_hook trains, and a resume through
accelerator.save_state / load_state with gradzip.accelerate.PerRank continues bit for bit."""
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
from gradzip.accelerate import PerRank  # noqa: E402

CASES = Path(__file__).parent / "cases_accelerate.py"


def _epochs(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^epoch (\d) digest (\S+)$", text, re.M)


@pytest.mark.slow
def test_the_accelerate_recipe_runs_as_written_and_resumes_exactly(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(gradzip.__file__).parents[1]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(CASES), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    main, other = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    straight, first, resumed = _epochs(main["straight"][0]), _epochs(main["first"][0]), _epochs(main["resumed"][0])
    assert [e for e, _ in straight] == ["0", "1"] and [e for e, _ in first] == ["0"]
    assert [e for e, _ in resumed] == ["1"]                       # started after the saved epoch
    assert resumed[0][1] == straight[1][1]                        # the same parameters, to the bit
    assert other["straight"][0] == ""                             # accelerator.print: main process only
    assert main["straight"][1]["bytes"] > 0
    assert main["hook"][1]["hook_iter"] == 8 and main["hook"][1]["bytes"] > 0   # 512 / 2 ranks / 32 per batch


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
