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
from gradzip.guards.consistency import InconsistentWorkers


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


# ----------------------------------------------------------------------------- the methods
import io  # noqa: E402

import gradzip  # noqa: E402
from gradzip.optim import OneBitAdam, OneBitLAMB, ZeroOneAdam  # noqa: E402

import cases  # noqa: E402

SHAPES = [(4, 3), (5,), (2, 3)]
LR, B1, B2, EPS = 0.01, 0.9, 0.99, 1e-8


def inits() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grad(t: int, rank: int, layer: int) -> torch.Tensor:
    """Worker ``rank``'s gradient of tensor ``layer`` at step ``t`` (fixed, any model)."""
    g = torch.Generator().manual_seed(1000 * t + 10 * rank + layer)
    return torch.randn(SHAPES[layer], generator=g) * (1 + layer) + 0.1 * rank


def rms_sign(y: torch.Tensor) -> torch.Tensor:
    s = (torch.linalg.vector_norm(y) / math.sqrt(y.numel())).to(torch.float32)
    return s * torch.where(y >= 0, 1.0, -1.0)


CODECS = {"scaled_sign:scale=rms": rms_sign, "none": lambda y: y.clone()}


def car(ys, es, codec, server=None):
    """The spec's CAR, every worker at once: ``ys[j][l]``, ``es[j][l]`` (None = 0) ->
    (aggregate per worker and tensor, new worker errors ``(y + e) − sent``). ``server``
    None: PSync's exact transport (``mean_j C(y_j + e_j)``); a dict: the two-phase rule
    ("Transports of PSync"): the tensors are one bucket (they are small), concatenated in
    launch order (descending key: the last tensor first), its slices ``tensor_split(d, n)``
    compressed on their own, the server error ``E[j]`` kept in the dict. One worker: no
    compression, errors unchanged."""
    n = len(ys)
    if n == 1:
        return [[y.clone() for y in ys[0]]], es
    ps = [[y if e is None else y + e for y, e in zip(yj, ej)] for yj, ej in zip(ys, es)]
    C = CODECS[codec]
    if server is None:
        cs = [[C(p) for p in pj] for pj in ps]
        mean = [sum(cs[j][l] for j in range(n)) / n for l in range(len(ys[0]))]
        return [[a.clone() for a in mean] for _ in range(n)], [[p - c for p, c in zip(pj, cj)] for pj, cj in zip(ps, cs)]
    order = list(reversed(range(len(ys[0]))))
    sizes = [ps[0][l].numel() for l in order]
    flat = [torch.cat([ps[i][l].reshape(-1) for l in order]) for i in range(n)]
    parts = [[C(s) if s.numel() else s.clone() for s in torch.tensor_split(flat[i], n)] for i in range(n)]
    back = []
    for j in range(n):
        if parts[0][j].numel() == 0:
            back.append(parts[0][j])
            continue
        s_j = sum(parts[i][j] for i in range(n)) / n + server.get(j, 0.0)
        c_j = C(s_j)
        server[j] = s_j - c_j
        back.append(c_j)
    unflat = lambda v: {l: piece for l, piece in zip(order, torch.split(v, sizes))}
    aggregate = unflat(torch.cat(back))
    sent = [unflat(torch.cat(parts[i])) for i in range(n)]
    return [[aggregate[l].reshape(ps[0][l].shape).clone() for l in range(len(ys[0]))] for _ in range(n)], \
        [[p - sent[i][l].reshape(p.shape) for l, p in enumerate(pj)] for i, pj in enumerate(ps)]


def adam_dir(m, v, x, wd, c=(1.0, 1.0)):
    """``m̂/(√v̂+ε) + λ·x`` with ``m̂ = m/c[0]``, ``v̂ = v/c[1]`` (bias correction; (1, 1): none)."""
    return (m / c[0]) / ((v / c[1]).sqrt() + EPS) + wd * x


def masked(t, v, c2):
    """The momentum mask "auto": ``t`` where ``v̂ = v / c2 > ε²``, else 0."""
    return t * (v > EPS ** 2 * c2)


#: exact Adam's largest |m| / sqrt(v) for (B1, B2): (1−β1)/√((1−β2)(1−β1²/β2))
KAPPA = (1 - B1) / math.sqrt((1 - B2) * (1 - B1 * B1 / B2))


