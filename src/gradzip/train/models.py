"""Models for the training harness, built by name: ``build("lenet", (1, 28, 28), 10)``.

Names (``names()``), with optional ``name:key=value,...`` options:

- ``logreg``: flatten -> Linear(features, classes) (multinomial logistic regression).
- ``mlp``: flatten -> Linear(., 256) -> ReLU -> Linear(256, 128) -> ReLU -> Linear(., classes);
  ``mlp:hidden=512x512`` sets the hidden sizes (any number of layers).
- ``lenet``: LeNet-5 style: conv5x5(6, pad 2) -> ReLU -> maxpool2 -> conv5x5(16, pad 2) -> ReLU
  -> maxpool2 -> FC 120 -> ReLU -> FC 84 -> ReLU -> FC classes. Needs (C, H, W) input with
  H, W >= 4 (1x8x8 digits, 1x28x28 MNIST, 3x32x32 CIFAR-10).
- ``resnet``: the CIFAR ResNet of He et al. (2016), depth 6n+2 (default 20: three stages of
  16/32/64 channels, global average pooling). Options ``depth=`` (20, 32, 44, 56, ...),
  ``width=`` (first stage's channels, default 16), ``norm=bn|gn|none`` (default ``bn``:
  BatchNorm, whose running statistics are buffers, local to each worker; ``gn`` is
  GroupNorm, which has none).
- ``resnet18``: ResNet-18 (He et al. 2016; the CIFAR variant: 3x3 stem, no max-pool), four
  stages of two basic blocks with 64/128/256/512 channels, 11.2M parameters at 10 classes:
  ImageNet-sized communication at small resolution (benchmarks). Options ``width=`` (first
  stage's channels, default 64; parameters scale with its square) and ``norm=bn|gn|none``.
- ``transformer``: a small pre-LayerNorm transformer encoder over token ids (the
  ``modadd`` task): inputs ``(N, T)`` of token ids in ``[0, num_classes)`` (tokens and
  classes share one vocabulary; float ids are rounded), learned token and position
  embeddings, a learned query token appended, ``layers`` encoder layers (``heads`` heads,
  feed-forward 4·``d``, GELU, no dropout), LayerNorm, and a linear head on the query token.
  Options ``layers=2,d=64,heads=4`` (the defaults).
- ``gpt``: a GPT-2-style decoder for language modelling (the ``text`` dataset): inputs
  ``(N, T)`` of token ids in ``[0, num_classes)`` (the vocabulary: 256 bytes for ``text``),
  learned token and position embeddings, ``layers`` pre-LayerNorm blocks (causal
  self-attention with ``heads`` heads, then a feed-forward 4·``d`` with GELU; no dropout), a
  final LayerNorm and the logits from the token embedding matrix (tied weights). The output
  is ``(N, vocab, T)``: a class per position in the layout ``F.cross_entropy`` takes with
  targets ``(N, T)``, so the harness's loss, accuracy and evaluation apply unchanged.
  Options ``layers=4,d=128,heads=4,context=auto`` (``context``: the position table's length,
  at least the input's ``T``; ``auto``: ``T``). See :class:`GPT`.
- ``mlp10m``: flatten -> two hidden layers of equal width -> classes, the width chosen so
  the model has about 10M parameters whatever the input (width 2048 at 3x32x32); option
  ``params=`` sets another target (e.g. ``mlp10m:params=2000000``).

Initialization is a function of ``seed`` alone: the same seed gives bitwise-identical
parameters, and building a model leaves the global RNG state untouched. A new model is a
builder function under the :func:`register` decorator.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import specs
from ..errors import GradzipError
from ..validation import is_int

__all__ = ["names", "build", "check_fits", "MLP", "LeNet", "ResNet", "ResNet18", "TinyTransformer", "GPT"]

_GLOBAL_RNG_LOCK = threading.Lock()


# ----------------------------------------------------------------------------- modules


class MLP(nn.Sequential):
    """Flatten, then Linear + ReLU for each hidden size, then a Linear classifier."""

    def __init__(self, in_features: int, hidden: tuple, num_classes: int):
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


class LeNet(nn.Module):
    """LeNet-5 style network; the flattened feature size comes from a dry-run forward."""

    def __init__(self, input_shape: tuple, num_classes: int):
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 6, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, c, h, w)).shape[1]
        self.classifier = nn.Sequential(
            nn.Linear(flat, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _norm_layer(kind: str, channels: int) -> nn.Module:
    if kind == "bn":
        return nn.BatchNorm2d(channels)
    if kind == "gn":
        return nn.GroupNorm(math.gcd(8, channels), channels)
    return nn.Identity()


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=bias)
        self.norm1 = _norm_layer(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=bias)
        self.norm2 = _norm_layer(norm, cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:  # projection shortcut (option B)
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=bias),
                                          _norm_layer(norm, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class _ResNetBase(nn.Module):
    """What both ResNets share: stem -> stages -> global average pooling -> linear head,
    with Kaiming-normal convolutions."""

    def _finish(self, stages: list, channels: int, num_classes: int) -> None:
        """Set the stages and the head (after the stem), then initialise the convolutions."""
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(channels, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


class ResNet(_ResNetBase):
    """CIFAR-style ResNet (depth 6n+2): a 3x3 stem, three stages of n basic blocks."""

    def __init__(self, input_shape: tuple, num_classes: int, depth: int = 20,
                 width: int = 16, norm: str = "bn"):
        super().__init__()
        blocks = (depth - 2) // 6
        c = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, width, 3, padding=1, bias=norm == "none"),
                                  _norm_layer(norm, width), nn.ReLU())
        stages, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                stages.append(_BasicBlock(cin, cout, stride, norm))
                cin = cout
        self._finish(stages, cin, num_classes)


class ResNet18(_ResNetBase):
    """ResNet-18, CIFAR variant: a 3x3 stem (no max-pool), four stages of two basic blocks
    (``width``, 2, 4, 8 × ``width`` channels; strides 1, 2, 2, 2), global average pooling."""

    def __init__(self, input_shape: tuple, num_classes: int, width: int = 64, norm: str = "bn"):
        super().__init__()
        c = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, width, 3, padding=1, bias=norm == "none"),
                                  _norm_layer(norm, width), nn.ReLU())
        stages, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            for j in range(2):
                stages.append(_BasicBlock(cin, width * mult, 2 if (i > 0 and j == 0) else 1, norm))
                cin = width * mult
        self._finish(stages, cin, num_classes)


class TinyTransformer(nn.Module):
    """A pre-LN transformer encoder over ``length`` token ids (see the module docstring)."""

    def __init__(self, length: int, vocab: int, layers: int = 2, d: int = 64, heads: int = 4):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d)
        self.query = nn.Parameter(torch.randn(d) * 0.02)
        self.position = nn.Parameter(torch.randn(length + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.round().long().clamp_(0, self.vocab - 1))
        h = torch.cat([tokens, self.query.expand(len(x), 1, -1)], dim=1) + self.position
        return self.head(self.norm(self.encoder(h)[:, -1]))


class _DecoderBlock(nn.Module):
    """One pre-LN decoder block: ``h + attn(LN(h))``, then ``h + mlp(LN(h))``."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(n, t, d))
        return h + self.mlp(self.norm2(h))


