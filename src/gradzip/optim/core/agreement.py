"""What the workers of a group must agree on, as a mixin of
:class:`~gradzip.optim.core.base.DistributedOptimizer`: the settings of a method
(:meth:`Agreement.describe`: method, version, shapes, hyper-parameters, codecs, transports,
the two-phase bucket layout, the parameters' values while replicas must be equal), compared
across workers once before the first collective and again after a change
(:meth:`~Agreement.verify_once`, :meth:`~Agreement.reverify`; docs/algorithms.md
§"Non-finite gradients and the settings check"), and the refusal of DDP wrappers that would
communicate the same gradients again (or step inside their ``no_sync()``).

The host class provides ``comm``, ``param_groups``, ``steps``, ``replicas_differ``,
``_hierarchy``, ``_declared_link``, ``_exchanges``, ``transports()``, ``exchange_plans()``, ``_all_params()``
and the flags ``_verified`` / ``_ddp``.
"""
from __future__ import annotations

from typing import Any

from ...errors import GradzipError
from ...guards import consistency
from ...guards.double_sync import accumulating, refuse_ddp_double_sync
from ...guards.replicas import parameter_digest
from ...version import __version__


def derived_setting(name: str) -> bool:
    """Whether the :meth:`DistributedOptimizer.describe` field ``name`` follows from other
    settings (the world size, parameter shapes and values, an exchange's transport plan):
    a comparison of settings names the setting that differs before these."""
    return (name in ("world size", "parameter shapes") or name.startswith("parameter #")
            or (name.startswith("exchange ") and name.endswith((" transport", " auto"))))


class Agreement:
    """Mixin: the settings workers compare, and the DDP refusals (module docstring)."""

    def reverify(self) -> None:
        """Run the first-step guards again at the next step (new parameters, a loaded state)."""
        self._verified = False
        self._ddp = None

    def describe(self) -> dict[str, Any]:
        """The settings every worker of a group must share: method, version, world size,
        parameter shapes, hyper-parameters per param group, options kept as attributes
        (periods, ratios, ...) and the codec spec of every exchange."""
        fields: dict[str, Any] = {
            "gradzip version": __version__, "method": type(self).__name__,
            "world size": self.comm.world_size,
            "parameter shapes": [tuple(p.shape) for g in self.param_groups for p in g["params"]],
        }
        for i, group in enumerate(self.param_groups):
            fields.update({f"param_groups[{i}].{k}": v for k, v in group.items() if k != "params"})
        fields.update({k: v for k, v in vars(self).items()
                       if not k.startswith("_") and k not in ("steps", "skipped_steps")
                       and isinstance(v, (bool, int, float, str))})
        plans = self.transports()
        if self._declared_link is not None:   # only then: settings (and checkpoints) without it stay as they were
            fields["link"] = str(self._declared_link)
        for i, psync in enumerate(self._exchanges):
            fields[f"exchange {i} codec"] = psync.compressor.spec
            fields[f"exchange {i} transport"] = plans[f"exchange {i}"]
            if psync.describe_decisions() is not None:   # auto:<codec>: rank 0's decisions (or none yet)
                fields[f"exchange {i} auto"] = psync.describe_decisions()
            if "twophase" in plans[f"exchange {i}"]:   # its buckets are part of the numbers
                fields[f"exchange {i} two-phase buckets"] = self.exchange_plans()[f"exchange {i}"].layout()
        if self._hierarchy > 1:   # only then: settings (and checkpoints) of flat runs stay as they were
            fields["hierarchy"] = self._hierarchy
        fields["frozen parameters"] = [i for i, p in enumerate(self._all_params()) if not p.requires_grad]
        if self.replicas_identical():
            for i, p in enumerate(self._all_params()):
                fields[f"parameter #{i:05d} values"] = f"{parameter_digest(p)} (shape {tuple(p.shape)})"
        return fields

    def replicas_identical(self) -> bool:
        """Whether every worker's parameters must hold the same values now: a fresh
        optimizer, or one of a method whose replicas never differ (a resumed local SGD or
        CSER holds per-worker models)."""
        return self.steps == 0 or not self.replicas_differ

    def verify_consistent(self) -> None:
        """Compare :meth:`describe` across the group (once; collective): raises
        :class:`gradzip.guards.consistency.InconsistentWorkers` on every worker, naming the first
        setting that differs, if any does. ``step()`` calls it on the first step."""
        if self.comm.world_size == 1:  # nothing to compare: no digest of the values either
            self._verified = True
            return
        consistency.verify(self.comm, self.describe(), what=f"{type(self).__name__} settings",
                           fixes={"parameter #": (
                               "The replicas start from different weights: call "
                               "gradzip.broadcast_parameters(model) on every worker before training "
                               "(it copies rank 0's parameters and buffers to all).")})
        self._verified = True

    def verify_once(self) -> None:
        """The first-step guards, before this optimizer's first collective of data: refuse
        DDP double communication, compare settings across workers (:meth:`verify_consistent`);
        nothing once verified."""
        if not self._verified:
            self._ddp_wrappers()
            self.verify_consistent()

    def _ddp_wrappers(self) -> list:
        """The DDP modules over the parameters that communicate nothing (no-op hook), weakly;
        found once (refusing any that would communicate too) until :meth:`reverify`."""
        if self._ddp is None:
            self._ddp = refuse_ddp_double_sync(self._all_params(), type(self).__name__)
        return self._ddp

    def ddp_accumulating(self) -> bool:
        """Whether a DDP wrapper of these parameters (no-op hook: this optimizer communicates)
        is inside ``no_sync()``: backward passes there only accumulate, as inside
        :meth:`accumulate` (Accelerate's ``accumulate()`` enters it on every micro-batch but
        the last of a step)."""
        wrappers = self._ddp_wrappers()
        return bool(wrappers) and accumulating(wrappers)

    def refuse_step_while_accumulating(self) -> None:
        """Refuse ``step()`` inside a DDP wrapper's ``no_sync()`` (:meth:`ddp_accumulating`):
        it would step and communicate on every micro-batch (an optimizer Accelerate did not
        prepare is not skipped there)."""
        if self.ddp_accumulating():
            raise GradzipError(
                f"{type(self).__name__}.step() inside DistributedDataParallel.no_sync(), where backward only "
                "accumulates (Accelerate's accumulate() enters it on every micro-batch but the last): it would "
                "step and communicate on every micro-batch. Step once the gradients are complete: under "
                "Accelerate `if accelerator.sync_gradients: opt.step(); opt.zero_grad()` inside accumulate(), "
                "elsewhere after the last backward, outside no_sync()")
