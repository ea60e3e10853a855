"""GSPO's asymmetric clip range, with sequence ratios strictly BETWEEN the two bounds.

The range is ``[1 - eps_low, 1 + eps_high]`` with ``eps_low = 3e-4 < eps_high = 4e-4`` (spec,
../shared/notes/gspo.md). A ratio ``s`` in ``(1 + eps_low, 1 + eps_high)`` is inside the correct range but
outside the swapped one, ``[1 - eps_high, 1 + eps_low]``; a ratio in ``(1 - eps_high, 1 - eps_low)`` is
outside the correct range but inside the swapped one. So with these ratios every clipping decision that
matters flips if an implementation swaps ``eps_low`` and ``eps_high``, and the test sees it directly in
which sequences get a gradient (not only through a loss value).

Every token of a sequence has the same log-ratio ``log s`` (so ``s`` is exact up to float32 rounding of the
log-probs, ~1e-7, far inside the 5e-5 margins to either bound). Rows: ``(s, A, clipped under the spec)``:

- ``s = 1.00035, A > 0``: below ``1 + eps_high``: NOT clipped (swapped: clipped);
- ``s = 0.99965, A < 0``: below ``1 - eps_low``: clipped (swapped: not clipped);
- ``s = 1.00035, A < 0`` and ``s = 0.99965, A > 0``: the sides where a sign never clips: not clipped either way.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_mcore.algo import policy_loss
from gspo_mcore.algo.reference import policy_loss_reference

EPS_LOW, EPS_HIGH = 3e-4, 4e-4
ROWS = [  # (sequence ratio s, advantage A, clipped under [1 - eps_low, 1 + eps_high])
    (1.00035, +1.0, False),
    (0.99965, -1.0, True),
    (1.00035, -0.5, False),
    (0.99965, +0.5, False),
]
LENGTHS = [4, 3, 5, 2]


def batch():
    """(logp leaf [T], old_logp [T], advantages [B], cu_seqlens [B+1], loss_mask [T]), float32."""
    g = torch.Generator().manual_seed(0)
    logp = -(torch.rand(sum(LENGTHS), generator=g, dtype=torch.float64) * 2 + 0.1)
    shift = torch.cat([torch.full((n,), math.log(s), dtype=torch.float64) for (s, _, _), n in zip(ROWS, LENGTHS)])
    old = (logp - shift).float()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    adv = torch.tensor([a for _, a, _ in ROWS])
    return logp.float().requires_grad_(True), old, adv, cu, torch.ones(sum(LENGTHS))


def test_ratios_sit_strictly_between_the_bounds():
    logp, old, _, cu, _ = batch()
    for i, (s, _, _) in enumerate(ROWS):
        got = math.exp(float((logp.detach()[cu[i] : cu[i + 1]] - old[cu[i] : cu[i + 1]]).double().mean()))
        assert got == pytest.approx(s, abs=1e-6)
        assert 1 + EPS_LOW < got < 1 + EPS_HIGH or 1 - EPS_HIGH < got < 1 - EPS_LOW


def _grads(variant, eps_low, eps_high, fn=policy_loss):
    logp, old, adv, cu, mask = batch()
    out = fn(logp, old, adv, cu, mask, variant=variant, eps_low=eps_low, eps_high=eps_high)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), (out[1] if isinstance(out, tuple) else None), logp.grad, cu


@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
def test_clipping_between_the_bounds_follows_eps_low_and_eps_high(impl, variant):
    """Clipped sequences get no gradient; the others ``-(1/N) A s / |y_i|`` on every token (spec: grad J)."""
    loss, metrics, grad, cu = _grads(variant, EPS_LOW, EPS_HIGH)
    N = len(ROWS)
    for i, (s, a, clipped) in enumerate(ROWS):
        g = grad[cu[i] : cu[i + 1]]
        n = LENGTHS[i]
        want = torch.zeros(n) if clipped else torch.full((n,), -a * s / n / N)
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-9, msg=f"sequence {i} (s={s}, A={a})")
    assert float(metrics["clipped_sequence_fraction"]) == pytest.approx(1 / 4)
    # and the float64 reference of the spec agrees, value and gradient
    ref_loss, _, ref_grad, _ = _grads(variant, EPS_LOW, EPS_HIGH, fn=_reference)
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-5, atol=1e-9)


def test_swapped_bounds_flip_both_decisions(impl):
    """The same batch with eps_low and eps_high exchanged: the first sequence is clipped, the second not.
    (What this file exists to catch; shown here so the scenario itself is known to discriminate.)"""
    _, _, grad, cu = _grads("gspo", EPS_HIGH, EPS_LOW)
    assert torch.equal(grad[cu[0] : cu[1]], torch.zeros(LENGTHS[0]))
    assert bool((grad[cu[1] : cu[2]] != 0).all())


def _reference(logp, old, adv, cu, mask, *, variant, eps_low, eps_high):
    """The literal float64 reference (``policy_loss_reference``) with its gradient flowing to ``logp``."""
    x = logp.double()
    loss = policy_loss_reference(
        x, old.double(), adv.double(), cu, mask.double(), variant=variant, eps_low=eps_low, eps_high=eps_high
    )
    loss = loss[0] if isinstance(loss, tuple) else loss
    return loss, None