def bounded(t, v, multiple):
    """The momentum bound: ``t`` clamped to ``±multiple·√v``."""
    limit = v.sqrt() * multiple
    return torch.maximum(torch.minimum(t, limit), -limit)


def corr(bc, t, n_v):
    """``(1−β1^t, 1−β2^n_v)`` with bias correction (``bc``), else (1, 1); n_v = 0: v = 0."""
    return (1 - B1 ** t, 1 - B2 ** n_v if n_v else 1.0) if bc else (1.0, 1.0)


def ref_onebit_adam(n, steps, T_w, wd, codec, transport="twophase", bc=False, mask=False, bound=False):
    server = {} if transport == "twophase" else None
    L = len(SHAPES)
    x = [inits() for _ in range(n)]
    m = [[torch.zeros(s) for s in SHAPES] for _ in range(n)]
    v = [torch.zeros(s) for s in SHAPES]
    e = [[None] * L for _ in range(n)]
    for t in range(1, steps + 1):
        g = [[grad(t, j, l) for l in range(L)] for j in range(n)]
        if t <= T_w:
            gbar = [sum(g[j][l] for j in range(n)) / n for l in range(L)]
            for l in range(L):
                v[l] = B2 * v[l] + (1 - B2) * gbar[l] * gbar[l]
            for j in range(n):
                for l in range(L):
                    m[j][l] = B1 * m[j][l] + (1 - B1) * gbar[l]
        else:
            local = [[B1 * m[j][l] + (1 - B1) * g[j][l] for l in range(L)] for j in range(n)]
            m, e = car(local, e, codec, server)
            if mask:
                m = [[masked(m[j][l], v[l], corr(bc, t, T_w)[1]) for l in range(L)] for j in range(n)]
            if bound:
                m = [[bounded(m[j][l], v[l], KAPPA) for l in range(L)] for j in range(n)]
        for j in range(n):
            for l in range(L):
                x[j][l] = x[j][l] - LR * adam_dir(m[j][l], v[l], x[j][l], wd, corr(bc, t, min(t, T_w)))
    return x


def ref_zeroone_adam(n, steps, T_v, kappa, S, H_max, wd, codec, transport="twophase", bc=False, mask=False,
                     bound=False):
    server = {} if transport == "twophase" else None
    L = len(SHAPES)
    x = [inits() for _ in range(n)]
    m = [[torch.zeros(s) for s in SHAPES] for _ in range(n)]
    v = [torch.zeros(s) for s in SHAPES]
    e = [[None] * L for _ in range(n)]
    u = [[torch.zeros(s) for s in SHAPES] for _ in range(n)]
    lr_sum, x_sync = 0.0, None
    I_v, c_v, I_u, c_u = 1, 0, 1, 0
    n_v = 0   # v's updates (bias correction)
    for t in range(1, steps + 1):
        g = [[grad(t, j, l) for l in range(L)] for j in range(n)]
        if t <= T_v:
            if t % I_v == 0:
                gbar = [sum(g[j][l] for j in range(n)) / n for l in range(L)]
                ghat = [gbar for _ in range(n)]
                for l in range(L):
                    v[l] = B2 * v[l] + (1 - B2) * gbar[l] * gbar[l]
                n_v += 1
                c_v += 1
                if c_v == kappa:
                    c_v, I_v = 0, 2 * I_v
            else:
                ghat, e = car(g, e, codec, server)
                if mask:
                    ghat = [[masked(ghat[j][l], v[l], corr(bc, t, n_v)[1]) for l in range(L)] for j in range(n)]
                if bound:
                    ghat = [[bounded(ghat[j][l], v[l], 1 / math.sqrt(1 - B2)) for l in range(L)] for j in range(n)]
            for j in range(n):
                for l in range(L):
                    m[j][l] = B1 * m[j][l] + (1 - B1) * ghat[j][l]
                    x[j][l] = x[j][l] - LR * adam_dir(m[j][l], v[l], x[j][l], wd, corr(bc, t, n_v))
            if t == T_v:   # both errors reset, once
                e = [[None] * L for _ in range(n)]
                if server is not None:
                    server.clear()
            continue
        if x_sync is None:
            x_sync = [[xl.clone() for xl in xj] for xj in x]
        for j in range(n):
            for l in range(L):
                m[j][l] = B1 * m[j][l] + (1 - B1) * g[j][l]
                d = adam_dir(m[j][l], v[l], x[j][l], 0.0, corr(bc, t, n_v))   # u: Adam's part only
                x[j][l] = x[j][l] - LR * (d + wd * x[j][l])                  # decay local, never sent
                x_sync[j][l] = (1 - LR * wd) * x_sync[j][l]
                u[j][l] = u[j][l] - LR * d
        lr_sum += LR
        if (t - T_v) % I_u == 0:
            c1, c2 = corr(bc, t, n_v)
            w = [[u[j][l] * ((v[l] / c2).sqrt() + EPS) for l in range(L)] for j in range(n)]
            wbar, e = car(w, e, codec, server)
            if mask:
                wbar = [[masked(wbar[j][l], v[l], c2) for l in range(L)] for j in range(n)]
            if bound:
                wbar = [[bounded(wbar[j][l], v[l], KAPPA * lr_sum / c1) for l in range(L)] for j in range(n)]
            for j in range(n):
                for l in range(L):
                    m[j][l] = -wbar[j][l] / lr_sum * c1
                    x[j][l] = x_sync[j][l] + wbar[j][l] / ((v[l] / c2).sqrt() + EPS)
                    x_sync[j][l] = x[j][l].clone()
                    u[j][l] = torch.zeros(SHAPES[l])
            lr_sum = 0.0
        c_u += 1
        if c_u == S:
            c_u, I_u = 0, min(H_max, 2 * I_u)
    return x