class GPT(nn.Module):
    """A GPT-2-style decoder (Radford et al. 2019): token + position embeddings, ``layers``
    pre-LN blocks of causal self-attention and a 4·``d`` GELU feed-forward, a final LayerNorm,
    logits by the token embedding matrix (tied). GPT-2's initialisation: weights normal(0,
    0.02), the residual projections' (attention output, feed-forward output) 0.02/√(2·layers),
    biases 0, LayerNorms 1 and 0. ``forward`` maps ``(N, T)`` ids (integers, or floats that
    hold integers) to logits ``(N, vocab, T)`` (module docstring)."""

    def __init__(self, vocab: int, context: int, layers: int = 4, d: int = 128, heads: int = 4):
        super().__init__()
        self.vocab, self.context = vocab, context
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_DecoderBlock(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                residual = name.endswith("proj.weight") or name.endswith("mlp.2.weight")
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x.long()) + self.position.weight[:t]
        for block in self.blocks:
            h = block(h)
        return (self.norm(h) @ self.embed.weight.t()).transpose(1, 2)


def mlp_width_for(params: int, features: int, num_classes: int) -> int:
    """Hidden width ``h`` (a multiple of 64, at least 64) of a two-hidden-layer MLP with
    about ``params`` parameters: ``h² + h(features + classes + 2) + classes ≈ params``."""
    b = features + num_classes + 2
    h = (-b + math.sqrt(b * b + 4 * max(params - num_classes, 0))) / 2
    return max(64, int(round(h / 64)) * 64)


# ----------------------------------------------------------------------------- options


def _int_option(name: str, key: str, value: str, low: int) -> int:
    try:
        v = int(value)
    except ValueError:
        v = low - 1
    if v < low:
        raise GradzipError(f"model {name!r} option {key} must be an integer >= {low}, "
                           f"got {value!r}.")
    return v


