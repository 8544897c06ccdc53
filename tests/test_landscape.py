"""gradzip.sharpness (docs/algorithms.md §Large-batch training, "Sharpness")."""
import pytest
import torch

import gradzip
from gradzip.errors import GradzipError


class Quadratic(torch.nn.Module):
    """L(w) = ½ Σ a_i w_i² (the "targets" are ignored): S_ρ at w = 0 is ½·max(a)·ρ²."""

    def __init__(self, a):
        super().__init__()
        self.a = a
        self.w = torch.nn.Parameter(torch.zeros(len(a)))

    def forward(self, x):
        return 0.5 * (self.a * self.w ** 2).sum()


LOSS = lambda out, _: out
DATA = [(torch.zeros(1), torch.zeros(1))]


def test_sharpness_finds_the_sharpest_direction_within_the_ball():
    a = torch.tensor([1.0, 10.0, 2.0, 0.5])
    model = Quadratic(a)
    s = gradzip.sharpness(model, LOSS, DATA, rho=0.1)
    assert 0.9 * 0.5 * 10 * 0.01 <= s <= 0.5 * 10 * 0.01 * (1 + 1e-5)
    assert torch.equal(model.w.detach(), torch.zeros(4)) and model.w.grad is None   # left as found
    assert gradzip.sharpness(Quadratic(2 * a), LOSS, DATA, rho=0.1) > 1.9 * s      # sharper: larger
    assert gradzip.sharpness(model, LOSS, DATA, rho=0.0) == 0.0


def test_sharpness_of_a_trained_classifier_grows_with_rho():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(2)]
    f = torch.nn.functional.cross_entropy
    values = [gradzip.sharpness(model, f, data, rho=r) for r in (0.01, 0.05)]
    assert 0 < values[0] < values[1]
    with pytest.raises(GradzipError, match="rho"):
        gradzip.sharpness(model, f, data, rho=float("nan"))
