"""A torchrun harness for tests/test_accelerate.py: runs docs/integrations.md's Accelerate
script as written (runpy, in this process: one start-up for every run) in fresh folders:
"optimizer" 2 epochs straight, 1 epoch then resumed to 2, and "hook" 1 epoch. Each rank
writes the printed lines and the end states to OUT/rank<r>.pt."""
from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def script() -> str:
    text = DOC.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index("## Hugging Face Accelerate"):], re.S).group(1)


def run(path: Path, folder: Path, mode: str, epochs: int) -> tuple[str, dict]:
    folder.mkdir(exist_ok=True)
    os.chdir(folder)
    os.environ["EPOCHS"] = str(epochs)
    sys.argv = [str(path), mode]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        scope = runpy.run_path(str(path), run_name="__main__")
    state = scope.get("state")
    return out.getvalue(), {"hook_iter": state.iter if state is not None else None,
                            "bytes": (state.bytes_sent if state is not None else scope["opt"].bytes_sent)}


def main(out: str) -> None:
    root = Path(out)
    path = root / f"accel{os.environ['RANK']}.py"   # a copy per rank: no race on the file
    path.write_text(script())
    res = {"straight": run(path, root / "straight", "optimizer", 2),
           "first": run(path, root / "resumed", "optimizer", 1),
           "resumed": run(path, root / "resumed", "optimizer", 2),
           "hook": run(path, root / "hook", "hook", 1)}
    torch.save(res, root / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