def _attention_options(name: str, opts: dict) -> dict:
    """A transformer's ``layers``, width ``d`` and ``heads`` (``d`` a multiple of ``heads``)."""
    sizes = {key: _int_option(name, key, opts[key], 1) for key in ("layers", "d", "heads")}
    if sizes["d"] % sizes["heads"]:
        raise GradzipError(f"model {name!r} option d must be a multiple of heads, got d={sizes['d']}, "
                           f"heads={sizes['heads']}.")
    return sizes


def _norm_option(name: str, opts: dict) -> str:
    norm = opts["norm"].lower()
    if norm not in ("bn", "gn", "none"):
        raise GradzipError(f"model {name!r} option norm must be bn, gn or none, got {norm!r}.")
    return norm


def _check_shape(input_shape) -> tuple:
    try:
        shape = tuple(int(s) for s in input_shape)
        ok = len(shape) >= 1 and min(shape) >= 1 and all(
            not isinstance(s, bool) and int(s) == s for s in input_shape)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise GradzipError(f"input_shape must be a tuple of positive sizes such as (1, 28, 28) "
                           f"or (784,), got {input_shape!r}.")
    return shape


def _need_image(name: str, shape: tuple, min_side: int) -> None:
    if len(shape) != 3 or shape[1] < min_side or shape[2] < min_side:
        raise GradzipError(f"model {name!r} needs image input (C, H, W) with H and W at least "
                           f"{min_side}, got input_shape {shape}; use 'mlp' or 'logreg' for "
                           f"this data.")


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class _Entry:
    """How to build one model name: ``make(opts, shape, num_classes)``, where ``opts`` holds
    every option of ``options`` (key -> default, also the example shown in errors) as a
    string, given or default."""

    make: Callable[[dict, tuple, int], nn.Module]
    options: dict


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, **options: str):
    """Decorator: make ``make(opts, shape, num_classes) -> nn.Module`` buildable by
    :func:`build` as ``name`` (lower-case), taking the spec options ``options`` (key ->
    default string; every key is in ``opts``, given or default)::

        @register("wide", width="1024")
        def _wide(opts, shape, num_classes): ...
    """
    if not specs.is_name(name):
        raise GradzipError(f"model name must be a lower-case name without ':' or ',', got "
                           f"{name!r}; register it as e.g. 'mymodel'.")
    if name in _REGISTRY:
        raise GradzipError(f"model name {name!r} registered twice; pick another name.")

    def add(make):
        _REGISTRY[name] = _Entry(make, options)
        return make
    return add


def names() -> list[str]:
    """The model names :func:`build` accepts."""
    return list(_REGISTRY)


