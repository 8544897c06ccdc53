"""A run's configuration: :class:`RunConfig` (the CLI's flags, what ``summary.json``
records), which of its fields determine the numbers and which change the collectives, how a
run names its method (the ``--algos`` list, the ``algo@codec`` label, the one "unknown
method" check) and how the method is built from it. Used by the CLI, the training loop and
the benchmarks, so a configuration means the same everywhere.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from .. import optim
from ..optim.core import schedule
from ..comm import Group
from ..errors import GradzipError
from ..validation import is_int, is_real
from . import device

#: A comma starts a new method only when a bare word (a method name) follows it, so codec
#: specs may hold commas: ``efsgd@topk:ratio=0.01,unbiased=true,bitsgd``.
_METHOD_BOUNDARY = re.compile(r",(?=\s*[A-Za-z_]\w*\s*(?:@|,|$))")


def method_class(algo: str, where: str = "") -> type:
    """The class registered as ``algo`` in :data:`gradzip.optim.METHODS`; a
    :class:`GradzipError` listing the valid names otherwise (``where``: e.g. ``" in --algos"``)."""
    if algo not in optim.METHODS:
        raise GradzipError(f"unknown method {algo!r}{where}; valid methods: {', '.join(optim.METHODS)}")
    return optim.METHODS[algo]


def method_label(algo: str, codec: str | None = None) -> str:
    """The name a run is reported under: ``algo``, or ``algo@codec`` when a codec is given."""
    return f"{algo}@{codec}" if codec else algo


def parse_algos(text: str, also: tuple[str, ...] = ()) -> list[tuple[str, str | None]]:
    """``"ssgd,efsgd@topk:ratio=0.01,unbiased=true,bitsgd"`` → [(algo, codec or None), ...];
    every method must be registered, or one of the names ``also`` (``gradzip bench net``'s
    ``ddp`` peer)."""
    if not isinstance(text, str) or not text.strip():
        raise GradzipError("--algos is empty; give e.g. ssgd,efsgd@topk:ratio=0.01")
    out = []
    for item in (s.strip() for s in _METHOD_BOUNDARY.split(text)):
        if not item:
            continue
        algo, _, codec = item.partition("@")
        algo = algo.strip().lower()
        if not re.fullmatch(r"[a-z_]\w*", algo):  # '', 'ssgd,,' (stray commas), '@@', ...
            raise GradzipError(f"bad entry {item!r} in --algos: expected METHOD or METHOD@CODEC, comma-separated "
                               f"(e.g. ssgd,efsgd@topk:ratio=0.01); valid methods: {', '.join(optim.METHODS)}")
        if algo not in also:
            method_class(algo, " in --algos")
        out.append((algo, codec.strip() or None))
    return out


@dataclass
class RunConfig:
    """One training run (the CLI's flags, and what ``summary.json`` records)."""

    algo: str = "ssgd"
    options: dict[str, Any] = field(default_factory=dict)  # method options: compressor=, threshold=, ...
    label: str = ""
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False        # fetch missing dataset files (off: no surprise network traffic)
    model: str = "mlp"
    epochs: int = 20
    batch_size: int = 32          # per worker; the global batch is batch_size * workers
    lr: float = 0.1
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    seed: int = 0
    trace: bool = False           # record a timeline (gradzip.trace) of every step
    eval_on: str = "auto"         # "local" model, the workers' "average", or "auto" (average where they differ)
    nonfinite: str = "raise"      # a NaN/Inf gradient: "raise", "skip" the step on every worker, or "off"
    lr_scaling: str = "none"      # large batch: "linear" / "sqrt" scaling of lr with the global batch
    base_batch: int = 0           # the global batch lr is tuned for (0: batch_size, one worker's)
    warmup_epochs: float = 0.0    # gradual warm-up from lr to the scaled lr (Goyal et al.)
    lr_schedule: str = "constant"  # "cosine:warmup=W,final=m": warm-up, then cosine decay over the run (schedule.py)
    sam_rho: float = 0.0          # > 0: SAM around the method, radius rho
    sharpness_rho: float = 0.0    # > 0: the summary reports the final model's sharpness at this rho
    device: str = "cpu"           # "cpu", "cuda" (rank r on cuda:LOCAL_RANK % device_count) or "auto" (train.device)
    amp: str = "none"             # autocast precision: "none", "bf16", or "fp16" (with GradScaler)
    transport: str = "auto"       # PSync transport: auto, allreduce, allgather, twophase
    workers_per_node: int | None = None  # hierarchical exchange with k workers per node (None: flat)
    round_bytes: int | None = None  # two-phase: each all-to-all in rounds of at most this many bytes per message
    link: str | None = None       # the link the plans are priced on ("1gbit"); None: auto measures it
    recalibrate_every: int | None = None  # auto:<codec>: steps between decisions (None: once)
    checkpoint_dir: str | None = None   # write checkpoints here (per rank, atomically)
    checkpoint_every: int = 0     # steps between checkpoints; 0: at the end of every epoch
    eval_every: int = 0           # steps between evaluations inside an epoch (0: only at each epoch's end)
    resume: bool = False          # continue from the newest checkpoint in checkpoint_dir, if any
    keep_checkpoints: int = 2     # steps each rank keeps (>= 2: the newest, and one to resume from if it is damaged)
    start_over: bool = False      # resume: start from scratch when no step is sound (files that fail are kept, renamed)
    progress: bool = True
    straggler: str | None = None  # injected delays (gradzip.train.stragglers): "exp:mean=S", "normal:...", "slow:..."

    @property
    def name(self) -> str:
        return self.label or self.algo


def make_optimizer(cfg: RunConfig, params, comm: Group) -> optim.DistributedOptimizer:
    """The method named ``cfg.algo`` with the common hyper-parameters and its own options;
    an option the method does not take is an error that names the method's options."""
    cls = method_class(cfg.algo)
    accepted = set(optim.method_options(cls))
    unknown = sorted(set(cfg.options) - accepted)
    if unknown:
        raise GradzipError(
            f"method {cfg.algo!r} takes no option {', '.join(unknown)}; its options: "
            f"{', '.join(sorted(accepted)) or 'none'}"
        )
    check_large_batch(cfg)
    options = device.method_options(cfg.amp, cfg.options, cls)   # fp16: the exchange after unscaling
    return cls(params, lr=cfg.lr, comm=comm, momentum=cfg.momentum, nesterov=cfg.nesterov,
               weight_decay=cfg.weight_decay, seed=cfg.seed, nonfinite=cfg.nonfinite,
               **({"hierarchy": cfg.workers_per_node} if cfg.workers_per_node is not None else {}),
               **({"transport": cfg.transport} if cfg.transport != "auto" else {}),
               **({"round_bytes": cfg.round_bytes} if cfg.round_bytes is not None else {}),
               **({"link": cfg.link} if cfg.link is not None else {}),
               **({"recalibrate_every": cfg.recalibrate_every} if cfg.recalibrate_every is not None else {}),
               **options)


def check_large_batch(cfg: RunConfig) -> None:
    """The learning-rate and large-batch options (``--lr-schedule``, ``--lr-scaling``,
    ``--base-batch``, ``--warmup-epochs``, ``--sam-rho``)."""
    warmup = schedule.parse_schedule(cfg.lr_schedule).warmup
    if warmup and cfg.warmup_epochs > 0:
        raise GradzipError("--lr-schedule's warm-up and --warmup-epochs are two learning-rate warm-ups that would "
                           "multiply: drop one (with warmup=0 the schedule decays from the scaled rate)")
    if warmup and (cfg.options or {}).get("lr_warmup_steps"):
        raise GradzipError("--lr-schedule's warm-up and DGC's --lr-warmup-steps are two learning-rate warm-ups that "
                           "would multiply: drop one")
    if cfg.lr_scaling not in schedule.SCALINGS:
        raise GradzipError(f"--lr-scaling must be one of {', '.join(schedule.SCALINGS)}, got {cfg.lr_scaling!r}")
    if not is_int(cfg.base_batch) or cfg.base_batch < 0:
        raise GradzipError(f"--base-batch must be an integer >= 1 (0: --batch-size), got {cfg.base_batch!r}")
    if not is_real(cfg.warmup_epochs) or not 0 <= cfg.warmup_epochs < float("inf"):
        raise GradzipError(f"--warmup-epochs must be a finite number >= 0, got {cfg.warmup_epochs!r}")
    if cfg.warmup_epochs > 0 and cfg.lr_scaling == "none":
        raise GradzipError("--warmup-epochs ramps from --lr to the scaled learning rate: add --lr-scaling linear "
                           "(or sqrt), or leave the warm-up out")
    if cfg.warmup_epochs > 0 and (cfg.options or {}).get("lr_warmup_steps"):
        raise GradzipError("--warmup-epochs and DGC's --lr-warmup-steps are two learning-rate warm-ups that would "
                           "multiply: drop one (with --lr-scaling alone, DGC's warm-up climbs to the scaled rate)")
    for name in ("sam_rho", "sharpness_rho"):
        value = getattr(cfg, name)
        if not is_real(value) or not 0 <= value < float("inf"):
            raise GradzipError(f"{name} must be a finite number >= 0, got {value!r}")
    if cfg.sam_rho > 0 and cfg.amp != "none":
        raise GradzipError("--sam-rho runs its two passes in full precision: leave out --amp, or --sam-rho")


def lr_rule(cfg: RunConfig, world_size: int, steps_per_epoch: int) -> tuple[float, float, int] | None:
    """``(η_base, η*, T_w)`` of the large-batch rule (:mod:`gradzip.optim.core.schedule`), or None
    without ``--lr-scaling``: ``η*`` for the global batch ``batch_size · world_size``, ``T_w``
    the warm-up epochs in steps."""
    if cfg.lr_scaling == "none":
        return None
    target = optim.scaled_lr(cfg.lr, cfg.batch_size * world_size, cfg.base_batch or cfg.batch_size, cfg.lr_scaling)
    return cfg.lr, target, round(cfg.warmup_epochs * steps_per_epoch)


def lr_schedule(cfg: RunConfig, total_steps: int) -> optim.Schedule | None:
    """``--lr-schedule`` parsed for a run of ``total_steps`` steps, or None when every factor
    is 1; its warm-up must end before the run does."""
    parsed = optim.parse_schedule(cfg.lr_schedule)
    if parsed.is_identity:
        return None
    if parsed.warmup >= total_steps:
        raise GradzipError(f"--lr-schedule: the warm-up ({parsed.warmup} steps) must be shorter than the run "
                           f"({total_steps} steps); lower warmup= or train for more epochs")
    return parsed


#: RunConfig fields that do not change a run's numbers: they may differ between workers and
#: between a run and its resumption (a resumed run may also train for more epochs).
FREE_FIELDS = ("label", "data_dir", "download", "trace", "progress", "checkpoint_dir", "checkpoint_every", "resume",
               "keep_checkpoints", "start_over", "straggler", "eval_every")


def trajectory_fields(cfg: RunConfig) -> dict[str, Any]:
    """The settings that determine a run's numbers (compared across workers and against a
    checkpoint)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in FREE_FIELDS}


def collective_fields(cfg: RunConfig) -> dict[str, Any]:
    """Settings free to change between a run and its resumption that still change the
    sequence of collectives (checkpoint saves and their barriers, the resume agreement):
    every worker must have the same."""
    return {"checkpoint_dir given": bool(cfg.checkpoint_dir), "checkpoint_every": cfg.checkpoint_every,
            "resume": cfg.resume, "start_over": cfg.start_over, "eval_every": cfg.eval_every}


#: Seeds are integers in [0, SEED_LIMIT) (the per-rank seeds derived from them fit torch's generators).
SEED_LIMIT = 2 ** 32