def ref_onebit_lamb(n, steps, T_w, wd, codec, min_c=0.01, max_c=10.0, beta_c=0.9, f_min=0.5, f_max=4.0, theta=0.1,
                    transport="twophase", bc=False, mask=False, bound=False):
    server = {} if transport == "twophase" else None
    L = len(SHAPES)
    x = [inits() for _ in range(n)]
    m = [[torch.zeros(s) for s in SHAPES] for _ in range(n)]
    v = [torch.zeros(s) for s in SHAPES]
    vf = [[torch.zeros(s) for s in SHAPES] for _ in range(n)]
    cbar = [0.0] * L
    f_prev = [[1.0] * L for _ in range(n)]
    e = [[None] for _ in range(n)]
    s = None
    for t in range(1, steps + 1):
        g = [[grad(t, j, l) for l in range(L)] for j in range(n)]
        if t <= T_w:
            gbar = [sum(g[j][l] for j in range(n)) / n for l in range(L)]
            for l in range(L):
                v[l] = B2 * v[l] + (1 - B2) * gbar[l] * gbar[l]
            for j in range(n):
                for l in range(L):
                    m[j][l] = B1 * m[j][l] + (1 - B1) * gbar[l]
                    if t == T_w:
                        vf[j][l] = v[l].clone()
                    u = adam_dir(m[j][l], v[l], x[j][l], wd, corr(bc, t, t))
                    xn, un = x[j][l].norm().item(), u.norm().item()
                    r = min(max(xn / un, min_c), max_c) if xn > 0 and un > 0 else 1.0
                    if r != 1.0 and j == 0:
                        cbar[l] = beta_c * cbar[l] + (1 - beta_c) * r
                    x[j][l] = x[j][l] - LR * r * u
            continue
        if s is None:
            rho = [m[0][l].norm().item() / math.sqrt(m[0][l].numel()) for l in range(L)]
            s = [(sum(rho) / L) / r if r > 0 else 1.0 for r in rho]
        m_prev = m
        scaled = [torch.cat([(s[l] * (B1 * m[j][l] + (1 - B1) * g[j][l])).reshape(-1) for l in range(L)])
                  for j in range(n)]
        M, e = car([[y] for y in scaled], e, codec, server)
        sizes = [math.prod(sh) for sh in SHAPES]
        m = [[piece.view(SHAPES[l]) / s[l] for l, piece in enumerate(torch.split(M[j][0], sizes))] for j in range(n)]
        if mask:
            m = [[masked(m[j][l], v[l], corr(bc, t, T_w)[1]) for l in range(L)] for j in range(n)]
        if bound:
            m = [[bounded(m[j][l], v[l], KAPPA) for l in range(L)] for j in range(n)]
        for j in range(n):
            for l in range(L):
                ghat = (m[j][l] - B1 * m_prev[j][l]) / (1 - B1)
                vf[j][l] = B2 * vf[j][l] + (1 - B2) * ghat * ghat
                c1, c2 = corr(bc, t, T_w)
                u_p = (m[j][l] / c1) / ((v[l] / c2).sqrt() + EPS)
                u = u_p + wd * x[j][l]
                f = (((v[l] / c2).sqrt() + EPS) / ((vf[j][l] / corr(bc, t, t)[1]).sqrt() + EPS)).max().item()
                if wd > 0:
                    q = min(1.0, u_p.norm().item() / u.norm().item())
                    f = f * q + (1 - q)
                f = min(max(f, f_min), f_max)
                f = min(max(f, f_prev[j][l] * (1 - theta)), f_prev[j][l] * (1 + theta))
                f_prev[j][l] = f
                x[j][l] = x[j][l] - LR * (cbar[l] * f) * u
    return x


