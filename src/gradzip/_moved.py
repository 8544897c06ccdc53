"""Where the modules of earlier versions went when the tree took its layers
(docs/architecture.md): their old dotted names keep importing, as the very same module
objects (so pickles naming the old path, ``isinstance`` and monkeypatching all agree),
through a finder on ``sys.meta_path`` that answers only for these names and imports the new
module when one is asked for. ``gradzip.<old name>`` as an attribute works too
(``gradzip.__getattr__``). New code imports the new names; ``gradzip.ddp``,
``gradzip.lightning``, ``gradzip.accelerate`` and ``gradzip.fsdp`` stay the short public
names of the integrations."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old dotted name -> new one (a package's submodules follow it)
MOVED = {
    "gradzip.planner": "gradzip.exchange.planner",
    "gradzip.twophase": "gradzip.exchange.twophase",
    "gradzip.hierarchy": "gradzip.exchange.hierarchy",
    "gradzip.nonfinite": "gradzip.guards.nonfinite",
    "gradzip.consistency": "gradzip.guards.consistency",
    "gradzip.replicas": "gradzip.guards.replicas",
    "gradzip.double_sync": "gradzip.guards.double_sync",
    "gradzip.ddp": "gradzip.integrations.ddp",
    "gradzip.lightning": "gradzip.integrations.lightning",
    "gradzip.accelerate": "gradzip.integrations.accelerate",
    "gradzip.fsdp": "gradzip.integrations.fsdp",
    "gradzip.launch": "gradzip.comm.launch",
    "gradzip.evaluation": "gradzip.optim.evaluation",
    "gradzip.landscape": "gradzip.optim.landscape",
    "gradzip.stragglers": "gradzip.train.stragglers",
    "gradzip.fingerprint": "gradzip.optim.core.fingerprint",
    "gradzip.train.projection": "gradzip.bench.projection",
    "gradzip.train.report": "gradzip.cli.report",
    "gradzip.optim.base": "gradzip.optim.core.base",
    "gradzip.optim.exchanges": "gradzip.optim.core.exchanges",
    "gradzip.optim.options": "gradzip.optim.core.options",
    "gradzip.optim.guard": "gradzip.optim.core.guard",
    "gradzip.optim.overlap": "gradzip.optim.core.overlap",
    "gradzip.optim.schedule": "gradzip.optim.core.schedule",
    "gradzip.optim.ratios": "gradzip.optim.core.ratios",
    "gradzip.optim.participation": "gradzip.optim.core.participation",
    "gradzip.optim.eager": "gradzip.optim.core.eager",
}


def new_name(name: str) -> str | None:
    """The module an old dotted name now is (None: not a moved name)."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._specs: dict[str, object] = {}   # the real module's own spec, kept across the aliasing

    def find_spec(self, fullname, path=None, target=None):
        if new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(new_name(spec.name))
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import machinery put the alias's spec on the real module: give it back its own
        for alias, spec in list(self._specs.items()):
            if spec.name == module.__name__:
                module.__spec__ = self._specs.pop(alias)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
