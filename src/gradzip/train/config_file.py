"""Config files for ``gradzip train`` / ``compare``: ``--config FILE`` (TOML) holds the same
settings as the flags, and a run with ``--out DIR`` writes its effective settings to
``DIR/config.toml``, so ``gradzip compare --config DIR/config.toml`` repeats it exactly.

A key is a flag's name without the dashes (``batch-size = 64``, ``compressor =
"topk:ratio=0.01"``, ``algos = ["ssgd", "bitsgd"]`` or ``"ssgd,bitsgd"``); every flag of the
command may appear, and a flag given on the command line overrides the file. Values go
through the flag's own check, so a file accepts exactly what the command line accepts.

TOML, not YAML: its values are typed (``lr = 1e-3`` is a float; YAML 1.1, which PyYAML
reads, makes ``1e-3`` a string and ``nonfinite: off`` the boolean false) and it is the
format of ``pyproject.toml``. Python reads it (``tomllib``, 3.11; ``tomli`` before);
writing takes the small ``tomli-w``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..errors import GradzipError
from ..files import write_text

#: The file a run writes into ``--out``.
NAME = "config.toml"
#: Parser destinations that are not settings of the run.
_NOT_SETTINGS = {"help", "config", "command"}


def _settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Key (the flag without its dashes) -> argparse action, for every flag of ``parser``."""
    out = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        if action.option_strings and action.dest not in _NOT_SETTINGS:
            long = [o for o in action.option_strings if o.startswith("--")] or action.option_strings
            out[long[0].lstrip("-")] = action
    return out


def read(path: str | Path) -> dict[str, Any]:
    """The TOML table in ``path``; a :class:`GradzipError` naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise GradzipError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise GradzipError(f"--config {path}: not valid TOML ({exc}); write one KEY = VALUE per line, "
                           "e.g. batch-size = 64") from None


def _convert(path, key: str, value: Any, action: argparse.Action) -> Any:
    """``value`` from the file, checked as the flag ``--key`` checks its argument."""
    where = f"--config {path}: {key} = {value!r}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise GradzipError(f"{where}: expected true or false")
        return value
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    if isinstance(value, (dict, bool)) and action.type is None:
        raise GradzipError(f"{where}: expected a string")
    if isinstance(value, (dict, list)):
        raise GradzipError(f"{where}: expected a single value")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise GradzipError(f"{where}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        raise GradzipError(f"{where}: expected one of {', '.join(map(str, action.choices))}")
    return converted


def apply(parser: argparse.ArgumentParser, path: str | Path, command: str) -> None:
    """Make the settings in ``path`` the defaults of ``parser`` (the ``command``'s
    subparser), so that flags given on the command line override them."""
    table = read(path)
    written_for = table.pop("command", command)
    if written_for != command:
        raise GradzipError(f"--config {path} was written for gradzip {written_for}, not {command}; run "
                           f"gradzip {written_for} --config {path}, or change its command line")
    actions = _settings(parser)
    unknown = sorted(set(table) - set(actions))
    if unknown:
        raise GradzipError(f"--config {path}: gradzip {command} has no setting {', '.join(unknown)}; a key is a "
                           f"flag without its dashes (see gradzip {command} --help)")
    parser.set_defaults(**{actions[k].dest: _convert(path, k, v, actions[k]) for k, v in table.items()})


def effective(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as a config table: every flag with a value (unset ones, None, are
    left out and keep their defaults)."""
    table: dict[str, Any] = {"command": args.command}
    for key, action in sorted(_settings(parser).items()):
        value = getattr(args, action.dest, None)
        if value is not None:
            table[key] = value
    return table


def write(path: str | Path, table: dict[str, Any]) -> Path:
    """``table`` as TOML at ``path`` (written atomically)."""
    path = Path(path)
    try:
        write_text(path, "# gradzip settings: repeat this run with  gradzip "
                        f"{table['command']} --config {path}\n" + tomli_w.dumps(table))
    except OSError as exc:
        raise GradzipError(f"cannot write {path} ({exc.strerror or exc}); give --out a writable directory") from None
    return path
