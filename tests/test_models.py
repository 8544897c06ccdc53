"""Models: shapes on every dataset's input shape, deterministic seeded init, errors."""

import pytest
import torch
from torch import nn

from gradzip.errors import GradzipError
from gradzip.train import models

IMAGE_SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]  # digits, (fashion-)mnist, cifar10
FLAT = (784,)  # synthetic with shape=784


def test_names():
    assert models.names()[:3] == ["logreg", "mlp", "lenet"]
    assert "resnet" in models.names()


@pytest.mark.parametrize("shape", IMAGE_SHAPES + [FLAT])
@pytest.mark.parametrize("name", ["logreg", "mlp", "mlp:hidden=32x16x8", "lenet",
                                  "resnet:depth=8", "resnet:depth=8,norm=gn,width=8"])
def test_output_shape(name, shape):
    if len(shape) != 3 and name.split(":")[0] in ("lenet", "resnet"):
        with pytest.raises(GradzipError, match="needs image input"):
            models.build(name, shape, 10)
        return
    model = models.build(name, shape, 7, seed=1)
    out = model(torch.randn(3, *shape))
    assert out.shape == (3, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_resnet20_on_cifar_shape():
    model = models.build("resnet", (3, 32, 32), 10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    n_params = sum(p.numel() for p in model.parameters())
    assert 250_000 < n_params < 300_000  # ResNet-20 has about 0.27M parameters


def test_mlp_architecture():
    model = models.build("mlp", (1, 28, 28), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 256), (256, 128),
                                                                  (128, 10)]
    custom = models.build("mlp:hidden=512x512", (3, 32, 32), 10)
    linears = [m for m in custom.modules() if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [512, 512, 10]
    logreg = models.build("logreg", (1, 8, 8), 10)
    assert [type(m) for m in logreg] == [nn.Flatten, nn.Linear]


@pytest.mark.parametrize("shape, flat", [((1, 8, 8), 16 * 2 * 2), ((1, 28, 28), 16 * 7 * 7),
                                         ((3, 32, 32), 16 * 8 * 8)])
def test_lenet_architecture(shape, flat):
    model = models.build("lenet", shape, 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (shape[0], 6, (5, 5), (2, 2)), (6, 16, (5, 5), (2, 2))]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(flat, 120), (120, 84),
                                                                  (84, 10)]


@pytest.mark.parametrize("name", ["logreg", "mlp", "lenet", "resnet:depth=8"])
def test_deterministic_init(name):
    a = models.build(name, (1, 28, 28), 10, seed=3)
    torch.randn(100)  # moving the global RNG changes nothing
    b = models.build(name, (1, 28, 28), 10, seed=3)
    c = models.build(name, (1, 28, 28), 10, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    weights = [k for k in sa if k.endswith("weight") and sa[k].dim() > 1]
    assert weights and all(not torch.equal(sa[k], sc[k]) for k in weights)


def test_build_leaves_global_rng_alone():
    state = torch.get_rng_state()
    models.build("lenet", (1, 28, 28), 10, seed=11)
    assert torch.equal(state, torch.get_rng_state())


def test_unknown_model_lists_names():
    with pytest.raises(GradzipError, match="unknown model 'vgg16'") as e:
        models.build("vgg16", (1, 28, 28), 10)
    for name in models.names():
        assert name in str(e.value)


@pytest.mark.parametrize("name, shape, classes, match", [
    ("mlp:hidden=abc", (1, 8, 8), 10, "hidden must be layer sizes"),
    ("mlp:width=3", (1, 8, 8), 10, "bad option 'width=3' for model 'mlp'"),
    ("lenet:x=1", (1, 8, 8), 10, "takes no options"),
    ("resnet:depth=21", (3, 32, 32), 10, "depth must be 6n\\+2"),
    ("resnet:norm=ln", (3, 32, 32), 10, "norm must be bn, gn or none"),
    ("lenet", (1, 3, 3), 10, "needs image input"),
    ("mlp", (0, 8), 10, "input_shape must be"),
    ("mlp", (1, 8, 8), 1, "num_classes must be"),
])
def test_bad_arguments(name, shape, classes, match):
    with pytest.raises(GradzipError, match=match):
        models.build(name, shape, classes)


def test_register_adds_a_buildable_model():
    """``models.register`` is public, like ``compressors.register``: a registered builder is
    listed, built with its default and given options, and a name is refused twice."""
    seen = []

    @models.register("widthtest", width="3")
    def _make(opts, shape, num_classes):
        seen.append(opts)
        return models.MLP(shape[0], (int(opts["width"]),), num_classes)

    try:
        assert "widthtest" in models.names()
        assert models.build("widthtest", (5,), 2)[1].out_features == 3
        assert models.build("WidthTest:width=7", (5,), 2)[1].out_features == 7
        assert seen == [{"width": "3"}, {"width": "7"}]
        with pytest.raises(GradzipError, match="bad option 'depth=2' for model 'widthtest'"):
            models.build("widthtest:depth=2", (5,), 2)
        with pytest.raises(GradzipError, match="registered twice"):
            models.register("widthtest")(_make)
        with pytest.raises(GradzipError, match="lower-case name"):
            models.register("Bad:name")
    finally:
        models._REGISTRY.pop("widthtest", None)
    assert "widthtest" not in models.names()
