"""auto:<codec>'s costs, measured on this run and agreed (docs/algorithms.md §Auto codec
choice, "Calibration"): the probes of the codec's coding on this device and of the link,
and rank 0's decision, which every worker executes.

:func:`decide` is collective on the exchange's group. Every worker times

* the codec and ``none`` (:func:`measure_codec`): ``compress_residual`` and the decode of
  the tensor's route (``from_sum`` of a summand, or ``aggregate`` of ``n`` packets), best of
  :data:`REPEATS` (:data:`SMALL_REPEATS` for small ones), on random tensors of
  :data:`SMALL_PROBE` elements and of the exchange's smallest and largest shapes, on its device and dtype; a least-squares line
  ``a + b·numel`` (:class:`~gradzip.exchange.planner.CodecCost`) through them;
* the link (:func:`measure_link`, only where none is declared): an allreduce and an
  allgather of each of :data:`LINK_PROBE_BYTES`, best of :func:`repeats_for` after a warm-up.

The workers' numbers are gathered (``allgather_control``); rank 0 takes the largest of each
(the slowest worker sets a synchronous step's pace), fits the link (:func:`fit_link`), plans
with those costs and sends its :class:`Decision` (a second ``allgather_control``: rank 0's
row), which every worker returns. So the plans agree whatever each worker measured.

Where the link was measured and the rule compresses something, the rule's choices go on
**trial** (:func:`on_trial`, :func:`advance`): blocks of :data:`TRIAL_BLOCK` exchanges, the
rule's choices, then nothing compressed; the first :data:`TRIAL_SETTLE` of each block untimed
(the switch's own costs: a plan's first executions, and under error feedback the error the
first step after a switch has or folds), its :data:`TRIAL_STEPS` others timed, each worker
timing the periods from one exchange to the next (a step, or H steps for a method that
exchanges every H); every worker gathers every worker's times and keeps the rule's choices
only where their period (the slowest worker's, the best of the trial's) is shorter than the
uncompressed one by :data:`TRIAL_KEEP_GAIN`. Where the first two blocks do not decide
(:func:`decisive`: none not :data:`TRIAL_CLOSE` faster, the rule not :data:`TRIAL_CLEAR_GAIN`
faster), the trial is retried once: two more blocks (the rule's, then nothing compressed),
and the verdict from the best of all four timed periods each. The probes price coding and
link apart; the trial prices what they cannot see: compute the uncompressed allreduce hides
behind, and coding that takes the cores the collectives and the backward pass need.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from ..comm import Group
from ..comm.base import allgather_wire_bytes, allreduce_wire_bytes
from ..compressors import Auto, Compressor
from ..errors import GradzipError
from .planner import CodecCost, Link, Plan, exact_route
from ..validation import is_int

log = logging.getLogger(__name__)

#: Sizes of the link probe's allreduce and allgather: latency, then bandwidth at the default
#: bucket's size (a shorter probe is dominated by scheduling noise on a loaded host:
#: docs/algorithms.md §Auto codec choice, "[choice] 4 MiB for the bandwidth probe").
LINK_PROBE_BYTES = (4, 4 << 20)
#: Timings per probe; the best counts (what the device and the link can do).
REPEATS = 3
#: Timings per probe of a small tensor or message (at most :data:`SMALL_NUMEL` elements): a
#: per-call cost of tens of µs needs more tries to find the best through a loaded host's
#: scheduling noise (docs/algorithms.md §Auto codec choice, "[choice] More tries for small probes").
SMALL_REPEATS = 30
SMALL_NUMEL = 1 << 16
#: The smallest tensor the codec probe times (the per-call cost ``a``).
SMALL_PROBE = 64
#: Timed exchanges per block of the trial (the rule's choices, then nothing compressed); the
#: best of their periods counts.
TRIAL_STEPS = 2
#: Untimed exchanges at the start of every block: the switch's own costs are not what a step
#: costs. A plan's first executions pay one-time costs (buffers, kernels, a transport's first
#: messages; the two-phase exchange's first steps took 2x its steady step on 4 workers); under
#: error feedback the first step of the rule after nothing compressed has no error to add
#: (EF-SGD's ``p = η g``), and the first uncompressed step after the rule folds every error in
#: (measured on loopback, mlp10m, 2 workers, EF-SGD top-1%: 65.8 ms against the next two's
#: 70.9 and 71.1, and 76.9 against 70.9 and 73.4; docs/algorithms.md §Auto codec choice,
#: "[choice] Each block's first exchange settles").
TRIAL_SETTLE = 1
#: Exchanges of one block.
TRIAL_BLOCK = TRIAL_SETTLE + TRIAL_STEPS
#: Every exchange of a trial: the rule's block, then nothing compressed's.
TRIAL_EXCHANGES = 2 * TRIAL_BLOCK
#: A first verdict for nothing compressed is final where none's best period is shorter than
#: the rule's by this fraction of its own (the rule's at least ``1 + TRIAL_CLOSE`` times it);
#: else the trial is retried once with two more blocks (docs/algorithms.md §Auto codec choice,
#: "[choice] A trial that does not decide is retried").
TRIAL_CLOSE = 0.25
#: A first verdict that keeps the rule's choices is final only where the rule's best period
#: is shorter than none's by this fraction of its own (none's at least ``1 + TRIAL_CLEAR_GAIN``
#: times it: the rule halves the step); else retried as above. Larger than
#: :data:`TRIAL_CLOSE`: keeping compression that does not pay costs every step of the run
#: (docs/algorithms.md §Auto codec choice, "[choice] Keeping compression needs a clear win").
TRIAL_CLEAR_GAIN = 1.0
#: Any verdict keeps the rule's choices only where none's best period is at least
#: ``1 + TRIAL_KEEP_GAIN`` times the rule's: a closer win is within what alternating blocks
#: shift a period by on a loaded host, and taking none there costs at most this fraction of a
#: step, the tolerance auto is held to against the best fixed choice
#: (docs/algorithms.md §Auto codec choice, "[choice] Keeping compression needs a clear win").
TRIAL_KEEP_GAIN = 0.10
#: Every exchange of a retried trial.
RETRIED_EXCHANGES = TRIAL_EXCHANGES + 2 * TRIAL_BLOCK


def check_recalibrate_every(value, where: str = "PSync") -> int | None:
    """``recalibrate_every``: None (decide once) or an integer >= 1 (steps between decisions)."""
    if value is not None and (not is_int(value) or value < 1):
        raise GradzipError(f"{where}: recalibrate_every must be an integer >= 1 (steps between auto's decisions) "
                           f"or None (decide once), got {value!r}")
    return None if value is None else int(value)


@dataclass(frozen=True)
class Decision:
    """What auto executes for one set of tensors: the codec spec of each unit of the plan
    (``choices``), the link and the codec costs it was decided on, and the step it was made
    at (``step``: the first step it applies to). ``measured``: the link was probed."""

    choices: tuple[str, ...]
    link: Link
    costs: dict[str, CodecCost] = field(hash=False)
    step: int
    measured: bool
    #: the trial (module docstring): the rule's choices under trial (None: no trial; ``choices``
    #: are then what is executed now: the rule's, the uncompressed trial steps', or the verdict's)
    proposed: tuple[str, ...] | None = None
    #: this worker's seconds of the trial's steps so far, ``(step, seconds)`` (kept in a
    #: checkpoint taken during the trial; emptied at the verdict)
    timed: tuple[tuple[int, float], ...] = ()
    #: the trial's verdict: the seconds a period of (the rule's choices, nothing compressed) it was made on
    verdict: tuple[float, float] | None = None
    #: the steps of the exchanges of the trial so far (the decision's first: a method that
    #: exchanges every H steps tries H-step periods)
    trial_steps: tuple[int, ...] = ()
    #: the trial's exchanges: :data:`TRIAL_EXCHANGES`, or :data:`RETRIED_EXCHANGES` once its
    #: first verdict did not decide (:func:`decisive`; agreed: every worker decides it from the
    #: same gathered times)
    trial_exchanges: int = TRIAL_EXCHANGES

    @property
    def retried(self) -> bool:
        return self.trial_exchanges > TRIAL_EXCHANGES

    @property
    def on_trial(self) -> bool:
        return self.proposed is not None and self.verdict is None

    def describe(self) -> str:
        """One line, the same on every worker (a setting they agree on)."""
        counts = {c: self.choices.count(c) for c in dict.fromkeys(self.choices)}
        costs = ", ".join(f"{spec} {c.fixed_s * 1e6:.3g} us + {c.per_element_s * 1e9:.3g} ns/element"
                          for spec, c in self.costs.items())
        trial = ""
        if self.proposed is not None:
            trial = f"; trial of ({','.join(self.proposed)}) against none"
            if self.verdict is not None:
                kept = self.choices == self.proposed
                retried = (f" (best of {2 * TRIAL_STEPS} each: {TRIAL_STEPS} did not decide)"
                           if self.retried else "")
                trial += (f": {self.verdict[0] * 1e3:.1f} ms against {self.verdict[1] * 1e3:.1f} ms a period{retried}, "
                          f"{'kept' if kept else 'none taken'} from step {self.trial_steps[-1]}")
            else:
                trial += f", under way ({len(self.trial_steps)} of {self.trial_exchanges} exchanges)"
        return (f"step {self.step}: " + ", ".join(f"{c} x{k}" for c, k in counts.items())
                + f" ({','.join(self.choices)}); link {self.link} ({'measured' if self.measured else 'declared'})"
                + (f"; {costs}" if costs else "") + trial)

    def state(self) -> dict:
        """Plain values (a checkpoint's ``exchange_states``)."""
        trial = {} if self.proposed is None else {
            "proposed": list(self.proposed), "timed": [list(t) for t in self.timed],
            "trial_steps": list(self.trial_steps), "trial_exchanges": self.trial_exchanges,
            **({"verdict": list(self.verdict)} if self.verdict is not None else {})}
        return {"choices": list(self.choices), "link": [self.link.bytes_per_s, self.link.latency_s],
                "costs": {spec: [c.fixed_s, c.per_element_s] for spec, c in self.costs.items()},
                "step": self.step, "measured": self.measured, **trial}

    @classmethod
    def from_state(cls, state: dict) -> "Decision":
        proposed, verdict = state.get("proposed"), state.get("verdict")
        return cls(tuple(state["choices"]), Link(*state["link"]),
                   {spec: CodecCost(*c) for spec, c in state["costs"].items()}, int(state["step"]),
                   bool(state["measured"]), None if proposed is None else tuple(proposed),
                   tuple((int(s), float(t)) for s, t in state.get("timed", [])),
                   None if verdict is None else (float(verdict[0]), float(verdict[1])),
                   tuple(int(s) for s in state.get("trial_steps", [])),
                   int(state.get("trial_exchanges", TRIAL_EXCHANGES)))


def save(decisions: dict[tuple, Decision]) -> list[dict]:
    """A PSync's decisions (keyed ``(((shape, dtype), ...), keys)``) as plain values, one
    entry per set of tensors (an exchange's ``state_dict()``, the DDP hook's)."""
    return [{"shapes": [list(shape) for shape, _ in specs], "dtypes": [str(d).removeprefix("torch.") for _, d in specs],
             "keys": list(keys), **d.state()} for (specs, keys), d in decisions.items()]


def load(entries: Sequence[dict]) -> dict[tuple, Decision]:
    """:func:`save`'s entries back."""
    return {(tuple((tuple(shape), getattr(torch, d)) for shape, d in zip(e["shapes"], e["dtypes"])),
             tuple(e["keys"])): Decision.from_state(e) for e in entries}


def on_trial(decision: Decision) -> Decision:
    """``decision`` with its trial started where it has one (module docstring): a measured
    link and the rule compressing some unit; its first steps execute the rule's choices."""
    if not decision.measured or all(c == "none" for c in decision.choices):
        return decision
    return replace(decision, proposed=decision.choices)


def advance(comm: Group, decision: Decision, step: int, seconds: Callable[[int], float | None]) -> Decision:
    """``decision`` (on trial) at its exchange of ``step``: the trial's exchanges counted (the
    decision's step is the first), the periods this worker knows by now recorded
    (``seconds(s)``: from its exchange of step s to its next one, None where not known);
    blocks of :data:`TRIAL_BLOCK` exchanges alternate the rule's choices and nothing
    compressed (:func:`_trial_choice`), the first :data:`TRIAL_SETTLE` of each untimed
    (:func:`_timed`); after the trial's exchanges the verdict (collective on ``comm``: every
    worker gathers every worker's timed periods and takes, per period, the slowest worker's,
    per candidate the best period; the rule's choices are kept iff :func:`keeps` says so;
    missing times: uncompressed), or, where the first verdict's two are not
    :func:`decisive`, two more blocks and the verdict from all timed periods."""
    steps = decision.trial_steps or (decision.step,)
    if step not in steps:
        steps += (step,)
    at = steps.index(step)
    known = dict(decision.timed)
    known.update({s: t for s in steps[:at] if s not in known and (t := seconds(s)) is not None})
    timed = tuple(sorted(known.items()))
    if at < decision.trial_exchanges:
        return replace(decision, choices=_trial_choice(decision, at), timed=timed, trial_steps=steps)
    counted = [k for k in range(decision.trial_exchanges) if _timed(k)]
    mine = torch.tensor([known.get(steps[k], math.nan) for k in counted], dtype=torch.float64)
    every = comm.allgather_control(mine).reshape(comm.world_size, -1)
    slowest = torch.where(torch.isnan(every), math.inf, every).max(dim=0).values.tolist()
    rule = min(t for k, t in zip(counted, slowest) if _rule_block(k))
    none = min(t for k, t in zip(counted, slowest) if not _rule_block(k))
    if not decision.retried and not decisive(rule, none):
        return replace(decision, choices=_trial_choice(decision, at), timed=timed, trial_steps=steps,
                       trial_exchanges=RETRIED_EXCHANGES)
    choices = decision.proposed if keeps(rule, none) else ("none",) * len(decision.proposed)
    return replace(decision, choices=choices, timed=(), verdict=(rule, none), trial_steps=steps)


def decisive(rule: float, none: float) -> bool:
    """Whether a trial's first verdict from the best periods ``rule`` and ``none`` is final:
    none faster by :data:`TRIAL_CLOSE`, or the rule faster by :data:`TRIAL_CLEAR_GAIN` (module
    docstring). A missing time (+inf) decides against its candidate."""
    return rule >= (1 + TRIAL_CLOSE) * none or none >= (1 + TRIAL_CLEAR_GAIN) * rule


def keeps(rule: float, none: float) -> bool:
    """Whether a verdict from the best periods ``rule`` and ``none`` keeps the rule's choices:
    none's at least :data:`TRIAL_KEEP_GAIN` longer (ties, closer wins and a missing rule
    time: uncompressed)."""
    return none >= (1 + TRIAL_KEEP_GAIN) * rule and rule < none


def _rule_block(at: int) -> bool:
    """Whether the trial's exchange ``at`` (0-based) executes the rule's choices: every other
    block of :data:`TRIAL_BLOCK`, the first included."""
    return at // TRIAL_BLOCK % 2 == 0


def _timed(at: int) -> bool:
    """Whether the trial's exchange ``at`` (0-based) counts: not the first :data:`TRIAL_SETTLE`
    of its block."""
    return at % TRIAL_BLOCK >= TRIAL_SETTLE


def _trial_choice(decision: Decision, at: int) -> tuple[str, ...]:
    """What the trial's exchange ``at`` executes: the rule's choices, or none on every unit."""
    return decision.proposed if _rule_block(at) else ("none",) * len(decision.proposed)


def switches(old: Decision, new: Decision) -> list[str]:
    """The units whose codec changed from ``old`` to ``new``, as ``"unit j: C -> none"``."""
    return [f"unit {j}: {a} -> {b}" for j, (a, b) in enumerate(zip(old.choices, new.choices)) if a != b]


# ----------------------------------------------------------------------------- the probes
def repeats_for(numel: int) -> int:
    """How many timings a probe of ``numel`` elements takes (the same on every worker)."""
    return SMALL_REPEATS if numel <= SMALL_NUMEL else REPEATS


def _best(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The shortest of ``repeats`` timings of ``run`` (after one untimed call)."""
    run()
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_line(points: Sequence[tuple[float, float]]) -> CodecCost:
    """The least-squares ``a + b·x`` through ``(x, seconds)`` points, with ``a, b >= 0``."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    m = len(xs)
    mx, my = sum(xs) / m, sum(ys) / m
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if b <= 0:
        return CodecCost(max(my, 0.0), 0.0)
    a = my - b * mx
    if a < 0:
        return CodecCost(0.0, max(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0))
    return CodecCost(a, b)


def probe_shapes(shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shapes the codec probe times: :data:`SMALL_PROBE` elements, and the exchange's
    smallest and largest tensor."""
    sized = sorted((math.prod(s), tuple(s)) for s in shapes if math.prod(s) > 0)
    chosen = [(SMALL_PROBE,)] + ([sized[0][1], sized[-1][1]] if sized else [])
    return list(dict.fromkeys(chosen))


def measure_codec(codec: Compressor, shapes: Sequence[tuple[int, ...]], n: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", seed: int = 0) -> CodecCost:
    """This worker's coding cost of ``codec`` for ``n`` workers (module docstring)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    points = []
    for shape in probe_shapes(shapes):
        x = torch.randn(shape, generator=generator, device=device).to(dtype)
        residual = torch.empty_like(x)
        route = exact_route(codec, shape, n, dtype)[0]

        def once(x=x, residual=residual, route=route):
            packet = codec.compress_residual(x, seed, residual)
            if route == "allreduce":
                return codec.from_sum(codec.summand(packet, n).clone(), packet, n)
            return codec.aggregate([packet] * n)

        points.append((math.prod(shape), _best(once, device, repeats_for(math.prod(shape)))))
    return fit_line(points)


def measure_link(comm: Group, device: torch.device | str = "cpu") -> list[float]:
    """This worker's seconds for an allreduce, then an allgather, of each of
    :data:`LINK_PROBE_BYTES` on ``comm`` (collective; best of :func:`repeats_for` its size)."""
    device = torch.device(device)
    out = []
    for collective in (comm.allreduce, comm.allgather):
        for nbytes in LINK_PROBE_BYTES:
            repeats = repeats_for(nbytes // 4)
            buffers = [torch.zeros(nbytes // 4, device=device) for _ in range(repeats + 1)]
            out.append(_best(lambda: collective(buffers.pop()), device, repeats))
    return out


def fit_link(seconds: Sequence[float], n: int) -> Link:
    """The link whose ring model (docs/algorithms.md §Transports, "The plan") is closest, in
    least squares, to ``seconds`` (:func:`measure_link`'s order) among ``n`` workers:
    ``α >= 0`` per message step, ``1/B > 0`` (``inf`` bytes/s where no time grows with size)."""
    if n <= 1:
        return Link(math.inf, 0.0)
    rows = [(2 * (n - 1), allreduce_wire_bytes(s, n)) for s in LINK_PROBE_BYTES]
    rows += [(n - 1, allgather_wire_bytes(s, n)) for s in LINK_PROBE_BYTES]
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sat = sum(a * t for (a, _), t in zip(rows, seconds))
    sbt = sum(b * t for (_, b), t in zip(rows, seconds))
    det = saa * sbb - sab * sab
    alpha = (sat * sbb - sbt * sab) / det
    beta = (saa * sbt - sab * sat) / det
    if alpha < 0:   # no latency: the bytes alone
        alpha, beta = 0.0, sbt / sbb
    if beta <= 0:   # no time grows with size: latency alone
        alpha, beta = max(sat / saa, 0.0), 0.0
    return Link(1 / beta if beta > 0 else math.inf, alpha)


# ----------------------------------------------------------------------------- the agreement
def decide(comm: Group, auto: Auto, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
           plan: Callable[[Link, dict[str, CodecCost]], Plan], step: int, *, link: Link | None = None,
           probe: Group | None = None, uplink_share: int = 1, device: torch.device | str = "cpu",
           seed: int = 0) -> Decision:
    """The decision for an exchange of ``shapes`` (launch order) with ``auto`` (collective on
    ``comm``; module docstring). ``plan(link, costs)``: the exchange's plan on that link with
    those costs (its ``choices`` are the decision). ``link``: declared (no link probe);
    ``probe``: the group whose collectives the exchange's buckets run on and whose size the
    decode is timed for (default ``comm``; the hierarchical exchange's group across nodes),
    ``uplink_share``: how many such groups share the probed link at once (its bandwidth is
    that many times what one measures)."""
    probe, measured = probe or comm, link is None
    n = probe.world_size
    if comm.world_size == 1 or n == 1:   # no network: nothing to compress for (ties go uncompressed)
        chosen = link or Link(math.inf, 0.0)
        return Decision(plan(chosen, {}).choices, chosen, {}, step, False)
    dtype = max(set(dtypes), key=list(dtypes).count) if dtypes else torch.float32
    mine = []
    for codec in (auto.codec, auto.dense):
        cost = measure_codec(codec, shapes, n, dtype, device, seed)
        mine += [cost.fixed_s, cost.per_element_s]
    mine += measure_link(probe, device) if link is None else [0.0] * 4
    gathered = comm.allgather_control(torch.tensor(mine, dtype=torch.float64)).reshape(comm.world_size, -1)
    slots = len(plan(Link(math.inf, 0.0), {}).choices)
    row = torch.zeros(6 + slots, dtype=torch.float64)
    if comm.rank == 0:
        worst = gathered.max(dim=0).values.tolist()
        costs = {auto.codec.spec: CodecCost(*worst[0:2]), auto.dense.spec: CodecCost(*worst[2:4])}
        if link is None:
            fitted = fit_link(worst[4:8], n)
            link = Link(fitted.bytes_per_s * uplink_share, fitted.latency_s)
        choices = plan(link, costs).choices
        row = torch.tensor([link.bytes_per_s, link.latency_s, *worst[0:4],
                            *(1.0 if c == auto.codec.spec else 0.0 for c in choices)], dtype=torch.float64)
    agreed = comm.allgather_control(row).reshape(comm.world_size, -1)[0].tolist()
    costs = {auto.codec.spec: CodecCost(*agreed[2:4]), auto.dense.spec: CodecCost(*agreed[4:6])}
    choices = tuple(auto.codec.spec if c == 1.0 else "none" for c in agreed[6:])
    return Decision(choices, Link(agreed[0], agreed[1]), costs, step, measured)
