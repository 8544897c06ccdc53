"""Bad input everywhere it enters: codec spec strings, method options, worker counts, CLI
flags and dataset files. Every bad value either builds something that works or raises
:class:`GradzipError` with a readable one-line message that names what is wrong; nothing
escapes as a raw ``TypeError`` / ``KeyError`` / ``OverflowError`` or a traceback at the CLI.

Property tests (hypothesis) throw random spec strings, option values and argv lists at the
parsers; explicit cases pin every example the reliability issue names.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import io
import os
import pickle
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gradzip
from gradzip import cli
from gradzip.comm import make_group
from gradzip.compressors import build, names
from gradzip.errors import GradzipError
from gradzip.comm.launch import run_processes
from gradzip.optim import METHODS, method_options
from datafiles import idx_bytes, mnist_arrays, mnist_file_bytes, write_files
from gradzip.train import datasets as data


def fast(examples: int):
    """Hypothesis settings that keep this module quick (about 10 s on two cores)."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


NAN, INF = float("nan"), float("inf")


def assert_readable(message: str, *mentions: str) -> None:
    """A message a person can act on: not empty, one line, no traceback, and naming (case
    insensitively) at least one of ``mentions`` when any are given."""
    text = message.strip()
    assert text, "empty error message"
    assert "\n" not in text, f"multi-line message: {message!r}"
    assert "Traceback" not in text, message
    if mentions:
        low = text.lower()
        assert any(m.lower() in low for m in mentions), f"{message!r} names none of {mentions}"


# ============================================================================ codec specs

SHAPES = [(), (0,), (1,), (7,), (3, 4), (5, 0), (2, 0, 3), (2, 3, 4), (1, 1)]


def exercise_codec(codec) -> None:
    """Compress / decompress / aggregate (and sum, where packets sum) a few small tensors,
    0-d, empty and 1-element ones included: a codec that builds must work on them."""
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        t = torch.randn(shape, generator=gen)
        a, b = codec.compress(t, seed=3), codec.compress(-t, seed=3)
        assert codec.decompress(a).shape == t.shape
        assert codec.aggregate([a, b]).shape == t.shape
        if codec.sum_dtype(2) is not None:
            assert codec.from_sum(codec.summand(a, 2) + codec.summand(b, 2), a, 2).shape == t.shape
        codec.wire_nbytes(shape)


def field_names(name: str) -> list[str]:
    cls = type(build(name))
    return [f.name[:-1] if f.name.endswith("_") else f.name for f in dataclasses.fields(cls)]


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-(2**70), 2**70).map(str),
    st.integers(-3, 300).map(str),
    st.sampled_from(["0", "1", "2", "3", "127", "128", "1e-300", "5e-324", "1e300", "0.5", "1.0", "-0",
                     "nan", "inf", "-inf", "1_0", "0x10", "9223372036854775808", "2147483648"]),
)
JUNK = st.sampled_from(["", " ", "x", "true", "false", "yes", "maybe", "None", "=", ",", ":", "1,2", "½"])
VALUE = st.one_of(NUMBERS, JUNK, st.text(max_size=6))


@st.composite
def structured_specs(draw):
    name = draw(st.sampled_from(names()))
    keys = field_names(name) + ["ratio", "k", "in_", "bogus", ""]
    params = draw(st.lists(st.tuples(st.sampled_from(keys), VALUE), max_size=3))
    items = [f"{k}={v}" for k, v in params]
    name = draw(st.sampled_from([name, name.upper(), f" {name} "]))
    return name + (":" + ",".join(items) if items else "")


def check_spec(spec: str) -> None:
    try:
        codec = build(spec)
    except GradzipError as exc:
        event("GradzipError")
        assert_readable(str(exc), "compressor", spec.strip().partition(":")[0].strip(), "parameter")
        return
    event("built")
    assert build(codec.spec) == codec
    exercise_codec(codec)


@fast(300)
@given(st.one_of(st.text(max_size=30),
                 st.builds("{}:{}".format, st.sampled_from(names()), st.text(max_size=20))))
def test_random_text_spec_builds_or_raises_gradzip_error(spec):
    check_spec(spec)


@fast(300)
@given(structured_specs())
def test_structured_spec_builds_or_raises_gradzip_error(spec):
    check_spec(spec)