def run(cls, n, steps, options, save_at=None):
    """``steps`` steps of ``cls`` on ``n`` in-process workers with the gradients of
    :func:`grad`; with ``save_at``, the optimizer and parameters are saved before step
    ``save_at`` (through torch.save) and fresh ones loaded from it continue. Per rank:
    (final parameters, final state_dict)."""
    def worker(comm):
        params = [torch.nn.Parameter(t) for t in inits()]
        opt = cls(params, lr=LR, betas=(B1, B2), eps=EPS, comm=comm, **options)
        for t in range(1, steps + 1):
            if t == save_at:
                buffer = io.BytesIO()
                torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in params]}, buffer)
                buffer.seek(0)
                saved = torch.load(buffer)
                params = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
                opt = cls(params, lr=LR, betas=(B1, B2), eps=EPS, comm=comm, **options)
                opt.load_state_dict(saved["opt"])
            for layer, p in enumerate(params):
                p.grad = grad(t, comm.rank, layer)
            opt.step()
        return [p.detach().clone() for p in params], opt.state_dict()
    return gradzip.simulate(n, worker)


def assert_matches(outs, reference):
    for rank, (params, _) in enumerate(outs):
        for layer, (got, want) in enumerate(zip(params, reference[rank])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} tensor {layer}: {m}")


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("codec", ["scaled_sign:scale=rms", "none"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("transport", ["auto", "allgather"])
def test_onebit_adam_is_its_box(n, codec, wd, transport):
    """CAR is the two-phase compressed allreduce (``transport="auto"``, the default) or,
    pinned, an exact transport."""
    outs = run(OneBitAdam, n, 7, dict(freeze_step=3, compressor=codec, weight_decay=wd, transport=transport))
    assert_matches(outs, ref_onebit_adam(n, 7, 3, wd, codec, "twophase" if transport == "auto" else "exact"))


def test_onebit_adam_with_the_identity_codec_and_no_freeze_is_adam_without_bias_correction():
    """The spec's test limit: Adam (no bias correction, ε outside the root, decoupled
    decay) on the mean gradient of 3 workers; with T_w = 3 < steps and the identity codec,
    Adam whose v stops at step 3."""
    def adam(steps, stop_v):
        x, m, v = inits(), [torch.zeros(s) for s in SHAPES], [torch.zeros(s) for s in SHAPES]
        for t in range(1, steps + 1):
            for l in range(len(SHAPES)):
                g = sum(grad(t, j, l) for j in range(3)) / 3
                m[l] = B1 * m[l] + (1 - B1) * g
                if t <= stop_v:
                    v[l] = B2 * v[l] + (1 - B2) * g * g
                x[l] = x[l] - LR * (m[l] / (v[l].sqrt() + EPS) + 0.05 * x[l])
        return x
    for freeze, stop_v in ((100, 6), (3, 3)):
        outs = run(OneBitAdam, 3, 6, dict(freeze_step=freeze, compressor="none", weight_decay=0.05))
        assert_matches(outs, [adam(6, stop_v)] * 3)


@pytest.mark.parametrize("n", [1, 3])
def test_zeroone_adam_with_the_identity_codec_and_sync_every_step_is_adam_with_frozen_v(n):
    """The limit of 1-bit Adam's test, for 0/1 Adam: identity codec, every step a variance
    step up to T_v = 3 (κ = 100), then local steps that sync every step (I_u = 1): Adam
    (no bias correction, decoupled decay) on the mean gradient whose v stops at step 3.
    Issue 17: with λ·x folded into the synchronised u, ``m ← −w̄/λ_Σ`` picked up
    ``λ·x·(√v+ε)`` every sync, so the decay compounded through m (~λ/(1−β1)) and the
    momentum no longer was Adam's."""
    x, m, v = inits(), [torch.zeros(s) for s in SHAPES], [torch.zeros(s) for s in SHAPES]
    for t in range(1, 9):
        for l in range(len(SHAPES)):
            g = sum(grad(t, j, l) for j in range(n)) / n
            m[l] = B1 * m[l] + (1 - B1) * g
            if t <= 3:
                v[l] = B2 * v[l] + (1 - B2) * g * g
            x[l] = x[l] - LR * (m[l] / (v[l].sqrt() + EPS) + 0.1 * x[l])
    outs = run(ZeroOneAdam, n, 8, dict(var_freeze_step=3, var_update_scaler=100, compressor="none", weight_decay=0.1))
    assert_matches(outs, [x] * n)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_zeroone_adam_is_its_box(n, wd):
    """κ = 2: variance steps 1, 2, 4, 6, 10 (I_v doubles every 2); T_v = 10, then local
    steps with I_u = 1, 1, 2, 2, 4 (S = 2, H_max = 4): every branch within 22 steps."""
    codec = "scaled_sign:scale=rms"
    opts = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    outs = run(ZeroOneAdam, n, 22, dict(opts, compressor=codec, weight_decay=wd))
    assert_matches(outs, ref_zeroone_adam(n, 22, 10, 2, 2, 4, wd, codec))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_onebit_lamb_is_its_box(n, wd):
    codec = "scaled_sign:scale=rms"
    outs = run(OneBitLAMB, n, 8, dict(freeze_step=3, compressor=codec, weight_decay=wd))
    assert_matches(outs, ref_onebit_lamb(n, 8, 3, wd, codec))


RESUMES = {
    "onebitadam": (OneBitAdam, dict(freeze_step=4), 10, (3, 7)),
    # κ = 3: variance steps 1, 2, 3, 4, 6, 8, 12 = T_v; local syncs at s = 1, 2, 4, 8 (t = 13, 14, 16, 20).
    # Cuts 5 and 14 fall where a lost counter (c_v, c_u) would move a later variance step / sync.
    "zerooneadam": (ZeroOneAdam, dict(var_freeze_step=12, var_update_scaler=3, local_step_scaler=2,
                                      local_step_clipper=4), 24, (5, 9, 13, 14, 16, 18)),
    "onebitlamb": (OneBitLAMB, dict(freeze_step=4, weight_decay=0.1), 10, (3, 5, 7)),
}


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_resume_is_bit_exact_mid_warmup_and_mid_compression(name):
    """Saved before a warm-up step, the first compressed step, or within the compressed
    stage (0/1 Adam: the 1-bit steps of phase A, between and at syncs of phase B), the run
    continues bit for bit: errors, moments, coefficients and schedules are all saved."""
    cls, options, steps, cuts = RESUMES[name]
    whole = run(cls, 2, steps, options)
    for cut in cuts:
        resumed = run(cls, 2, steps, options, save_at=cut)
        for rank in range(2):
            cases.assert_bitwise_equal(whole[rank][0], resumed[rank][0], f"{name} cut {cut} rank {rank} params")
            cases.assert_bitwise_equal(whole[rank][1], resumed[rank][1], f"{name} cut {cut} rank {rank} state")


def test_compressed_stage_sends_one_bit_per_entry():
    outs = gradzip.simulate(2, lambda comm: _bytes_per_stage(comm))
    dense, compressed = outs[0]
    numel = sum(math.prod(s) for s in SHAPES)
    assert dense == 4 * numel                                    # float32 mean: 4 bytes per entry
    assert compressed == sum(math.ceil(math.prod(s) / 8) + 4 for s in SHAPES)   # bits + one scale


def _bytes_per_stage(comm):
    params = [torch.nn.Parameter(t) for t in inits()]
    opt = OneBitAdam(params, lr=LR, comm=comm, freeze_step=1, transport="allgather")   # the exact transport's bytes
    sent = []
    for t in (1, 2):
        before = sum(x.payload_bytes for x in opt._exchanges)
        for layer, p in enumerate(params):
            p.grad = grad(t, comm.rank, layer)
        opt.step()
        sent.append(sum(x.payload_bytes for x in opt._exchanges) - before)
    return sent


@pytest.mark.parametrize("kwargs, needle", [
    (dict(momentum=0.9), "momentum is betas[0]"), (dict(betas="0.9"), "betas"), (dict(betas=(0.9, 1.0)), "betas"),
    (dict(eps=-1.0), "eps"), (dict(transport="udp"), "transport"), (dict(freeze_step=-1), "freeze_step"),
    (dict(compressor="zip"), "zip"),
])
def test_bad_options_are_one_line_errors(kwargs, needle):
    with pytest.raises(GradzipError, match=None) as exc:
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_betas_from_the_cli_string_and_lamb_zeroone_option_checks():
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(2))], lr=0.1, betas="0.8,0.95")
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    with pytest.raises(GradzipError, match="min_coeff"):
        OneBitLAMB([torch.nn.Parameter(torch.zeros(2))], lr=0.1, min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(GradzipError, match="var_update_scaler"):
        ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], lr=0.1, var_update_scaler=0)


