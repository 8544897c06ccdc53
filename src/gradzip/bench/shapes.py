"""Parameter shapes of the models the timeline model is fed: torchvision's ResNet-50
written out (no torchvision needed) and any harness model (``gradzip.train.models``)."""
from __future__ import annotations

from typing import Sequence

from ..train import models


def resnet50_shapes(num_classes: int = 1000) -> list[tuple[int, ...]]:
    """The parameter tensors of torchvision's ResNet-50 (25,557,032 parameters at 1000
    classes): 7x7 stem, bottleneck stages of 3/4/6/3 blocks, batch-norm weights and biases."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            shapes += [(width, cin, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return shapes + [(num_classes, 2048), (num_classes,)]


def model_shapes(model: str, input_shape: Sequence[int], classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of a harness model (``gradzip.train.models``), or ``resnet50``."""
    if model == "resnet50":
        return resnet50_shapes()
    return [tuple(p.shape) for p in models.build(model, tuple(input_shape), classes).parameters()]