@pytest.mark.parametrize("spec", [
    "topk:ratio=1e-300", "topk:ratio=5e-324", "topk:ratio=1", "randomk:ratio=5e-324,unbiased=true",
    "randblock:ratio=5e-324", "randblock:in=2147483648,out=2147483648,layer=2147483648",
    "dgc:ratio=5e-324", "dgc:sample_ratio=1e-300", "dgc:sample_ratio=5e-324", "dgc:ratio=1,sample_ratio=1",
    "powersgd:rank=1000000", "powersgd:rank=99999999999999999999", "powersgd:min_compression_rate=0",
    "qsgd:levels=1", "qsgd:levels=3", "qsgd:levels=7", "qsgd:levels=127",
    "2bit:threshold=5e-324", "2bit:threshold=1e308",
])
def test_extreme_but_valid_codecs_work_on_small_tensors(spec):
    exercise_codec(build(spec))


def test_dgc_tiny_sample_ratio_on_a_large_tensor_selects_exactly():
    codec = build("dgc:ratio=0.01,sample_ratio=1e-300")
    t = torch.randn(5000)
    packet = codec.compress(t, seed=1)
    assert packet.meta["selected"] == 50
    assert torch.equal(codec.decompress(packet).ne(0).nonzero().view(-1).sort().values,
                       t.abs().topk(50).indices.sort().values)


@pytest.mark.parametrize("spec, words", [
    ("topk:ratio=2", ["topk", "ratio", "(0, 1]"]),
    ("topk:ratio=0", ["ratio"]),
    ("topk:ratio=nan", ["ratio", "nan"]),
    ("topk:ratio=inf", ["ratio"]),
    ("randomk:ratio=-1", ["ratio"]),
    ("dgc:sample_ratio=0", ["sample_ratio"]),
    ("powersgd:rank=0", ["rank", ">= 1"]),
    ("powersgd:rank=-3", ["rank"]),
    ("powersgd:min_compression_rate=nan", ["min_compression_rate"]),
    ("qsgd:levels=0", ["levels", "[1, 127]"]),
    ("qsgd:levels=1000", ["levels"]),
    ("2bit:threshold=0", ["threshold"]),
    ("2bit:threshold=nan", ["threshold"]),
    ("randblock:in=0", ["in", ">= 1"]),
    ("randblock:layer=99999999999999999999999", ["layer", "2**31"]),
    ("randblock:in=4,ratio=0.1", ["either"]),
    ("zip", ["unknown compressor", "valid names"]),
    ("", ["unknown compressor"]),
    ("topk:ratio", ["param=value"]),
    ("topk:k=0", ["no parameter 'k'"]),
])
def test_bad_spec_messages(spec, words):
    with pytest.raises(GradzipError) as exc:
        build(spec)
    assert_readable(str(exc.value))
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


# ============================================================================ method options


def tiny_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]


INTS = st.one_of(st.integers(-5, 40), st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 1, 2**31, 2**63]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1),
                   st.sampled_from([0.0, -1.0, 1.0, 1e-300, 5e-324, 2.0, 16.0, 1e300, 2.0**30, 2.0**30 + 1]))
SPECS = st.one_of(st.sampled_from(["auto", "none", "zero", "zip", "", "@@", "topk:ratio=2", "topk:ratio=0.5",
                                   "randblock:in=0", "randblock:in=4", "2bit", "qsgd:levels=3", "sign"]),
                  structured_specs())
WRONG = st.sampled_from([None, "0.5", "x", True, False, [1], 1.5, -1, float("nan")])
BY_TYPE = {int: INTS, float: FLOATS, str: SPECS, bool: st.booleans()}


@st.composite
def method_and_options(draw):
    algo = draw(st.sampled_from(sorted(METHODS)))
    options = method_options(METHODS[algo])
    chosen = draw(st.lists(st.sampled_from(sorted(options)), unique=True, max_size=len(options))) if options else []
    values = {name: draw(st.one_of(BY_TYPE[options[name]], WRONG)) for name in chosen}
    return algo, values


def sane_for_a_step(options: dict) -> bool:
    """Values whose use in a float32 update cannot overflow (an lr of 1e300 is not a bug of
    the option parser): a step is taken only then."""
    return all(not isinstance(v, float) or abs(v) <= 1e6 for v in options.values())