# -- bias_correction (the spec's [choice] "an option may add it") --------------------------

@pytest.mark.parametrize("cls, options", [
    (OneBitAdam, dict(freeze_step=100)),
    (ZeroOneAdam, dict(var_freeze_step=100, var_update_scaler=100)),   # every step a variance step
])
def test_bias_correction_in_the_dense_limit_is_torch_adamw(cls, options):
    """With the identity codec and no freeze, bias-corrected 1-bit Adam / 0/1 Adam on 3
    workers is ``torch.optim.AdamW`` on the mean gradient (ε outside the root, decoupled
    decay: torch's own AdamW is the reference)."""
    outs = run(cls, 3, 6, dict(compressor="none", weight_decay=0.05, bias_correction=True, **options))
    params = [torch.nn.Parameter(t) for t in inits()]
    adamw = torch.optim.AdamW(params, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=0.05)
    for t in range(1, 7):
        for layer, p in enumerate(params):
            p.grad = sum(grad(t, j, layer) for j in range(3)) / 3
        adamw.step()
    assert_matches(outs, [[p.detach() for p in params]] * 3)
    # and without it (the default), the numbers differ: the option is not a no-op
    plain = run(cls, 3, 6, dict(compressor="none", weight_decay=0.05, **options))
    assert not torch.allclose(plain[0][0][0], params[0].detach(), atol=1e-4)


