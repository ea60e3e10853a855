"""Helpers for the 2-rank gloo tests: spawning ranks, and the deterministic inputs both the ranks and the
single-rank comparison build (so that nothing but the results crosses the process boundary)."""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gspo_mcore.platform.launch import free_port


def _entry(rank, world, port, fn, out_dir, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
    except BaseException:
        result = {"__error__": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(fn, world: int = 2, args=()):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (spawned processes); return each rank's result."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(world, free_port(), fn, d, args), nprocs=world, join=True)
        results = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if isinstance(res, dict) and "__error__" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['__error__']}")
    return results


# ---------------------------------------------------------------------------------------------------
# Vocabulary-parallel token_logprobs
# ---------------------------------------------------------------------------------------------------

# (name, logits dtype, V, split of V over the 2 ranks, T, temperature, with entropy)
TP_CASES = [
    ("fp32-1001-ent", torch.float32, 1001, (500, 501), 13, 1.0, True),
    ("fp32-1001-noent-tau0.7", torch.float32, 1001, (500, 501), 13, 0.7, False),
    ("bf16-1001-ent-tau1.3", torch.bfloat16, 1001, (500, 501), 13, 1.3, True),
    ("bf16-33-uneven-ent", torch.bfloat16, 33, (7, 26), 9, 1.0, True),
    ("fp32-2-one-column-each", torch.float32, 2, (1, 1), 5, 1.0, True),
]


def tp_inputs(case):
    """Full logits [T, V], global targets (on both ranks' slices), and loss weights w, u."""
    name, dtype, V, split, T, temp, ent = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = (torch.randn(T, V, generator=g) * 3).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[0], targets[1], targets[2] = 0, V - 1, split[0]  # both edges of the split
    if T > 4:
        targets[3] = split[0] - 1
    logits[1, int(targets[1])] += 10  # a peaked row on the second rank's slice
    w = torch.randn(T, generator=g)
    u = torch.randn(T, generator=g)
    return logits, targets, w, u


def _tp_forward_backward(logits, targets, w, u, temp, ent, **kw):
    from gspo_mcore import ops

    x = logits.detach().clone().requires_grad_(True)
    out = ops.token_logprobs(x, targets, temperature=temp, return_entropy=ent, **kw)
    lp, H = out if ent else (out, None)
    loss = (lp * w).sum() + ((H * u).sum() if ent else 0.0)
    loss.backward()
    return {"logp": lp.detach(), "entropy": None if H is None else H.detach(), "grad": x.grad}


def tp_single_rank(case):
    logits, targets, w, u = tp_inputs(case)
    return _tp_forward_backward(logits, targets, w, u, case[5], case[6])


def _tp_rank(rank, world, case):
    _, _, V, split, _, temp, ent = case
    logits, targets, w, u = tp_inputs(case)
    start = sum(split[:rank])
    local = logits[:, start : start + split[rank]].contiguous()
    return _tp_forward_backward(local, targets, w, u, temp, ent, vocab_start=start, tp_group=dist.group.WORLD)


def _tp_out_of_range(rank, world):
    """A target outside the global vocabulary (V = 1001 split 500 + 501) must raise on EVERY rank."""
    from gspo_mcore import ops

    logits, _, _, _ = tp_inputs(TP_CASES[0])
    out = {}
    for label, bad in (("V", 1001), ("negative", -1)):
        targets = torch.zeros(logits.shape[0], dtype=torch.long)
        targets[4] = bad
        start = (0, 500)[rank]
        local = logits[:, start : start + (500, 501)[rank]].contiguous()
        try:
            ops.token_logprobs(local, targets, vocab_start=start, tp_group=dist.group.WORLD)
            out[label] = None
        except ValueError as exc:
            out[label] = str(exc)
    return out


# ---------------------------------------------------------------------------------------------------
# Context parallelism: every rank holds a part of every sequence
# ---------------------------------------------------------------------------------------------------

CP_LENGTHS = [5, 3, 1, 0, 6, 4, 7]  # B = 7, T = 26; a one-token and an empty sequence
CP_EPS = {"cispo": (0.1, 0.2), "gmpo": (0.1, 0.1)}


def cp_inputs():
    """Full batch: logp, old_logp (clipping both ways), advantages [B], per-token advantages [T],
    cu_seqlens, loss_mask (sequence 5 has no counted token), values and weights for segment_mean."""
    g = torch.Generator().manual_seed(1234)
    T = sum(CP_LENGTHS)
    cu = torch.tensor([0] + torch.tensor(CP_LENGTHS).cumsum(0).tolist())
    logp = -(torch.rand(T, generator=g) * 2 + 0.1)
    seq_delta = torch.tensor([0.05, -0.05, 0.0, 0.0, 0.3, -0.05, 0.0])  # GSPO-level log-ratio per sequence
    delta = seq_delta.repeat_interleave(torch.tensor(CP_LENGTHS)) + 0.2 * torch.randn(T, generator=g) * (
        seq_delta.repeat_interleave(torch.tensor(CP_LENGTHS)) != 0
    )
    old = logp - delta
    mask = (torch.rand(T, generator=g) < 0.8).float()
    mask[cu[:-1][torch.tensor(CP_LENGTHS) > 0]] = 1.0
    mask[cu[5] : cu[6]] = 0.0
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.0, -1.5])
    adv_tok = adv.repeat_interleave(torch.tensor(CP_LENGTHS)) + 0.3 * torch.randn(T, generator=g)
    values = torch.randn(T, generator=g)
    w = torch.randn(len(CP_LENGTHS), generator=g)
    return dict(logp=logp, old=old, adv=adv, adv_tok=adv_tok, cu=cu, mask=mask, values=values, w=w)