def mentions_for(options: dict) -> list[str]:
    """What an error about ``options`` may name: an option, or the codec of a spec value."""
    out = list(options) + ["compressor"]
    for v in options.values():
        if isinstance(v, str):
            out.append(v.strip().partition(":")[0].strip() or "compressor")
    return out


def run_one_step(opt) -> None:
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()


@fast(300)
@given(method_and_options())
def test_random_method_options_build_or_raise_gradzip_error(case):
    algo, options = case
    try:
        opt = METHODS[algo](tiny_params(), lr=0.1, **options)
    except GradzipError as exc:
        event("GradzipError")
        assert_readable(str(exc), *mentions_for(options))
        return
    event("built")
    if sane_for_a_step(options):
        run_one_step(opt)   # what built must also run


@fast(120)
@given(algo=st.sampled_from(sorted(METHODS)),
       lr=st.one_of(FLOATS, st.integers(-3, 3)), momentum=st.one_of(FLOATS, st.just(0.9)),
       weight_decay=st.one_of(FLOATS, st.just(1e-4)), nesterov=st.booleans())
def test_random_common_options_build_or_raise_gradzip_error(algo, lr, momentum, weight_decay, nesterov):
    options = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    try:
        METHODS[algo](tiny_params(), **options)
    except GradzipError as exc:
        assert_readable(str(exc), *options)


# Every example the issue names, for every method that takes the option.
NAMED = [
    ("lr", -1.0), ("lr", NAN), ("lr", -INF), ("momentum", -0.1), ("momentum", 1.0), ("momentum", NAN),
    ("weight_decay", -1.0), ("weight_decay", NAN),
    ("H", 0), ("H", -4), ("H", 2.5), ("k", 0), ("k", -1), ("rank", 0), ("rank", -2), ("rank", 1.5),
    ("ratio", 0.0), ("ratio", 1.5), ("ratio", -0.1), ("ratio", NAN), ("ratio", INF),
    ("sample_ratio", 0.0), ("sample_ratio", 2.0), ("rc", 0.5), ("rc", NAN), ("rc", INF), ("rc", 1e300),
    ("threshold", 0.0), ("threshold", -1.0), ("threshold", NAN), ("threshold", INF), ("threshold", "0.5"),
    ("local_lr", -1.0), ("local_lr", NAN), ("local_lr", INF), ("local_lr", "0.1"),
    ("warmup_steps", -1), ("lr_warmup_steps", -1), ("start_iter", -1), ("clip_norm", -1.0), ("clip_norm", NAN),
    ("min_compression_rate", -1.0), ("min_compression_rate", NAN),
    ("orthogonalization_epsilon", -1.0), ("orthogonalization_epsilon", NAN), ("orthogonalization_epsilon", "x"),
    ("overlap", "no"), ("warm_start", "no"), ("use_error_feedback", None),
    ("compressor", "zip"), ("compressor", "topk:ratio=2"), ("compressor", 3), ("c1", "@@"), ("c2", "qsgd:levels=0"),
]
NAMED_CASES = [pytest.param(algo, key, value, id=f"{algo}-{key}={value!r}")
               for key, value in NAMED for algo, cls in sorted(METHODS.items())
               if key in ("lr", "momentum", "weight_decay") or key in method_options(cls)]


@pytest.mark.parametrize("algo, key, value", NAMED_CASES)
def test_named_bad_option_raises_gradzip_error_naming_it(algo, key, value):
    kwargs = {"lr": 0.1, key: value}
    with pytest.raises(GradzipError) as exc:
        METHODS[algo](tiny_params(), **kwargs)
    assert_readable(str(exc.value), *mentions_for({key: value}))


@pytest.mark.parametrize("algo", sorted(METHODS))
def test_nan_never_slips_through_a_range_check(algo):
    """``nan >= 0`` is False but ``not (nan < 0)`` is True: every float option of every
    method must refuse NaN (none of them has a meaning for it)."""
    for key, kind in method_options(METHODS[algo]).items():
        if kind is float:
            with pytest.raises(GradzipError, match=key):
                METHODS[algo](tiny_params(), lr=0.1, **{key: NAN})


# -- common options (optim/base.py) ------------------------------------------------------------

