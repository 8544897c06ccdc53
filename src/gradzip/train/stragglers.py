"""Stragglers (docs/stragglers.md; spec §Stragglers, the lecture's brainteaser): per-worker
per-step delays injected into training, and the expected synchronous wait they cause.

A step of synchronous training waits for the slowest of K workers: step time = compute +
max_i δ_i + communication. :func:`parse` reads the ``--straggler`` spec:

* ``exp:mean=S`` — δ ~ Exponential with mean S seconds; ``E[max of K] = S · H_K``
  (``H_K = Σ_{k≤K} 1/k ≈ ln K + 0.5772``);
* ``normal:mean=S,std=S`` — δ ~ N(mean, std²) clipped at 0; ``E[max] = mean + std · e_K``
  with ``e_K`` the expected maximum of K standard normals (:func:`expected_max_normal`,
  by quadrature), valid for ``mean ≥ 3·std``; below that the expectation of the clipped
  law is computed numerically (``∫_0^∞ 1 − Φ((x−μ)/σ)^K dx``);
* ``slow:rank=R,factor=F`` — worker R computes F times slower: its delay is ``(F−1) ×``
  its measured compute time of the step; the step takes F × compute when R < K.

Delays are drawn from ``random.Random(seeds.straggler_seed(seed, rank, step))``: a function
of the run's seed, the rank and the step only, so every method compared in one run sees
the same delays, and a resumed run the same as an uninterrupted one. The training loop
(:mod:`gradzip.train.loop`) sleeps the delay before the forward pass, so it also holds
back an exchange that gradient hooks start during backward (``slow`` stretches the previous
step's compute), and counts it as **compute** (a straggler is a worker that computes
slowly); the seconds injected are recorded (``straggler_delay_s``). The timeline model
(:mod:`gradzip.bench.timeline`) adds :meth:`Straggler.expected_wait` to the compute of a
synchronous iteration, with these same formulas.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .. import seeds, specs
from ..errors import GradzipError

#: The Euler-Mascheroni constant: ``H_K ≈ ln K + EULER_GAMMA``.
EULER_GAMMA = 0.5772156649015329

KINDS = {"exp": ("mean",), "normal": ("mean", "std"), "slow": ("rank", "factor")}
_USAGE = "exp:mean=S | normal:mean=S,std=S | slow:rank=R,factor=F (seconds; F >= 1)"


def harmonic(K: int) -> float:
    """``H_K = Σ_{k=1..K} 1/k``."""
    return math.fsum(1.0 / k for k in range(1, K + 1))


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _simpson(f, a: float, b: float, n: int = 4000) -> float:
    n += n % 2
    h = (b - a) / n
    total = f(a) + f(b) + 4 * math.fsum(f(a + (2 * i - 1) * h) for i in range(1, n // 2 + 1)) \
        + 2 * math.fsum(f(a + 2 * i * h) for i in range(1, n // 2))
    return total * h / 3


def expected_max_normal(K: int) -> float:
    """``e_K = E[max of K standard normals] = ∫ x · K φ(x) Φ(x)^{K−1} dx`` (Simpson on
    [−12, 12]): e_1 = 0, e_2 = 1/√π, e_4 ≈ 1.0294, e_8 ≈ 1.4236."""
    if K == 1:
        return 0.0
    return _simpson(lambda x: x * K * _phi(x) * _Phi(x) ** (K - 1), -12.0, 12.0)


def expected_max_clipped_normal(K: int, mean: float, std: float) -> float:
    """``E[max_i max(0, X_i)]``, ``X_i ~ N(mean, std²)``: ``∫_0^∞ 1 − Φ((x−mean)/std)^K dx``."""
    if std == 0:
        return max(0.0, mean)
    hi = max(mean, 0.0) + 12 * std
    return _simpson(lambda x: 1.0 - _Phi((x - mean) / std) ** K, 0.0, hi)


@dataclass(frozen=True)
class Straggler:
    """One ``--straggler`` setting (module docstring)."""

    kind: str
    mean: float = 0.0
    std: float = 0.0
    rank: int = 0
    factor: float = 1.0

    @property
    def spec(self) -> str:
        if self.kind == "exp":
            return f"exp:mean={self.mean:g}"
        if self.kind == "normal":
            return f"normal:mean={self.mean:g},std={self.std:g}"
        return f"slow:rank={self.rank},factor={self.factor:g}"

    def delay(self, seed: int, rank: int, step: int, compute_s: float = 0.0) -> float:
        """Seconds worker ``rank`` sleeps at ``step`` (``compute_s``: its compute time in
        this step, for ``slow``)."""
        if self.kind == "slow":
            return (self.factor - 1.0) * compute_s if rank == self.rank else 0.0
        rng = random.Random(seeds.straggler_seed(seed, rank, step))
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.mean) if self.mean > 0 else 0.0
        return max(0.0, rng.gauss(self.mean, self.std))

    def expected_wait(self, K: int, compute_s: float = 0.0) -> float:
        """``E[max of K delays]``: the mean extra time of a synchronous step of K workers
        (``compute_s``: the compute per step, for ``slow``)."""
        if self.kind == "exp":
            return self.mean * harmonic(K)
        if self.kind == "normal":
            if self.mean >= 3 * self.std:
                return self.mean + self.std * expected_max_normal(K)
            return expected_max_clipped_normal(K, self.mean, self.std)
        return (self.factor - 1.0) * compute_s if self.rank < K else 0.0

    def expected_delay(self, rank: int, compute_s: float = 0.0) -> float:
        """``E[δ_i]`` of one worker (what an asynchronous method waits for: nobody else)."""
        if self.kind == "exp":
            return self.mean
        if self.kind == "normal":
            return expected_max_clipped_normal(1, self.mean, self.std)
        return (self.factor - 1.0) * compute_s if rank == self.rank else 0.0


def parse(spec: "str | Straggler | None") -> Straggler | None:
    """The :class:`Straggler` of a ``--straggler`` spec (None, '' and 'none': no delays);
    a one-line :class:`GradzipError` naming the problem and the valid forms otherwise."""
    if spec is None or isinstance(spec, Straggler):
        return spec
    if not isinstance(spec, str):
        raise GradzipError(f"--straggler must be a string ({_USAGE}), got {type(spec).__name__}")
    if spec.strip().lower() in ("", "none"):
        return None
    kind, _, options = specs.split(spec)
    if kind not in KINDS:
        raise GradzipError(f"unknown --straggler kind {kind!r} in {spec!r}; expected {_USAGE}")
    values: dict[str, float] = {}
    for opt in options:
        if not opt.has_value and opt.key in KINDS[kind]:
            raise GradzipError(f"--straggler {spec!r}: {opt.key} needs a value ({opt.key}=...); expected {_USAGE}")
        if opt.key not in KINDS[kind]:
            raise GradzipError(f"--straggler {spec!r}: {kind} takes {', '.join(k + '=' for k in KINDS[kind])}, "
                               f"not {opt.item!r}; expected {_USAGE}")
        try:
            values[opt.key] = float(opt.value)
        except ValueError:
            raise GradzipError(f"--straggler {spec!r}: {opt.key} must be a number, got {opt.value!r}") from None
    missing = [k for k in KINDS[kind] if k not in values]
    if missing:
        raise GradzipError(f"--straggler {spec!r}: {kind} needs {', '.join(k + '=' for k in missing)}; "
                           f"expected {_USAGE}")
    for key, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise GradzipError(f"--straggler {spec!r}: {key} must be a finite number >= 0, got {value!r}")
    if kind == "slow":
        if values["rank"] != int(values["rank"]):
            raise GradzipError(f"--straggler {spec!r}: rank must be an integer, got {values['rank']!r}")
        if values["factor"] < 1:
            raise GradzipError(f"--straggler {spec!r}: factor must be >= 1 (F times the compute), "
                               f"got {values['factor']!r}")
        return Straggler("slow", rank=int(values["rank"]), factor=values["factor"])
    return Straggler(kind, mean=values["mean"], std=values.get("std", 0.0))


def canonical(spec: "str | Straggler | None") -> str | None:
    """``spec`` checked (:func:`parse`) and written in its canonical form; None for none
    (what ``--straggler`` stores in a run's config)."""
    parsed = parse(spec)
    return parsed.spec if parsed is not None else None


def check_rank(straggler: Straggler | None, world_size: int) -> None:
    """``slow:rank=R`` must name a worker of the run."""
    if straggler is not None and straggler.kind == "slow" and straggler.rank >= world_size:
        raise GradzipError(f"--straggler {straggler.spec}: rank {straggler.rank} is not a worker of this "
                           f"run ({world_size} workers: ranks 0..{world_size - 1})")