def cp_index(rank, world=2):
    """Token indices (into the full batch) that ``rank`` holds, and its local cu_seqlens.

    Rank 0 holds the first ceil(n/3) tokens of each sequence, rank 1 the rest: uneven, one rank holds
    nothing of the one-token sequence, neither holds anything of the empty one.
    """
    idx, lens, t = [], [], 0
    for n in CP_LENGTHS:
        k = -(-n // 3)
        part = range(t, t + k) if rank == 0 else range(t + k, t + n)
        idx.extend(part)
        lens.append(len(part))
        t += n
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return torch.tensor(idx, dtype=torch.long), cu


def _cp_compute(batch, cu, idx, group, use_reference):
    """segment_mean and policy_loss (all variants) on the tokens ``idx`` (all of them on one rank)."""
    from gspo_mcore import ops
    from gspo_mcore.algo import DEFAULT_EPS, policy_loss

    B = len(CP_LENGTHS)
    out = {}
    with ops.use_reference(use_reference):
        v = batch["values"][idx].clone().requires_grad_(True)
        mean, count = ops.segment_mean(v, cu, batch["mask"][idx], cp_group=group)
        (mean * batch["w"]).sum().backward()
        out["segment_mean"] = (mean.detach(), count, None, v.grad)
        for variant, adv in (
            ("gspo", batch["adv"]),
            ("gspo_token", batch["adv"]),
            ("gspo_token", None),
            ("grpo", batch["adv"]),
            ("sapo", batch["adv"]),
            ("cispo", batch["adv"]),
            ("gmpo", batch["adv"]),
        ):
            if adv is None:
                adv, key = batch["adv_tok"][idx], "gspo_token-per-token"
            else:
                key = variant
            lp = batch["logp"][idx].clone().requires_grad_(True)
            # CISPO and GMPO with ranges this batch's ratios reach (their paper defaults would not clip here)
            eps_low, eps_high = CP_EPS.get(variant, DEFAULT_EPS[variant])
            loss, metrics = policy_loss(
                lp,
                batch["old"][idx],
                adv,
                cu,
                batch["mask"][idx],
                variant=variant,
                eps_low=eps_low,
                eps_high=eps_high,
                num_sequences=B,
                cp_group=group,
            )
            loss.backward()
            out[key] = (loss.detach(), None, metrics, lp.grad)
    return out


def cp_single_rank(use_reference):
    batch = cp_inputs()
    return _cp_compute(batch, batch["cu"], torch.arange(sum(CP_LENGTHS)), None, use_reference)


def _cp_rank(rank, world, use_reference):
    idx, cu = cp_index(rank, world)
    assert cu[-1] != len(CP_LENGTHS)  # local T != B: [T]-shaped advantages stay unambiguous
    return _cp_compute(cp_inputs(), cu, idx, dist.group.WORLD, use_reference)


# ---------------------------------------------------------------------------------------------------
# Everything at once (one spawn: starting ranks costs more than the checks)
# ---------------------------------------------------------------------------------------------------


def all_checks(rank, world):
    from gspo_mcore import ops

    backends = [True] + ([False] if ops.HAVE_EXTENSION else [])
    out = {"tp": {}, "cp": {}}
    for use_ref in backends:
        with ops.use_reference(use_ref):
            for case in TP_CASES:
                out["tp"][(case[0], use_ref)] = _tp_rank(rank, world, case)
            out["tp_out_of_range", use_ref] = _tp_out_of_range(rank, world)
        out["cp"][use_ref] = _cp_rank(rank, world, use_ref)
    return out