@pytest.mark.parametrize("n", [1, 3])
def test_bias_corrected_boxes_past_their_freeze(n):
    """Past the warm-up / variance phase: v̂ keeps the correction of its last update,
    m̂ = m/(1−β1^t) goes on; 0/1 Adam's sync stores m uncorrected; 1-bit LAMB's v_f has its
    own count t. Each against its box with the corrections (the references above, bc=True)."""
    codec, wd = "scaled_sign:scale=rms", 0.1
    outs = run(OneBitAdam, n, 7, dict(freeze_step=3, compressor=codec, weight_decay=wd, bias_correction=True))
    assert_matches(outs, ref_onebit_adam(n, 7, 3, wd, codec, bc=True))
    opts = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    outs = run(ZeroOneAdam, n, 22, dict(compressor=codec, weight_decay=wd, bias_correction=True, **opts))
    assert_matches(outs, ref_zeroone_adam(n, 22, 10, 2, 2, 4, wd, codec, bc=True))
    outs = run(OneBitLAMB, n, 8, dict(freeze_step=3, compressor=codec, weight_decay=wd, bias_correction=True))
    assert_matches(outs, ref_onebit_lamb(n, 8, 3, wd, codec, bc=True))


def test_bias_correction_is_checked_and_resumes_exactly():
    with pytest.raises(GradzipError, match="bias_correction must be True or False"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], lr=0.1, bias_correction="yes")
    opts = dict(var_freeze_step=4, var_update_scaler=2, bias_correction=True)
    whole, cut = run(ZeroOneAdam, 2, 9, opts), run(ZeroOneAdam, 2, 9, opts, save_at=6)
    for (a, _), (b, _) in zip(whole, cut):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def zero_coordinate_grad(t: int, rank: int, layer: int) -> torch.Tensor:
    """:func:`grad` with tensor 1's first coordinate 0 on every worker and step (an unused
    input, a softmax-invariant bias): its v stays 0."""
    g = GRAD(t, rank, layer)
    if layer == 1:
        g[0] = 0.0
    return g