@pytest.mark.parametrize("key, value", [
    ("lr", INF), ("weight_decay", INF), ("weight_decay", "x"), ("weight_decay", None),
    ("momentum", "0.9"), ("momentum", None),
    ("seed", "x"), ("seed", None), ("seed", NAN), ("seed", 1.5),
    ("bucket_bytes", INF), ("bucket_bytes", None), ("bucket_bytes", "x"), ("bucket_bytes", 1.5),
    ("bucket_bytes", True),
])
def test_common_option_of_the_wrong_type_raises_gradzip_error(key, value):
    with pytest.raises(GradzipError) as exc:
        METHODS["ssgd"](tiny_params(), **{"lr": 0.1, key: value})
    assert_readable(str(exc.value), key)


@pytest.mark.parametrize("algo", sorted(METHODS))
@pytest.mark.parametrize("comm", ["gloo", 2, object()])
def test_comm_of_the_wrong_type_is_one_line_for_every_method(algo, comm):
    """Issue 35 item 12: ``comm=`` of another type was a raw AttributeError; the shared
    constructor (``gradzip.comm.resolve``) names it and what to pass."""
    with pytest.raises(GradzipError) as exc:
        METHODS[algo](tiny_params(), lr=0.1, comm=comm)
    assert_readable(str(exc.value), "comm must be a gradzip.comm.Group")


@pytest.mark.parametrize("call", [lambda: gradzip.broadcast_parameters(torch.nn.Linear(2, 2), comm="gloo"),
                                  lambda: gradzip.optim.evaluation.evaluation_model(torch.nn.Linear(2, 2), comm="gloo")])
def test_comm_of_the_wrong_type_is_one_line_for_the_functions_taking_one(call):
    with pytest.raises(GradzipError) as exc:
        call()
    assert_readable(str(exc.value), "comm must be a gradzip.comm.Group")


# ============================================================================ worker counts


@pytest.mark.parametrize("n", [0, -1, -3, 1.5, "2", None, True])
def test_bad_worker_count_in_process(n):
    for call in (lambda: make_group(n), lambda: gradzip.simulate(n, lambda comm: comm.rank)):
        with pytest.raises(GradzipError) as exc:
            call()
        assert_readable(str(exc.value), "workers")


@pytest.mark.parametrize("n", [0, -3, 2.0, "2", None, True])
def test_bad_worker_count_for_processes_fails_before_spawning(n):
    with pytest.raises(GradzipError) as exc:
        run_processes(n, print)
    assert_readable(str(exc.value), "worker")


@pytest.mark.parametrize("timeout", [0, -1.0, NAN, INF, 1e300, "10"])
def test_bad_thread_timeout(timeout):
    with pytest.raises(GradzipError) as exc:
        make_group(2, timeout)
    assert_readable(str(exc.value), "timeout")


def test_simulate_needs_a_callable():
    with pytest.raises(GradzipError, match="callable"):
        gradzip.simulate(2, "not a function")


def test_more_thread_workers_than_cores_is_fine():
    n = 2 * (os.cpu_count() or 1) + 3

    def fn(comm):
        t = torch.full((3,), float(comm.rank))
        comm.allreduce(t)
        return t

    out = gradzip.simulate(n, fn)
    assert len(out) == n and all(torch.equal(t, torch.full((3,), n * (n - 1) / 2)) for t in out)


# ============================================================================ the CLI


