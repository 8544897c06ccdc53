"""The README's "Use gradzip in your own training script" runs as written under torchrun
(two gloo workers), and a second run resumes from its per-rank checkpoints."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradzip

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_script() -> str:
    text = README.read_text()
    section = text[text.index("## Use gradzip in your own training script"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _torchrun(cwd: Path, epochs: str | None) -> str:
    env = dict(os.environ, PYTHONPATH=str(Path(gradzip.__file__).parents[1]), OMP_NUM_THREADS="1")
    env.pop("EPOCHS", None)
    if epochs is not None:
        env["EPOCHS"] = epochs
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "train.py"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_the_readme_training_script_runs_resumes_and_learns(tmp_path):
    (tmp_path / "train.py").write_text(readme_script())
    first = _torchrun(tmp_path, "2")
    assert re.findall(r"^epoch (\d)", first, re.M) == ["0", "1"], first
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]
    second = _torchrun(tmp_path, None)          # as written: 4 epochs, resuming after epoch 1
    assert re.findall(r"^epoch (\d)", second, re.M) == ["2", "3"], second
    accuracy = float(re.findall(r"accuracy ([0-9.]+)", second)[-1])
    assert accuracy > 0.8, second


def test_every_method_has_accumulate_so_the_readme_loop_works_for_any_of_them():
    import torch

    for cls, options in [(gradzip.optim.LocalSGD, {"H": 2}), (gradzip.optim.CSER, {"H": 2}),
                         (gradzip.optim.CDSGD, {"overlap": False}), (gradzip.optim.EFSGD, {})]:
        model = torch.nn.Linear(4, 2)
        opt = cls(model.parameters(), lr=0.1, **options)
        with opt.accumulate():
            model(torch.ones(1, 4)).sum().backward()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        assert opt.steps == 1, cls.__name__


def readme_library_use() -> str:
    text = README.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index("## Library use"):], re.S).group(1)


def test_the_readme_library_use_runs_as_written_with_a_model_per_simulated_worker(capsys):
    """issue 36 item 6: the simulate example builds a model per worker (broadcast from rank
    0); as drawn before, one model shared by the workers hung 300 s or crashed."""
    exec(compile(readme_library_use(), "README.md", "exec"), {"__name__": "readme"})
    sent = eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(sent) == 4 and len(set(sent)) == 1 and sent[0] > 0


def test_workers_of_one_simulate_sharing_a_model_get_one_line_error():
    """The README example as drawn before: every worker's optimizer over one shared model.
    A one-line GradzipError naming the fix, not a hang (a PeerFailure after the timeout) or
    a crash."""
    import torch

    model = torch.nn.Linear(10, 2)

    def worker(comm):
        opt = gradzip.optim.SSGD(model.parameters(), lr=0.1, comm=comm, compressor="qsgd")
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 10)).square().mean().backward()
            opt.step()
    with pytest.raises(gradzip.GradzipError) as exc:
        gradzip.simulate(4, worker, timeout_s=120)
    text = str(exc.value)
    assert re.match(r"SSGD: rank [0-3] was given a tensor of shape \((2, 10|2,)\) that rank [0-3] updates too", text)
    assert "broadcast_parameters(model, comm=comm)" in text and "\n" not in text
