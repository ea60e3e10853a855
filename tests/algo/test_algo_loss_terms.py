"""The decoupled off-policy correction, the KL penalty and the entropy bonus (docs/loss.md), value and
gradient against the float64 reference written from the formulas (gspo_mcore.algo.reference), plus the
properties the issues ask for: mu == pi_prox gives exactly the plain loss, MIS-masked sequences get no
gradient, TIS caps the weight, per-token advantages make GSPO-token differ from GSPO."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_mcore import ops
from gspo_mcore.algo import DEFAULT_EPS, off_policy_weights, policy_loss, regularizer_loss
from gspo_mcore.algo.reference import policy_loss_reference

LENGTHS = [5, 3, 6, 1, 4, 0, 7, 2]
# per-sequence mean log(pi_prox / mu): with C = 2 (log 2 = 0.69) sequences 1 and 4 are beyond the cap
# (TIS truncates 1; MIS masks both), the others inside; sequence 7 has no counted token
MU_SHIFT = [0.1, 1.0, -0.2, 0.0, -1.2, 0.0, 0.3, 0.05]
CAP = 2.0


def batch(seed=0, variant="gspo"):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    logp = -(torch.rand(T, generator=g, dtype=torch.float64) * 2 + 0.1)
    spread = 0.05 if variant == "grpo" else 1e-4
    prox = logp - spread * torch.randn(T, generator=g, dtype=torch.float64)
    shift = torch.tensor(MU_SHIFT, dtype=torch.float64).repeat_interleave(torch.tensor(LENGTHS))
    mu = prox - shift - 0.05 * torch.randn(T, generator=g, dtype=torch.float64)
    mask = (torch.rand(T, generator=g) < 0.8).float()
    mask[cu[:-1][torch.tensor(LENGTHS) > 0]] = 1.0
    mask[cu[7] : cu[8]] = 0.0
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.0, -1.5, 0.8])
    return logp, prox, mu, cu, mask, adv


def run(logp, prox, adv, cu, mask, variant, weights=None, **reg):
    x = logp.float().clone().requires_grad_(True)
    lo, hi = DEFAULT_EPS[variant]
    loss, _ = policy_loss(x, prox.float(), adv, cu, mask, variant=variant, eps_low=lo, eps_high=hi, weights=weights)
    if reg:
        extra, _ = regularizer_loss(x, cu, mask, num_sequences=len(LENGTHS), **reg)
        loss = loss + extra
    loss.backward()
    return loss.detach(), x.grad


def run_reference(logp, prox, adv, cu, mask, variant, **kw):
    x = logp.clone().requires_grad_(True)
    lo, hi = DEFAULT_EPS[variant]
    loss = policy_loss_reference(x, prox, adv, cu, mask, variant=variant, eps_low=lo, eps_high=hi, **kw)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("variant", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_off_policy_matches_the_float64_reference(variant, mode):
    logp, prox, mu, cu, mask, adv = batch(variant=variant)
    level = "token" if variant == "grpo" else "sequence"
    w, m = off_policy_weights(prox.float(), mu.float(), cu, mask, mode=mode, cap=CAP, level=level)
    got, grad = run(logp, prox, adv, cu, mask, variant, weights=w)
    ref, ref_grad = run_reference(logp, prox, adv, cu, mask, variant, behaviour_logp=mu, off_policy=mode, cap=CAP)
    plain, plain_grad = run(logp, prox, adv, cu, mask, variant)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(grad, plain_grad), "the weights must change the gradient of this batch"
    assert m["is_weight_max"] > CAP and m["is_weight_min"] < 1 / CAP  # the batch reaches both sides


@pytest.mark.parametrize("variant", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_mu_equal_to_prox_gives_exactly_the_plain_loss(variant, mode):
    logp, prox, _, cu, mask, adv = batch(variant=variant)
    level = "token" if variant == "grpo" else "sequence"
    w, m = off_policy_weights(prox.float(), prox.float(), cu, mask, mode=mode, cap=CAP, level=level)
    got, grad = run(logp, prox, adv, cu, mask, variant, weights=w)
    plain, plain_grad = run(logp, prox, adv, cu, mask, variant)
    assert torch.equal(got, plain) and torch.equal(grad, plain_grad)
    assert float(m["mu_kl_sum"]) == 0.0 and float(m["is_masked"]) == 0.0


def seq_of_token(cu):
    return torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))


def test_mis_masked_sequences_get_no_gradient_and_tis_caps():
    logp, prox, mu, cu, mask, adv = batch()
    w_mis, m = off_policy_weights(prox.float(), mu.float(), cu, mask, mode="mis", cap=CAP, level="sequence")
    assert w_mis.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert float(m["is_masked"]) == 2 and float(m["is_weight_count"]) == 6  # 7 sequences, one empty, one unmasked
    _, grad = run(logp, prox, adv, cu, mask, "gspo", weights=w_mis)
    seq = seq_of_token(cu)
    for i in (1, 4):
        assert torch.all(grad[seq == i] == 0), f"MIS-masked sequence {i} has a gradient"
    assert grad[(seq == 0) & (mask > 0)].abs().min() > 0
    w_tis, _ = off_policy_weights(prox.float(), mu.float(), cu, mask, mode="tis", cap=CAP, level="sequence")
    raw = torch.exp(torch.tensor(MU_SHIFT))
    assert w_tis[1] == CAP and w_tis[4] == pytest.approx(float(raw[4]), rel=0.1)  # only the top is truncated
    assert float(w_tis.max()) == CAP


def test_the_weight_is_length_normalised_not_a_product():
    """300 tokens at a per-token ratio of 0.7: the product would be 0.7**300 ~ 1e-46; the weight is 0.7."""
    n = 300
    prox = torch.full((n,), -1.0)
    mu = prox - math.log(0.7)
    w, _ = off_policy_weights(prox, mu, torch.tensor([0, n]), torch.ones(n), mode="tis", cap=2.0, level="sequence")
    assert w.item() == pytest.approx(0.7, rel=1e-5)


@pytest.mark.parametrize("bad", [1.0, 0.5, math.inf, math.nan])
def test_a_cap_not_above_one_is_refused(bad):
    from gspo_mcore.algo.loss_config import OffPolicyConfig

    with pytest.raises(ValueError, match="loss.off_policy.cap"):
        OffPolicyConfig(mode="tis", cap=bad)
    with pytest.raises(ValueError, match="cap"):
        off_policy_weights(
            torch.zeros(2), torch.zeros(2), torch.tensor([0, 2]), torch.ones(2), mode="tis", cap=bad, level="sequence"
        )


def test_loss_config_refuses_bad_regularizer_keys():
    from gspo_mcore.algo.loss_config import LossConfig

    with pytest.raises(ValueError, match="loss.kl_coef"):
        LossConfig(kl_coef=-0.1)
    with pytest.raises(ValueError, match="loss.entropy_coef"):
        LossConfig(entropy_coef=math.nan)
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig(kl_estimator="k2")


def logits_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    T, V = sum(LENGTHS), 11
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (T,), generator=g)
    ref = torch.log_softmax(torch.randn(T, V, generator=g, dtype=torch.float64), -1).gather(1, targets[:, None])[:, 0]
    return logits, targets, ref


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_and_entropy_terms_match_the_float64_reference(estimator, backend):
    """The entropy is the kernel's (token_logprobs return_entropy); the gradient flows through logp and
    the entropy into the logits, against a float64 log-softmax written from the formula."""
    logits, targets, ref_lp = logits_batch()
    _, prox, _, cu, mask, adv = batch()
    kl_coef, ent_coef, tau = 0.3, 0.05, 0.8

    x = logits.float().clone().requires_grad_(True)
    logp, ent = ops.token_logprobs(x, targets, return_entropy=True, temperature=tau)
    loss, m = regularizer_loss(
        logp,
        cu,
        mask,
        num_sequences=len(LENGTHS),
        ref_logp=ref_lp.float(),
        kl_coef=kl_coef,
        kl_estimator=estimator,
        entropy=ent,
        entropy_coef=ent_coef,
    )
    loss.backward()

    y = logits.clone().requires_grad_(True)
    lsm = torch.log_softmax(y / tau, -1)
    lp64 = lsm.gather(1, targets[:, None])[:, 0]
    ent64 = -(lsm.exp() * lsm).sum(-1)
    zero_adv = torch.zeros(len(LENGTHS), dtype=torch.float64)
    ref = policy_loss_reference(
        lp64,
        lp64.detach(),
        zero_adv,
        cu,
        mask,
        variant="gspo",
        eps_low=3e-4,
        eps_high=4e-4,
        ref_logp=ref_lp,
        kl_coef=kl_coef,
        kl_estimator=estimator,
        entropy=ent64,
        entropy_coef=ent_coef,
    )
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=1e-4, atol=1e-6)
    # the metric: sum over sequences of the per-sequence token mean of the estimator
    d = ref_lp - lp64.detach()
    k = -d if estimator == "k1" else d.exp() - d - 1
    expect = sum(float(k[a:b][mask[a:b] > 0].mean()) for a, b in zip(cu[:-1], cu[1:]) if mask[a:b].sum() > 0)
    assert float(m["kl_sum"]) == pytest.approx(expect, rel=1e-5)


def test_zero_coefficients_add_nothing_but_still_report_kl():
    logits, targets, ref_lp = logits_batch()
    _, _, _, cu, mask, _ = batch()
    logp = torch.log_softmax(logits.float(), -1).gather(1, targets[:, None])[:, 0]
    loss, m = regularizer_loss(logp, cu, mask, num_sequences=8, ref_logp=ref_lp.float(), kl_coef=0.0)
    assert loss.item() == 0.0 and float(m["kl_sum"]) > 0


def test_k3_is_zero_at_the_reference_and_nonnegative():
    from gspo_mcore.algo import kl_per_token

    lp = torch.randn(50)
    assert torch.all(kl_per_token(lp, lp, "k3") == 0)
    assert torch.all(kl_per_token(lp, lp + torch.randn(50), "k3") >= 0)
