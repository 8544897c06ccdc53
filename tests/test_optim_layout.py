"""Issue 13 (items 3-6): each concept of the optimizer layer in one place, imports pointing
down. The non-finite policy, errors and check live in gradzip.guards.nonfinite (used by exchange,
optim and ddp); the DDP double-sync refusal in gradzip.guards.double_sync; the parameter digest
with replicas; the period check with the rc derivation; the option checks and the undo log
beside base.py."""
from __future__ import annotations

import ast
import pathlib

import torch

import gradzip
import gradzip.integrations.ddp.codec
import gradzip.integrations.ddp.powersgd
import gradzip.integrations.ddp.state
import gradzip.exchange
import gradzip.optim.core.agreement
import gradzip.optim.core.base
from gradzip.guards import consistency, double_sync, nonfinite, replicas
from gradzip.optim.core import guard, options, ratios

SRC = pathlib.Path(gradzip.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_one_nonfinite_concept_used_by_exchange_optim_and_ddp():
    assert gradzip.exchange.psync.NonFiniteAggregate is nonfinite.NonFiniteAggregate
    assert gradzip.NonFiniteGradient is nonfinite.NonFiniteGradient
    assert gradzip.optim.core.base.NONFINITE_POLICIES is nonfinite.NONFINITE_POLICIES
    assert gradzip.integrations.ddp.state.NONFINITE_POLICIES is nonfinite.NONFINITE_POLICIES
    assert gradzip.integrations.ddp.codec.all_finite is nonfinite.all_finite is gradzip.integrations.ddp.powersgd.all_finite
    assert gradzip.exchange.psync.first_nonfinite is nonfinite.first_nonfinite
    assert "...optim.core.base" not in _imports(SRC / "integrations" / "ddp" / "state.py")  # ddp no longer reaches into optim's base


def test_first_nonfinite_sees_through_an_overflowing_sum():
    big = torch.full((4,), 3e38)                      # finite, but its sum overflows
    assert nonfinite.first_nonfinite([big, torch.ones(2)]) == -1 and nonfinite.all_finite([big])
    assert nonfinite.first_nonfinite([big, torch.tensor([1.0, float("nan")])]) == 1
    assert nonfinite.first_nonfinite([]) == -1 and not nonfinite.all_finite([torch.tensor([float("inf")])])


def test_ddp_double_sync_detection_has_its_own_module():
    assert not hasattr(consistency, "refuse_ddp_double_sync") and not hasattr(consistency, "DoubleCommunication")
    assert issubclass(double_sync.DoubleCommunication, gradzip.errors.GradzipError)
    assert "gc" not in (SRC / "guards" / "consistency.py").read_text().split("\n\n\n")[0]  # no gc scan left there
    assert "...guards.double_sync" in _imports(SRC / "optim" / "core" / "agreement.py")


def test_parameter_digest_lives_with_replicas():
    assert gradzip.optim.core.agreement.parameter_digest is replicas.parameter_digest
    assert replicas.parameter_digest(torch.zeros(3)) != replicas.parameter_digest(torch.tensor([0.0, 0.0, 1.0]))


def test_methods_take_check_period_from_ratios_not_from_a_sibling_method():
    for name in ("cser.py", "qsparse.py", "localsgd.py"):
        assert ".localsgd" not in _imports(SRC / "optim" / name), name
    assert gradzip.optim.cser.check_period is ratios.check_period
    assert gradzip.optim.qsparse.check_period is ratios.check_period


def test_base_split_by_concept():
    assert not hasattr(gradzip.optim.core.base, "method_options")  # imported from its home, not re-exported
    assert gradzip.optim.method_options is options.method_options
    assert issubclass(gradzip.optim.DistributedOptimizer, guard.NonFiniteGuard)
    assert len((SRC / "optim" / "core" / "base.py").read_text().splitlines()) <= 360
