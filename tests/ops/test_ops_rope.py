"""The compiled RoPE (csrc/rope_cpu.cpp, :mod:`gspo_mcore.ops.rope`) against float64 and Megatron-Core's unfused
RoPE (``_apply_rotary_pos_emb_bshd``), value and gradient, float32 and bfloat16, on awkward shapes (one token, head
size 2 and 34, angles per row or shared); the bound is twice Megatron's own error against float64 plus a few units
in the last place. Also the pure-torch twin, the angle cache, angles whose halves differ, and bad input."""

from __future__ import annotations

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.ops import reference
from gspo_mcore.ops import rope as rope_mod

pytestmark = pytest.mark.skipif(not ops.HAVE_EXTENSION, reason="the compiled extension is not built")

# (S, B, H, D, angle rows)
SHAPES = [(1, 1, 1, 2, 1), (7, 2, 3, 34, 2), (33, 3, 5, 16, 1), (129, 2, 9, 64, 2)]
DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def _inputs(S, B, H, D, BF, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(S, B, H, D, generator=g) * 3).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    pos = torch.randint(0, 4000, (S, BF), generator=g).float()  # explicit positions, as with a shared prompt
    f = pos[..., None] * inv
    freqs = torch.cat((f, f), dim=-1)[:, :, None, :]  # [S, BF, 1, D], as Megatron builds it
    dy = torch.randn(S, B, H, D, generator=g).to(dtype)
    return x, freqs, dy


def _megatron(x, freqs, dy):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    xi = x.clone().requires_grad_()
    y = _apply_rotary_pos_emb_bshd(xi, freqs)
    y.backward(dy)
    return y.detach(), xi.grad


def _exact(x, freqs, dy):
    xi = x.double().requires_grad_()
    f = freqs.double()
    x1, x2 = xi.chunk(2, dim=-1)
    y = xi * f.cos() + torch.cat((-x2, x1), dim=-1) * f.sin()
    y.backward(dy.double())
    return y.detach(), xi.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S,B,H,D,BF", SHAPES)
def test_compiled_matches_float64_within_megatron_error(S, B, H, D, BF, dtype):
    x, freqs, dy = _inputs(S, B, H, D, BF, dtype)
    cos, sin = rope_mod.angles(freqs)
    xi = x.clone().requires_grad_()
    y = rope_mod.rope(xi, cos, sin)
    y.backward(dy)
    for name, got, ref, meg in zip(("y", "dx"), (y, xi.grad), _exact(x, freqs, dy), _megatron(x, freqs, dy)):
        assert got.dtype == dtype and got.shape == ref.shape, name
        bound = 2 * (meg.double() - ref).abs().max().item() + 4 * ULP[dtype] * ref.abs().max().item()
        err = (got.double() - ref).abs().max().item()
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_equals_its_twin(dtype):
    x, freqs, _ = _inputs(9, 2, 3, 34, 2, dtype, seed=4)
    cos, sin = rope_mod.angles(freqs)
    for sign in (1.0, -1.0):
        got = torch.ops.gspo_mcore.rope(x, cos, sin, sign)
        torch.testing.assert_close(got, reference.rope(x, cos, sin, sign), rtol=0, atol=2 * ULP[dtype] * 30)


def test_angles_are_cached_per_tensor_and_refused_when_halves_differ():
    _, freqs, _ = _inputs(5, 1, 1, 8, 1, torch.float32)
    first = rope_mod.angles(freqs)
    assert rope_mod.angles(freqs)[0] is first[0]  # the same tensor: cached
    freqs.mul_(2)  # changed in place: recomputed
    torch.testing.assert_close(rope_mod.angles(freqs)[0], torch.cos(freqs[:, :, 0, :4]))
    assert rope_mod.angles(torch.randn(5, 1, 1, 8)) is None  # interleaved or partial layouts: not this kernel


def test_bad_input_is_named():
    x, freqs, _ = _inputs(5, 2, 1, 8, 1, torch.float32)
    cos, sin = rope_mod.angles(freqs)
    with pytest.raises(ValueError, match="does not fit angles"):
        rope_mod.rope(x[..., :6], cos, sin)
    with pytest.raises(RuntimeError, match="rope: cos and sin must be"):
        torch.ops.gspo_mcore.rope(x, cos[:4], sin[:4], 1.0)
    with pytest.raises(RuntimeError, match="rope: x must be float32 or bfloat16"):
        torch.ops.gspo_mcore.rope(x.double(), cos, sin, 1.0)
