"""A harness for tests/test_accelerate.py, started by `accelerate launch`: runs docs/integrations.md's Accelerate
script as written (runpy, in this process: one start-up for every run) in fresh folders:
"optimizer" 2 epochs straight, 1 epoch then resumed to 2, and "hook" 1 epoch; then the
script with the gradzip optimizer stepped on every micro-batch inside accumulate() (the
issue-36 mistake), which must be refused. Each rank writes the printed lines and the end
states to OUT/rank<r>.pt."""
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
                            "steps": scope["opt"].steps if state is None else None,
                            "bytes": (state.bytes_sent if state is not None else scope["opt"].bytes_sent)}


def stepped_every_micro_batch(root: Path) -> str:
    """The script with ``opt.step()`` on every micro-batch inside accumulate() (an optimizer
    Accelerate did not prepare is not skipped there): the error's text."""
    path = root / f"every{os.environ['RANK']}.py"
    path.write_text(script().replace("if accelerator.sync_gradients:", "if True:"))
    try:
        run(path, root / "every", "optimizer", 1)
    except Exception as error:  # noqa: BLE001 - the text is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def main(out: str) -> None:
    root = Path(out)
    path = root / f"accel{os.environ['RANK']}.py"   # a copy per rank: no race on the file
    path.write_text(script())
    res = {"straight": run(path, root / "straight", "optimizer", 2),
           "first": run(path, root / "resumed", "optimizer", 1),
           "resumed": run(path, root / "resumed", "optimizer", 2),
           "hook": run(path, root / "hook", "hook", 1),
           "every": stepped_every_micro_batch(root)}
    torch.save(res, root / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
