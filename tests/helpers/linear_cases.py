"""Inputs and the per-rank body of the 2-rank gloo test of ``ops.linear_token_logprobs`` (importable by the
spawned ranks): deterministic inputs that both the ranks and the single-rank comparison build."""

from __future__ import annotations

import torch
import torch.distributed as dist

# (name, dtype, T, H, V, split of V over 2 ranks, chunk, temperature, with entropy)
TP_CASES = [
    ("fp32-ent-tau0.7", torch.float32, 13, 24, 203, (100, 103), 32, 0.7, True),
    ("fp32-noent", torch.float32, 9, 16, 65, (40, 25), 7, 1.0, False),
    ("bf16-ent-tau1.3", torch.bfloat16, 11, 32, 150, (77, 73), 16, 1.3, True),
]


def inputs(name: str, dtype, T: int, H: int, V: int, split=None):
    """hidden [T, H], weight [V, H], targets [T] (on both ranks' slices when ``split``), loss weights w, u."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * (2.0 / H**0.5)).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[0], targets[1] = 0, V - 1
    if split is not None:
        targets[2], targets[3] = split[0], split[0] - 1
    w = torch.randn(T, generator=g)
    u = torch.randn(T, generator=g)
    return hidden, weight, targets, w, u


def loss_and_grads(fn, hidden, weight, targets, w, u, ent: bool):
    """``fn(h, W)`` -> logp or (logp, entropy); the loss ``sum(w logp) + sum(u entropy)`` and its grads."""
    h = hidden.detach().clone().requires_grad_(True)
    W = weight.detach().clone().requires_grad_(True)
    out = fn(h, W)
    logp, entropy = out if ent else (out, None)
    loss = (w * logp).sum() + ((u * entropy).sum() if ent else 0.0)
    loss.backward()
    return {"logp": logp.detach(), "entropy": None if entropy is None else entropy.detach(), "dh": h.grad, "dw": W.grad}


def tp_rank(rank, world, use_reference):
    from gspo_mcore import ops

    out = {}
    for case in TP_CASES:
        name, dtype, T, H, V, split, chunk, temp, ent = case
        hidden, weight, targets, w, u = inputs(name, dtype, T, H, V, split)
        start = sum(split[:rank])
        local = weight[start : start + split[rank]]

        def fn(h, W, start=start, temp=temp, ent=ent, chunk=chunk):
            return ops.linear_token_logprobs(
                h,
                W,
                targets,
                vocab_start=start,
                tp_group=dist.group.WORLD,
                temperature=temp,
                return_entropy=ent,
                chunk=chunk,
            )

        with ops.use_reference(use_reference):
            res = loss_and_grads(fn, hidden, local, targets, w, u, ent)
        # the full d hidden is the sum of the ranks' contributions (the column-parallel region's backward)
        dist.all_reduce(res["dh"])
        out[name] = res
    return out