GRAD = grad
MASK_CASES = {
    "onebitadam": (OneBitAdam, dict(freeze_step=3), lambda n, wd, bc, mask, bound=False: ref_onebit_adam(
        n, 8, 3, wd, "scaled_sign:scale=rms", bc=bc, mask=mask, bound=bound)),
    "zerooneadam": (ZeroOneAdam, dict(var_freeze_step=5, var_update_scaler=2), lambda n, wd, bc, mask, bound=False: ref_zeroone_adam(
        n, 8, 5, 2, 32678, 16, wd, "scaled_sign:scale=rms", bc=bc, mask=mask, bound=bound)),
    "onebitlamb": (OneBitLAMB, dict(freeze_step=3), lambda n, wd, bc, mask, bound=False: ref_onebit_lamb(
        n, 8, 3, wd, "scaled_sign:scale=rms", bc=bc, mask=mask, bound=bound)),
}


@pytest.mark.parametrize("name", sorted(MASK_CASES))
@pytest.mark.parametrize("bc", [False, True])
def test_momentum_mask_auto_is_its_box_and_stops_the_zero_variance_blow_up(name, bc, monkeypatch):
    """``momentum_mask="auto"`` zeroes CAR's output where ``v̂ <= ε²``: each method equals its
    box with that product (3 workers, two-phase CAR); a coordinate with a zero gradient
    then moves only by weight decay, while without the mask the sign codec's ``±s`` over
    ``√v + ε = ε`` throws it far away (the failure docs/adaptive.md describes)."""
    monkeypatch.setitem(globals(), "grad", zero_coordinate_grad)
    cls, options, reference = MASK_CASES[name]
    wd = 0.1
    masked_run = run(cls, 3, 8, dict(options, weight_decay=wd, bias_correction=bc, momentum_mask="auto"))
    assert_matches(masked_run, reference(3, wd, bc, True))
    plain = run(cls, 3, 8, dict(options, weight_decay=wd, bias_correction=bc))
    assert_matches(plain, reference(3, wd, bc, False))
    start = inits()[1][0]
    for rank in range(3):
        assert abs(float(masked_run[rank][0][1][0] - start)) < 1.0   # decay only (LAMB: times its trust ratio)
        assert abs(float(plain[rank][0][1][0] - start)) > 1e3


def test_momentum_mask_given_per_parameter_and_its_errors(monkeypatch):
    """A ``{parameter: mask}`` dict (DeepSpeed's ``exp_avg_mask``) acts like "auto" where
    it masks the same coordinates; bad masks are one-line errors naming the fix."""
    monkeypatch.setitem(globals(), "grad", zero_coordinate_grad)
    auto = run(OneBitAdam, 3, 8, dict(freeze_step=3, momentum_mask="auto"))

    def worker(comm):
        params = [torch.nn.Parameter(t) for t in inits()]
        keep = torch.ones(SHAPES[1])
        keep[0] = 0.0
        opt = OneBitAdam(params, lr=LR, betas=(B1, B2), eps=EPS, comm=comm, freeze_step=3,
                         momentum_mask={params[1]: keep})
        for t in range(1, 9):
            for layer, p in enumerate(params):
                p.grad = zero_coordinate_grad(t, comm.rank, layer)
            opt.step()
        return [p.detach().clone() for p in params]
    given = gradzip.simulate(3, worker)
    for rank in range(3):
        torch.testing.assert_close(given[rank][1], auto[rank][0][1], rtol=0, atol=0)

    def differing(comm):   # workers whose masks differ are refused at the first step
        p = torch.nn.Parameter(torch.zeros(3))
        opt = OneBitAdam([p], lr=LR, comm=comm, momentum_mask={p: torch.full((3,), float(comm.rank))})
        p.grad = torch.ones(3)
        with pytest.raises(InconsistentWorkers, match="momentum_mask"):
            opt.step()
    gradzip.simulate(2, differing)
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(GradzipError, match="momentum_mask for a parameter of shape"):
        OneBitAdam([p], lr=LR, momentum_mask={p: torch.ones(2)})
    with pytest.raises(GradzipError, match="keys must be this optimizer's parameters"):
        OneBitAdam([p], lr=LR, momentum_mask={torch.zeros(3): torch.ones(3)})
    with pytest.raises(GradzipError, match="--momentum-mask auto"):
        ZeroOneAdam([p], lr=LR, momentum_mask="everywhere")


