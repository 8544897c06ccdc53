"""The options every method shares and how they are checked; a method's own options as the
CLI sees them (:func:`method_options`). Apart from :mod:`gradzip.optim.core.base` because the
constructor, ``load_state_dict``, ``add_param_group`` and the front ends (cli, train) all
use them, and none of them needs the optimizer."""
from __future__ import annotations

import inspect
import typing

from ...validation import is_real, require

#: Options every method takes; the rest of a method's keyword-only options are its own.
COMMON_OPTIONS = ("lr", "comm", "momentum", "nesterov", "weight_decay", "seed", "bucket_bytes", "nonfinite",
                  "transport", "hierarchy", "round_bytes")

#: The largest finite float32: a learning rate or decay above it overflows the update.
FLOAT32_MAX = 3.4028234663852886e38


def check_hyperparameters(method: str, lr, momentum, weight_decay, nesterov, where: str = "") -> None:
    """The common hyper-parameters' checks (constructor, ``load_state_dict``,
    ``add_param_group``); ``where`` prefixes the field, e.g. ``"param_groups[1]."``."""
    require(is_real(lr) and 0 <= lr <= FLOAT32_MAX, method, f"{where}lr must be a finite number >= 0, got {lr!r}")
    require(is_real(momentum) and 0.0 <= momentum < 1.0, method,
            f"{where}momentum must be in [0, 1), got {momentum!r}")
    require(is_real(weight_decay) and 0.0 <= weight_decay <= FLOAT32_MAX, method,
            f"{where}weight_decay must be a finite number >= 0, got {weight_decay!r}")
    require(isinstance(nesterov, bool), method, f"{where}nesterov must be True or False, got {nesterov!r}")
    require(not nesterov or momentum > 0, method, f"{where}nesterov=True needs momentum > 0")


def check_group(method: str, group: dict, where: str) -> None:
    """:func:`check_hyperparameters` on a param group's entries."""
    check_hyperparameters(method, group.get("lr"), group.get("momentum"), group.get("weight_decay"),
                          group.get("nesterov"), where)


def method_options(cls: type) -> dict[str, type]:
    """A method's own keyword-only options and their types (int, float, bool or str), read
    from its signature, so front ends (the CLI) need no per-method code."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not evaluate: fall back to the default's type
        hints = {}
    out = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if param.kind != param.KEYWORD_ONLY or name in COMMON_OPTIONS:
            continue
        kinds = typing.get_args(hints.get(name)) or (hints.get(name),)
        simple = [k for k in (bool, int, float, str) if k in kinds]
        if not simple and param.default is not None and param.default is not inspect.Parameter.empty:
            simple = [type(param.default)]
        out[name] = simple[0] if simple else str
    return out


#: Adam's (β1, β2) when neither spelling is given.
DEFAULT_BETAS = (0.9, 0.999)


def parse_betas(where: str, betas=None, *, beta1=None, beta2=None,
                default: tuple[float, float] = DEFAULT_BETAS) -> tuple[float, float]:
    """``(β1, β2)`` from either spelling the CLI has: ``betas``, a pair of numbers or the
    string ``"0.9,0.999"`` (``--betas``), or ``beta1`` / ``beta2`` (``--beta1 --beta2``; one
    alone keeps the other's default); each in [0, 1). Both spellings at once are refused."""
    require(betas is None or (beta1 is None and beta2 is None), where,
            f"give betas ({betas!r}) or beta1/beta2 ({beta1!r}, {beta2!r}), not both; drop --betas or --beta1/--beta2")
    if betas is None:
        for key, b in (("beta1", beta1), ("beta2", beta2)):
            require(b is None or (is_real(b) and 0 <= b < 1), where, f"{key} must be a number in [0, 1), got {b!r}")
        return (float(default[0] if beta1 is None else beta1), float(default[1] if beta2 is None else beta2))
    if isinstance(betas, str):
        try:
            betas = tuple(float(b) for b in betas.split(","))
        except ValueError:
            betas = ()
    ok = isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_real(b) and 0 <= b < 1 for b in betas)
    require(ok, where, f"betas must be two numbers in [0, 1) such as 0.9,0.999, got {betas!r}")
    return float(betas[0]), float(betas[1])


def no_momentum(where: str, momentum, nesterov, fix: str = "") -> None:
    """The Adam-like methods' refusal of ``momentum`` / ``nesterov``: their momentum is β1.
    ``fix``: a method's other way out (DiLoCo: ``inner='sgd'``)."""
    require(is_real(momentum) and momentum == 0 and not nesterov, where,
            f"momentum is betas[0] in this optimizer (its moments are beta1, beta2), got momentum={momentum!r}, "
            f"nesterov={nesterov!r}; leave momentum at 0 and nesterov off (CLI: drop --momentum / --nesterov, "
            f"set --betas 0.9,0.999 or --beta1/--beta2){fix}")
