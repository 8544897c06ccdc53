"""1-bit Adam, 0/1 Adam, 1-bit LAMB (gradzip.optim.onebit) and their codec
``scaled_sign:scale=rms``, each against a hand-written reference of its box in
docs/algorithms.md §"1-bit Adam, 0/1 Adam, 1-bit LAMB: the boxes"."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradzip import kernels
from gradzip.compressors import build
from gradzip.errors import GradzipError


# ----------------------------------------------------------------------------- the codec


def rms_sign_reference(y: np.ndarray) -> np.ndarray:
    """DeepSpeed's 1-bit codec: ``s · sgn⁺(y)``, ``s = ‖y‖₂/√numel``, ``sgn⁺(0) = +1``."""
    s = np.float32(np.linalg.norm(y.astype(np.float64)) / math.sqrt(y.size))
    return (s * np.where(y >= 0, 1.0, -1.0)).astype(y.dtype)


@pytest.mark.parametrize("mode", ["torch", "auto"])
def test_rms_scaled_sign_is_the_l2_preserving_sign(mode):
    y = torch.cat([torch.randn(61, generator=torch.Generator().manual_seed(1)), torch.tensor([0.0, -0.0, 3.0])])
    y = y.reshape(8, 8)
    codec = build("scaled_sign:scale=rms")
    with kernels.use(mode):
        packet = codec.compress(y)
        decoded = codec.decompress(packet)
        residual = torch.empty_like(y)
        codec.compress_residual(y, 0, residual)
    np.testing.assert_allclose(decoded.numpy(), rms_sign_reference(y.numpy()), rtol=1e-6)
    assert decoded[0, 0].item() != 0 and (decoded.flatten()[61:63] > 0).all()   # sgn⁺(±0) = +1
    torch.testing.assert_close(residual, y - decoded, rtol=0, atol=1e-6)
    assert packet.nbytes == 8 + 4                                # 64 bits + the float32 scale
    # the ℓ2 norm is preserved (up to the float32 scale)
    assert math.isclose(torch.linalg.vector_norm(decoded).item(), torch.linalg.vector_norm(y).item(), rel_tol=1e-6)


def test_rms_scale_spec_round_trips_and_l1_stays_the_default():
    assert build("scaled_sign:scale=rms").spec == "scaled_sign:scale=rms"
    assert build("scaled_sign").spec == "scaled_sign"
    assert build("scaled_sign:scale=l1").scale == "l1"
    y = torch.tensor([1.0, -3.0])
    assert torch.equal(build("scaled_sign").decompress(build("scaled_sign").compress(y)), torch.tensor([2.0, -2.0]))
    with pytest.raises(GradzipError, match="scale must be l1 or rms"):
        build("scaled_sign:scale=l2")
