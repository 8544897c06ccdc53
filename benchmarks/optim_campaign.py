"""Issue 35's optimizer scenarios (items 1, 4, 5, 6, 12) on 2 gloo processes, counted.

The tests run them on threads (and the different-size freezing case on gloo); this reruns
every scenario on real process groups, through the tests' worker functions
(tests/cases_overlap.py, tests/cases_optim.py, tests/test_participation.py):

* item 1: 8 overlapped method settings x 6 gradient edits no version counter sees (through
  ``.data``, new memory, a numpy view): ``overlap_backward=True`` must equal ``False`` bit
  for bit;
* item 4: every method, both paths, a parameter listed twice: the bits of the list without
  the repeat;
* item 5: every synchronous method setting, a set of parameters changed on one rank
  (swapped: same shapes; one-sided: other counts), and alike on both: named on every rank
  with nothing applied, resp. trains on;
* item 6: a complex parameter: the numbers of its real view, or refused in one line;
* item 12: a sparse gradient: refused in one line, nothing changed; and (with ``cli``) three
  ``--dataset synthetic`` sizes too large to generate: exit 2 with one line.

    python -m benchmarks.optim_campaign            # every item and the command lines
    python -m benchmarks.optim_campaign 1 5        # some items
"""
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

import cases  # noqa: E402
import cases_optim  # noqa: E402
import cases_overlap  # noqa: E402
import test_participation as tp  # noqa: E402
from gradzip.errors import GradzipError  # noqa: E402
from gradzip.comm.launch import run_processes  # noqa: E402
from gradzip.optim import METHODS  # noqa: E402


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def item1(comm) -> dict:
    """Gradient edits after the hook: overlap on equals overlap off, bit for bit."""
    out = {}
    for name in ("ssgd", "efsgd-topk", "bitsgd", "csea", "dgc", "cser", "ssgd-qsgd", "efsgd-1bit"):
        for edit in cases_overlap.EDITS:
            hooked = cases_overlap.train(comm, name, edit)[0]
            out[f"{name}/{edit}"] = _same(hooked, cases_overlap.train(comm, name, edit + "_off")[0])
    return out


def item4(comm) -> dict:
    """A parameter listed twice: the bits of the list without the repeat."""
    return {f"{m}/{o}": _same(tp.train_listed(comm, m, False, o), tp.train_listed(comm, m, True, o))
            for m in sorted(cases.SHORT_RUNS) for o in tp._with_overlap(m)}


def item5(comm) -> dict:
    """Freezing on one rank: named with nothing applied; alike on both: trains on."""
    runs = [(m, o) for m in tp.SYNCHRONOUS for o in tp._with_overlap(m)]
    out = {}
    for label, changes in (("swapped", cases_optim.SWAPPED), ("one-sided", cases_optim.ONE_SIDED),
                           ("alike", cases_optim.ALIKE)):
        for (m, o), r in cases_optim.freezing_runs(comm, changes, runs).items():
            named = "'frozen parameters' differs" in r.get("refused", "") and r.get("untouched", False)
            out[f"{label}/{m}/{o}"] = "params" in r if label == "alike" else named
    return out


def item6(comm) -> dict:
    """A complex parameter: its real view's numbers, or refused in one line."""
    out = {}
    for m in tp.COMPLEX_TAKEN:
        for o in tp._with_overlap(m):
            a, b = tp.train_complex(comm, m, False, o), tp.train_complex(comm, m, True, o)
            out[f"taken/{m}/{o}"] = all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b))
    for m in tp.COMPLEX_REFUSED:
        try:
            METHODS[m](tp.ComplexModel(False).parameters(), comm=comm, lr=0.05)
            out[f"refused/{m}"] = False
        except GradzipError as error:
            out[f"refused/{m}"] = "\n" not in str(error)
    return out


def item12(comm) -> dict:
    """A sparse gradient: refused in one line, no parameter changed."""
    out = {}
    for m in sorted(METHODS):
        for o in tp._with_overlap(m):
            torch.manual_seed(0)   # the same replicas on every rank (else the settings check refuses first)
            emb, head = torch.nn.Embedding(5, 3, sparse=True), torch.nn.Linear(3, 1)
            params = [*emb.parameters(), *head.parameters()]
            extra = {} if o is None else {"overlap_backward": o}
            opt = METHODS[m](params, comm=comm, lr=0.05, **extra)
            before = [p.detach().clone() for p in params]
            try:
                head(emb(torch.tensor([1, 2]))).sum().backward()
                opt.step()
                out[f"sparse/{m}/{o}"] = False
            except GradzipError as error:
                out[f"sparse/{m}/{o}"] = "sparse gradient" in str(error) and _same(before, params)
            if hasattr(opt, "close"):
                opt.close()
    return out


ITEMS = {"1": item1, "4": item4, "5": item5, "6": item6, "12": item12}
TOO_LARGE = ("synthetic:shape=1x100000x100000", "synthetic:shape=3x2000x2000", "synthetic:n=100000000,shape=784")


def main(asked: list[str]) -> None:
    asked = asked or [*ITEMS, "cli"]
    began = time.time()
    for item in (i for i in ITEMS if i in asked):
        t = time.time()
        ranks = run_processes(2, ITEMS[item])
        for rank, res in enumerate(ranks):
            bad = [k for k, ok in res.items() if not ok]
            print(f"item {item}, rank {rank}: {len(res)} scenarios, {len(bad)} not as expected {bad[:10]}")
        print(f"item {item}: {time.time() - t:.0f} s", flush=True)
    for spec in TOO_LARGE if "cli" in asked else ():
        run = subprocess.run([sys.executable, "-m", "gradzip", "train", "--algo", "efsgd", "--workers", "2",
                              "--dataset", spec, "--epochs", "1", "--no-plot", "--quiet"],
                             capture_output=True, text=True, timeout=600)
        lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
        print(f"--dataset {spec}: exit {run.returncode}, {len(lines)} line(s): {lines[-1] if lines else ''}")
    print(f"{time.time() - began:.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