def small_coordinate_grad(t: int, rank: int, layer: int) -> torch.Tensor:
    """:func:`grad` with tensor 1's first coordinate 1e-6 of the others' scale: v there is
    far above ε² (the mask keeps it) but far below its slice's, so the sign codec's ``±s``
    over ``√v`` moves it by ~η·10⁶ a step."""
    g = GRAD(t, rank, layer)
    if layer == 1:
        g[0] = 1e-6 * (1 + 0.1 * rank)
    return g


@pytest.mark.parametrize("name", sorted(MASK_CASES))
@pytest.mark.parametrize("bc", [False, True])
def test_momentum_bound_is_its_box_and_keeps_m_where_exact_adam_can_hold_it(name, bc, monkeypatch):
    """``momentum_bound=True`` clamps CAR's output to exact Adam's range (1-bit Adam / LAMB:
    m to ``±κ√v``; 0/1 Adam: ĝ to ``±√(v/(1−β2))``, w̄ to ``±κ√v·λ_Σ/c1``), after the
    mask: each method equals its box with it (3 workers), and a coordinate whose gradient
    is tiny but not 0 (which the mask leaves alone) no longer runs away."""
    monkeypatch.setitem(globals(), "grad", small_coordinate_grad)
    cls, options, reference = MASK_CASES[name]
    wd = 0.1
    both = run(cls, 3, 8, dict(options, weight_decay=wd, bias_correction=bc, momentum_mask="auto",
                               momentum_bound=True))
    assert_matches(both, reference(3, wd, bc, True, True))
    masked_only = run(cls, 3, 8, dict(options, weight_decay=wd, bias_correction=bc, momentum_mask="auto"))
    start = inits()[1][0]
    for rank in range(3):
        assert abs(float(both[rank][0][1][0] - start)) < 1.0
        assert abs(float(masked_only[rank][0][1][0] - start)) > 1e2


def test_momentum_bound_checks_betas_and_its_value():
    assert math.isclose(OneBitAdam.adam_kappa((0.9, 0.98)), 0.1 / math.sqrt(0.02 * (1 - 0.81 / 0.98)))
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(GradzipError, match="momentum_bound needs beta1² < beta2"):
        OneBitAdam([p], lr=LR, betas=(0.99, 0.9), momentum_bound=True)
    opt = OneBitAdam([p], lr=LR, momentum_bound=True)
    with pytest.raises(GradzipError, match="momentum_bound needs beta1² < beta2"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.99, 0.5)})
    assert len(opt.param_groups) == 1
    with pytest.raises(GradzipError, match="momentum_bound must be True or False"):
        ZeroOneAdam([p], lr=LR, momentum_bound="yes")


@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_betas_outside_the_bounds_range_run_with_the_bound_off(name):
    """β1² ≥ β2 (or β2 = 0) only matters to ``momentum_bound``: with it off (the default) the
    compressed stages run (κ is +inf there: exact Adam's ratio is unbounded)."""
    cls, options, _ = MASK_CASES[name]

    def worker(comm):
        params = [torch.nn.Parameter(t) for t in inits()]
        opt = cls(params, lr=LR, betas=(0.95, 0.0), eps=EPS, comm=comm, **options)
        for t in range(1, 9):
            for layer, p in enumerate(params):
                p.grad = grad(t, comm.rank, layer)
            opt.step()
        return opt.steps
    assert gradzip.simulate(2, worker) == [8, 8]
    assert OneBitAdam.adam_kappa((0.95, 0.9)) == math.inf and OneBitAdam.adam_kappa((0.5, 0.0)) == math.inf