def cli_outcome(argv: list[str]) -> tuple[str, str]:
    """("ok" | "exit 2" | "gradzip error", message): parse, build the configs and validate
    them as ``gradzip train/compare`` does before any worker starts (nothing trains)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli.build_parser().parse_args(argv)
            cfgs = cli.runs._configs(args)
            workers = args.workers or (4 if args.command == "compare" else 1)
            cli.runs._validate(cfgs, workers)
    except SystemExit as exc:
        assert exc.code == 2, (argv, exc.code, err.getvalue())
        return "exit 2", err.getvalue()
    except GradzipError as exc:
        return "gradzip error", str(exc)
    return "ok", ""


@functools.lru_cache(maxsize=None)
def _digits():
    return _real_load("digits")


_real_load = data.load


def _cached_load(name, data_dir=None, **kwargs):
    """``digits`` once per session (75 ms a load); everything else as it is."""
    if isinstance(name, str) and name.strip().lower() == "digits":
        return _digits()
    return _real_load(name, data_dir, **kwargs)


BIG_MODELS = {"resnet", "resnet18", "mlp10m"}
INT_TEXT = st.one_of(st.integers(-5, 10**6).map(str),
                    st.sampled_from(["0", "-3", "1.5", "1e3", "", "x", "99999999999999999999"]))
FLOAT_TEXT = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                       st.sampled_from(["nan", "inf", "-inf", "-1", "0", "0.5", "1", "", "x", " 0.1 ", "1e308", "NaN"]))
TEXT = st.text(max_size=8).filter(lambda s: not s.startswith("-"))
COMMON_FLAGS = {
    "--dataset": st.one_of(st.sampled_from(["digits", "DIGITS", "nope", "", "mnist", "fashion-mnist", "cifar10",
                                            "synthetic:n=0", "synthetic:n=64,test=16,shape=1x8x8", "synthetic:size=5",
                                            "synthetic:shape=3x32", "digits:n=5"]),
                           TEXT.filter(lambda s: not s.strip().lower().startswith("synthetic"))),
    "--data-dir": st.one_of(st.sampled_from(["/nonexistent/dir", "", ".", "/etc/passwd", "/"]), TEXT),
    "--model": st.one_of(st.sampled_from(["mlp", "logreg", "lenet", "nope", "", "mlp:hidden=0", "mlp:bogus=1",
                                          "lenet:x"]),
                         TEXT.filter(lambda s: ":" not in s and s.strip().lower() not in BIG_MODELS)),
    "--epochs": INT_TEXT, "--batch-size": INT_TEXT, "--workers": INT_TEXT, "--seed": INT_TEXT,
    "--lr": FLOAT_TEXT, "--momentum": FLOAT_TEXT, "--weight-decay": FLOAT_TEXT,
    "--eval-on": st.sampled_from(["auto", "average", "local", "x", ""]),
    "--backend": st.sampled_from(["threads", "gloo", "mpi"]),
    "--nesterov": None,
    # reliability flags (a flag the parser does not know exits 2, which passes too)
    "--nonfinite": st.sampled_from(["raise", "skip", "off", "x", ""]),
    "--timeout": FLOAT_TEXT,
    "--checkpoint-every": INT_TEXT,
    "--checkpoint-dir": st.sampled_from(["/nonexistent/gradzip-ckpt", "/etc/passwd", ""]),
}
BOOL_TEXT = st.sampled_from(["true", "false", "1", "0", "yes", "no", "maybe", "", "TRUE"])
SPEC_TEXT = st.one_of(structured_specs(), st.text(max_size=10).filter(lambda s: not s.startswith("-")))


def method_flags() -> dict:
    flags = {}
    for cls in METHODS.values():
        for name, kind in method_options(cls).items():
            flags["--" + name.replace("_", "-")] = {int: INT_TEXT, float: FLOAT_TEXT, bool: BOOL_TEXT,
                                                    str: SPEC_TEXT}[kind]
    return flags


ALL_FLAGS = {**COMMON_FLAGS, **method_flags()}
ALGOS_TEXT = st.one_of(
    st.lists(st.tuples(st.sampled_from(sorted(METHODS) + ["nope", "", "SSGD"]),
                       st.one_of(st.none(), structured_specs(), st.sampled_from(["", "@", "zip"]))),
             max_size=3).map(lambda items: ",".join(a + ("" if c is None else "@" + c) for a, c in items)),
    st.sampled_from(["ssgd,,", "@@", ",", " ", "ssgd@", "@topk", "ssgd;efsgd"]),
    TEXT,
)


@st.composite
def argvs(draw):
    command = draw(st.sampled_from(["train", "compare"]))
    argv = [command]
    if command == "train":
        argv += ["--algo", draw(st.sampled_from(sorted(METHODS) + ["nope"]))]
    elif draw(st.booleans()):
        argv += ["--algos", draw(ALGOS_TEXT)]
    for flag in draw(st.lists(st.sampled_from(sorted(ALL_FLAGS)), unique=True, max_size=5)):
        strategy = ALL_FLAGS[flag]
        argv += [flag] if strategy is None else [flag, draw(strategy)]
    if draw(st.integers(0, 9)) == 0:
        argv.append(draw(st.sampled_from(["--bogus", "stray", "--lr"])))
    return argv


@fast(300)
@given(argvs())
def test_random_argv_exits_2_with_one_line_or_validates(argv):
    with mock.patch.object(data, "load", _cached_load):
        outcome, message = cli_outcome(argv)
    event(outcome)
    if outcome != "ok":
        assert_readable(message)


# Each case is run end to end through main(); the prefix keeps it cheap should a case
# ever be accepted (the case's own flags come later, so they win).
SAFE = ["--backend", "threads", "--epochs", "1", "--quiet", "--no-plot"]
CLI_CASES = [
    (["train", "--lr", "nan"], "--lr"),
    (["train", "--lr", "inf"], "--lr"),
    (["train", "--lr", "-1"], "--lr"),
    (["train", "--lr", "1e308"], "--lr"),
    (["train", "--weight-decay", "-0.5"], "--weight-decay"),
    (["train", "--weight-decay", "nan"], "--weight-decay"),
    (["train", "--weight-decay", "inf"], "--weight-decay"),
    (["train", "--momentum", "nan"], "--momentum"),
    (["train", "--momentum", "1"], "--momentum"),
    (["train", "--epochs", "0"], "--epochs"),
    (["train", "--epochs", "-2"], "--epochs"),
    (["train", "--batch-size", "0"], "--batch-size"),
    (["train", "--workers", "0"], "--workers"),
    (["train", "--workers", "-3"], "--workers"),
    (["train", "--workers", "two"], "--workers"),
    (["train", "--compressor", "topk:ratio=2"], "ratio"),
    (["train", "--compressor", "zip"], "zip"),
    (["train", "--compressor", ""], "compressor"),
    (["compare", "--algos", "ssgd,,"], "--algos"),
    (["compare", "--algos", "@@"], "--algos"),
    (["compare", "--algos", ""], "--algos"),
    (["compare", "--algos", "ssgd@zip"], "zip"),
    (["compare", "--algos", "efsgd@topk:ratio=2"], "ratio"),
    (["train", "--dataset", "nope"], "nope"),
    (["train", "--model", "nope"], "nope"),
    (["train", "--dataset", "mnist", "--data-dir", "/nonexistent/gradzip-data"], "/nonexistent/gradzip-data"),
    (["train", "--dataset", "mnist"], "data directory"),
    (["train", "--algo", "localsgd", "--H", "abc"], "--H"),
    (["train", "--algo", "localsgd", "--H", "0"], "H"),
    (["train", "--algo", "cser", "--H", "-1"], "H"),
    (["train", "--algo", "cdsgd", "--k", "0"], "k must be"),
    (["train", "--algo", "cdsgd", "--k", "1.5"], "--k"),
    (["train", "--algo", "cdsgd", "--local-lr", "nan"], "local_lr"),
    (["train", "--algo", "cdsgd", "--local-lr", "inf"], "local_lr"),
    (["train", "--algo", "cdsgd", "--overlap", "maybe"], "--overlap"),
    (["train", "--algo", "powersgd", "--rank", "0"], "rank"),
    (["train", "--algo", "powersgd", "--warm-start", "maybe"], "--warm-start"),
    (["train", "--algo", "powersgd", "--orthogonalization-epsilon", "nan"], "orthogonalization_epsilon"),
    (["train", "--algo", "dgc", "--ratio", "1.5"], "ratio"),
    (["train", "--algo", "dgc", "--ratio", "0"], "ratio"),
    (["train", "--algo", "dgc", "--sample-ratio", "nan"], "sample_ratio"),
    (["train", "--algo", "efsgd", "--rc", "0.5"], "rc"),
    (["train", "--algo", "efsgd", "--rc", "1e300"], "rc"),
    (["train", "--algo", "bitsgd", "--threshold", "nan"], "threshold"),
    (["train", "--algo", "bitsgd", "--threshold", "inf"], "threshold"),
    (["train", "--algo", "ssgd", "--H", "4"], "H"),
    (["train", "--batch-size", "100000"], "--batch-size"),
    (["train", "--timeout", "nan"], "--timeout"),
    (["train", "--timeout", "0"], "--timeout"),
    (["train", "--bogus"], "unrecognized"),
    (["train", "--algo", "nope"], "--algo"),
]


@pytest.mark.parametrize("argv, mention", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_cli_bad_input_exits_2_with_one_line(argv, mention, capsys):
    capsys.readouterr()
    try:
        code = cli.main([argv[0], *SAFE, *argv[1:]])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    assert_readable(captured.err, mention)
    assert captured.err.startswith("gradzip"), captured.err


def test_cli_corrupt_dataset_file_is_one_line(tmp_path, capsys):
    write_files(tmp_path, mnist_file_bytes(mnist_arrays()))
    good = (tmp_path / "t10k-images-idx3-ubyte.gz").read_bytes()
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(good[: len(good) // 2])
    capsys.readouterr()
    code = cli.main(["train", *SAFE, "--dataset", "mnist", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert_readable(err, "t10k-images-idx3-ubyte.gz")


def test_cli_many_thread_workers_on_few_cores_trains(tmp_path, capsys):
    """More thread workers than cores is fine (only workers <= 0 is not)."""
    n = (os.cpu_count() or 1) + 2
    code = cli.main(["train", *SAFE, "--workers", str(n), "--batch-size", "8", "--dataset",
                     "synthetic:n=256,test=32,shape=16,classes=2", "--model", "logreg"])
    assert code == 0, capsys.readouterr().err


# ============================================================================ dataset files




def load_error(name: str, directory: Path) -> str:
    with pytest.raises(GradzipError) as exc:
        data.load(name, directory, download=False)
    assert_readable(str(exc.value))
    return str(exc.value)


def test_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in load_error("mnist", tmp_path / "file")


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10"])
def test_data_dir_that_does_not_exist(tmp_path, name):
    msg = load_error(name, tmp_path / "nope")
    assert str(tmp_path / "nope") in msg and "does not exist" in msg


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("target, corrupt, words", [
    ("train-images-idx3-ubyte", lambda b: b"", ["train-images-idx3-ubyte"]),
    ("train-images-idx3-ubyte", lambda b: b[:3], ["train-images-idx3-ubyte"]),
    ("t10k-labels-idx1-ubyte", lambda b: b[:6], ["t10k-labels-idx1-ubyte", "truncated"]),
    ("t10k-labels-idx1-ubyte", lambda b: b + b"\0\0", ["t10k-labels-idx1-ubyte", "bytes after"]),
    ("train-images-idx3-ubyte", lambda b: b"\x00\x00\x0d\x03" + b[4:], ["train-images-idx3-ubyte", "magic"]),
    ("train-images-idx3-ubyte", lambda b: b"PK\x03\x04" + b[4:], ["train-images-idx3-ubyte", "magic"]),
    ("train-labels-idx1-ubyte", lambda b: idx_bytes(2049, (12,), bytes([10] * 12)),
     ["train-labels-idx1-ubyte", "outside 0..9"]),
    ("t10k-images-idx3-ubyte", lambda b: idx_bytes(2051, (5, 14, 14), bytes(5 * 196)),
     ["test images", "do not belong together"]),
    ("t10k-images-idx3-ubyte", lambda b: idx_bytes(2051, (4, 28, 28), bytes(4 * 784)),
     ["t10k-images-idx3-ubyte", "4 images", "5 labels"]),
    ("train-images-idx3-ubyte", lambda b: idx_bytes(2051, (12, 0, 0), b""), ["train-images-idx3-ubyte", "no image"]),
    ("train-images-idx3-ubyte", lambda b: idx_bytes(2051, (0, 28, 28), b""), ["train-images-idx3-ubyte"]),
])
def test_corrupt_idx_file_names_it(tmp_path, gz, target, corrupt, words):
    files = mnist_file_bytes(mnist_arrays(), gz=False)
    files[target] = corrupt(files[target])
    if gz:
        files = {k + ".gz": gzip.compress(v, mtime=0) for k, v in files.items()}
    msg = load_error("mnist", write_files(tmp_path, files))
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("content, words", [
    (b"", ["not a gzip file"]),
    (b"\x1f\x8b", ["corrupt or truncated gzip"]),
    (b"\x1f\x8b\x08\x00" + b"\xff" * 40, ["corrupt or truncated gzip"]),
])
def test_broken_gzip_names_the_file(tmp_path, content, words):
    files = mnist_file_bytes(mnist_arrays())
    files["train-labels-idx1-ubyte.gz"] = content
    msg = load_error("mnist", write_files(tmp_path, files))
    assert "train-labels-idx1-ubyte.gz" in msg
    for w in words:
        assert w in msg


def test_gzip_with_a_bad_crc_names_the_file(tmp_path):
    files = mnist_file_bytes(mnist_arrays())
    raw = bytearray(files["train-images-idx3-ubyte.gz"])
    raw[-8] ^= 0xFF   # the CRC32 of the trailer
    files["train-images-idx3-ubyte.gz"] = bytes(raw)
    assert "train-images-idx3-ubyte.gz" in load_error("mnist", write_files(tmp_path, files))


@fast(80)
@given(stem=st.sampled_from(sorted(mnist_arrays())), gz=st.booleans(), cut=st.floats(0, 1),
       flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4))
def test_mutated_idx_files_load_or_raise_naming_a_file(tmp_path_factory, stem, gz, cut, flips):
    """Truncate and overwrite bytes of one file (of the gzip stream when gzipped)."""
    files = mnist_file_bytes(mnist_arrays(n_train=3, n_test=2), gz=gz)
    target = stem + (".gz" if gz else "")
    b = bytearray(files[target])
    for where, value in flips:
        b[min(int(where * len(b)), len(b) - 1)] = value
    files[target] = bytes(b[: int(cut * len(b))] if cut < 0.9 else b)
    directory = write_files(tmp_path_factory.mktemp("idx"), files)
    try:
        data.load("mnist", directory, download=False)
    except GradzipError as exc:
        assert_readable(str(exc), *files)


# -- CIFAR-10 batches --------------------------------------------------------------------

CIFAR_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def cifar_batch(n=2, labels=None, data_=None) -> bytes:
    rng = np.random.default_rng(0)
    batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8) if data_ is None else data_,
             b"labels": [int(v) for v in rng.integers(0, 10, n)] if labels is None else labels}
    return pickle.dumps(batch, protocol=4)


@pytest.mark.parametrize("content, words", [
    (b"", ["not a CIFAR-10 batch"]),
    (b"garbage\x00\xff" * 10, ["not a CIFAR-10 batch"]),
    (cifar_batch()[:40], ["not a CIFAR-10 batch"]),
    (pickle.dumps([1, 2, 3]), ["not a dict"]),
    (pickle.dumps({b"labels": [1]}), ["'data'"]),
    (pickle.dumps({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}), ["uint8"]),
    (pickle.dumps({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}), ["3072"]),
    (cifar_batch(labels=[0]), ["2 images but 1 labels"]),
    (cifar_batch(labels=[0, 10]), ["outside 0..9"]),
    (cifar_batch(labels=[-1, 0]), ["outside 0..9"]),
    (cifar_batch(labels="ab"), ["not integers"]),
    (cifar_batch(labels=[None, None]), ["not integers"]),
    (cifar_batch(labels={1: 2}), ["not integers"]),
    (cifar_batch(labels=[2**70, 0]), ["not integers"]),
    (cifar_batch(n=0, labels=[]), ["no images"]),
])
def test_corrupt_cifar_batch_names_the_file(tmp_path, content, words):
    files = {b: cifar_batch() for b in CIFAR_BATCHES}
    files["data_batch_3"] = content
    msg = load_error("cifar10", write_files(tmp_path / "cifar-10-batches-py", files))
    assert "data_batch_3" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_cifar_tarball_without_a_batch(tmp_path):
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        content = cifar_batch()
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(buf.getvalue())
    msg = load_error("cifar10", tmp_path)
    assert "cifar-10-python.tar.gz" in msg and "has no file" in msg


@fast(60)
@given(target=st.sampled_from(CIFAR_BATCHES), cut=st.floats(0, 1),
       flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_cifar_batches_load_or_raise_naming_the_file(tmp_path_factory, target, cut, flips):
    files = {b: cifar_batch() for b in CIFAR_BATCHES}
    b = bytearray(files[target])
    for where, value in flips:
        b[min(int(where * len(b)), len(b) - 1)] = value
    files[target] = bytes(b[: int(cut * len(b))] if cut < 0.9 else b)
    directory = write_files(tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py", files)
    try:
        data.load("cifar10", directory.parent, download=False)
    except GradzipError as exc:
        assert_readable(str(exc), target)
