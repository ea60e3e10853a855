"""On-policy distillation's per-token advantages (gspo_mcore.algo.distill) against a float64 reference written
from the formula in docs/distill.md, and the objective it makes through GSPO-token: on policy, its gradient is
the reverse KL's, ``-grad KL(pi || p_teacher)`` at every context (checked exactly, by enumerating the
vocabulary instead of sampling)."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_mcore.algo import DEFAULT_EPS, policy_loss
from gspo_mcore.algo.distill import distill_advantages, distill_kl

LENGTHS = [5, 3, 6, 1, 4, 0, 7, 2]


def packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    teacher = -(torch.rand(T, generator=g, dtype=torch.float64) * 6 + 0.01)
    student = -(torch.rand(T, generator=g, dtype=torch.float64) * 3 + 0.01)
    mask = (torch.rand(T, generator=g) < 0.7).float()
    seq_adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.0, -1.5, 0.8], dtype=torch.float64)
    reward = seq_adv.repeat_interleave(torch.tensor(LENGTHS)) + 0.1 * torch.randn(T, generator=g, dtype=torch.float64)
    return teacher, student, mask, reward


def reference(teacher, student, mask, reward, kl_coef, reward_weight):
    """``A_t = mask_t * (kl_coef * (teacher_t - student_t) + reward_weight * R_t)``, token by token in float64."""
    out = []
    for t in range(teacher.shape[0]):
        a = kl_coef * (float(teacher[t]) - float(student[t])) + reward_weight * float(reward[t])
        out.append(a if mask[t] != 0 else 0.0)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kl_coef, reward_weight", [(1.0, 0.0), (0.5, 0.0), (1.0, 0.3), (2.0, 1.5)])
def test_advantages_match_the_float64_reference(kl_coef, reward_weight):
    teacher, student, mask, reward = packed()
    got = distill_advantages(
        teacher.float(),
        student.float(),
        mask,
        kl_coef=kl_coef,
        reward_advantages=reward.float(),
        reward_weight=reward_weight,
    )
    want = reference(
        teacher.float().double(), student.float().double(), mask, reward.float().double(), kl_coef, reward_weight
    )
    assert got.dtype == torch.float32 and got.shape == teacher.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert bool((got[mask == 0] == 0).all())


def test_masked_tokens_never_leak_a_nan_and_the_kl_counts_policy_tokens_only():
    teacher, student, mask, reward = packed(1)
    teacher = teacher.clone()
    teacher[mask == 0] = float("nan")  # e.g. prompt positions the teacher was never asked about
    adv = distill_advantages(teacher, student, mask)
    assert bool(torch.isfinite(adv).all())
    s, n = distill_kl(teacher, student, mask)
    want = sum(float(student[t] - teacher[t]) for t in range(len(mask)) if mask[t] != 0)
    assert n == int(mask.sum()) and math.isclose(s, want, rel_tol=1e-12)


def test_bad_inputs_are_named():
    teacher, student, mask, reward = packed()
    with pytest.raises(ValueError, match="student_logp has 27 entries but teacher_logp has 28"):
        distill_advantages(teacher, student[:-1], mask)
    with pytest.raises(ValueError, match="reward_weight != 0 needs reward_advantages"):
        distill_advantages(teacher, student, mask, reward_weight=0.5)
    with pytest.raises(ValueError, match="kl_coef must be a finite number"):
        distill_advantages(teacher, student, mask, kl_coef=float("inf"))


def test_through_gspo_token_the_on_policy_gradient_is_the_reverse_kl_gradient():
    """One context, a softmax student over V tokens with logits z, a fixed teacher. Summing GSPO-token's
    per-token gradient over every possible token y weighted by pi(y) (the expectation a sampled batch
    estimates) must give ``-grad_z KL(pi || p_teacher)``, computed by autograd in float64."""
    g = torch.Generator().manual_seed(0)
    V = 11
    z = torch.randn(V, generator=g, dtype=torch.float64)
    teacher = torch.log_softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), -1)

    zr = z.clone().requires_grad_(True)
    p = torch.softmax(zr, -1)
    kl = (p * (torch.log_softmax(zr, -1) - teacher)).sum()
    (want,) = torch.autograd.grad(-kl, zr)

    # a batch of V one-token responses, response y = token y, sampled on policy (old = current log-probs)
    zb = z.clone().requires_grad_(True)
    logp = torch.log_softmax(zb, -1)  # response y's log-prob is logp[y]
    old = logp.detach()
    adv = distill_advantages(teacher.float(), old.float(), torch.ones(V))
    cu = torch.arange(V + 1)
    lo, hi = DEFAULT_EPS["gspo_token"]
    loss, _ = policy_loss(
        logp, old, adv.double(), cu, torch.ones(V), variant="gspo_token", eps_low=lo, eps_high=hi, num_sequences=V
    )
    # the loss is a mean over sequences; weight each sequence's term by V * pi(y) for the expectation
    weights = (V * torch.softmax(z, -1)).detach()
    terms = torch.autograd.grad(loss, logp, retain_graph=True)[0]  # d loss / d logp_y = -(1/V) A_y (on policy)
    (got,) = torch.autograd.grad(logp, zb, grad_outputs=-terms * weights)  # J's gradient, expectation-weighted
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