@register("logreg")
def _logreg(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    return MLP(math.prod(shape), (), num_classes)


@register("mlp", hidden="256x128")
def _mlp(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    try:
        hidden = tuple(int(h) for h in opts["hidden"].lower().split("x"))
    except ValueError:
        hidden = ()
    if not hidden or min(hidden) < 1:
        raise GradzipError(f"model 'mlp' option hidden must be layer sizes joined by "
                           f"'x' (e.g. hidden=512x512), got {opts['hidden']!r}; use "
                           f"'logreg' for no hidden layer.")
    return MLP(math.prod(shape), hidden, num_classes)


@register("lenet")
def _lenet(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    _need_image("lenet", shape, 4)
    return LeNet(shape, num_classes)


@register("resnet", depth="20", width="16", norm="bn")
def _resnet(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    _need_image("resnet", shape, 1)
    depth = _int_option("resnet", "depth", opts["depth"], 8)
    if (depth - 2) % 6:
        raise GradzipError(f"model 'resnet' depth must be 6n+2 (20, 32, 44, 56, 110), "
                           f"got {depth}.")
    width = _int_option("resnet", "width", opts["width"], 1)
    return ResNet(shape, num_classes, depth=depth, width=width, norm=_norm_option("resnet", opts))


@register("resnet18", width="64", norm="bn")
def _resnet18(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    _need_image("resnet18", shape, 1)
    width = _int_option("resnet18", "width", opts["width"], 1)
    return ResNet18(shape, num_classes, width=width, norm=_norm_option("resnet18", opts))


@register("transformer", layers="2", d="64", heads="4")
def _transformer(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    if len(shape) != 1:
        raise GradzipError(f"model 'transformer' needs token sequences (N, T) as input, got input_shape "
                           f"{shape}; use it with a sequence dataset such as 'modadd'.")
    return TinyTransformer(shape[0], num_classes, **_attention_options("transformer", opts))


@register("gpt", layers="4", d="128", heads="4", context="auto")
def _gpt(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    if len(shape) != 1:
        raise GradzipError(f"model 'gpt' needs token sequences (N, T) as input, got input_shape {shape}; use it "
                           f"with a language-modelling dataset such as 'text'.")
    sizes = _attention_options("gpt", opts)
    context = shape[0] if opts["context"] == "auto" else _int_option("gpt", "context", opts["context"], 1)
    if context < shape[0]:
        raise GradzipError(f"model 'gpt' option context={context} is shorter than the dataset's sequences "
                           f"({shape[0]} tokens); raise it or leave it at auto.")
    return GPT(num_classes, context, **sizes)


@register("mlp10m", params="10000000")
def _mlp10m(opts: dict, shape: tuple, num_classes: int) -> nn.Module:
    target = _int_option("mlp10m", "params", opts["params"], 1000)
    width = mlp_width_for(target, math.prod(shape), num_classes)
    return MLP(math.prod(shape), (width, width), num_classes)


# ----------------------------------------------------------------------------- build


def _parse_options(name: str, options: list[specs.Option], valid: dict) -> dict:
    """A spec's options -> dict, checking keys against ``valid`` (key -> example)."""
    out = {}
    for opt in options:
        if not opt.has_value or opt.key not in valid:
            if not valid:
                raise GradzipError(f"model {name!r} takes no options (got {opt.item!r}); "
                                   f"use just {name!r}.")
            examples = ", ".join(f"{k}={v}" for k, v in valid.items())
            raise GradzipError(f"bad option {opt.item!r} for model {name!r}; valid options: "
                               f"{examples}.")
        out[opt.key] = opt.value
    return out


def check_fits(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, dataset: str) -> None:
    """A :class:`GradzipError` naming the mismatch when ``model`` (built as ``name``) cannot
    train on samples ``x`` with targets ``y`` of ``dataset``: it cannot read the inputs, or
    it predicts a class per sample where the targets are one per position (a language
    model's) or the other way round. One forward pass of ``x`` (a sample or two) in eval
    mode, without gradients; the model is left as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise GradzipError(f"model {name!r} cannot read the inputs of dataset {dataset!r} (input shape "
                           f"{tuple(x.shape[1:])}, {x.dtype}: {' '.join(str(exc).split())[:200]}); pick a model "
                           f"for this data (e.g. 'gpt' for 'text', 'mlp' for images and features).") from None
    finally:
        model.train(was_training)
    if out.dim() == y.dim() + 1 and tuple(out.shape[2:]) == tuple(y.shape[1:]):
        return
    per_position = out.dim() > 2
    raise GradzipError(
        f"model {name!r} predicts {'a class per position' if per_position else 'one class per sample'} (output "
        f"{tuple(out.shape[1:])} per sample) but dataset {dataset!r} has "
        f"{'one label per sample' if y.dim() == 1 else f'targets of shape {tuple(y.shape[1:])} per sample'}; use "
        f"{'a language-modelling dataset such as text' if per_position else 'the gpt model'} with it.")


def build(name: str, input_shape: tuple, num_classes: int, *, seed: int = 0) -> nn.Module:
    """Build model ``name`` (``names()``, optionally ``name:key=value,...``) on the CPU.

    Parameters are initialized from ``seed`` only (bitwise-reproducible) and the global
    RNG state is left as it was.
    """
    if not isinstance(name, str) or not name.strip():
        raise GradzipError(f"model name must be a non-empty string, got {name!r}; valid "
                           f"names: {', '.join(_REGISTRY)}.")
    base, _, options = specs.split(name)
    if base not in _REGISTRY:
        raise GradzipError(f"unknown model {name!r}; valid names: {', '.join(_REGISTRY)}.")
    entry = _REGISTRY[base]
    opts = _parse_options(base, options, entry.options)
    shape = _check_shape(input_shape)
    if not is_int(num_classes) or num_classes < 2:
        raise GradzipError(f"num_classes must be an integer >= 2, got {num_classes!r}.")
    if not is_int(seed):
        raise GradzipError(f"seed must be an integer, got {seed!r}.")
    # fork only the CPU generator: modules are built on the CPU, and seeding through
    # torch.manual_seed would also reseed (and not restore) the CUDA generators. The lock:
    # workers on threads (gradzip.simulate) share the global generator.
    with _GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed & ((1 << 64) - 1))
        return entry.make({**entry.options, **opts}, shape, num_classes)
