"""Gather a sharded Megatron model into full Hugging Face tensors, in byte-bounded buckets.

The core of the Megatron -> Hugging Face converter and of the rollout weight sync: every rank of every
layout (TP, PP, EP, expert-TP, DP) calls :func:`hf_buckets` and gets the same sequence of buckets, each a
list of ``(hf_name, tensor)`` whose total size stays within ``bucket_bytes`` (a tensor larger than that
gets a bucket of its own). How each piece travels:

- tensor parallelism: ``all_gather`` over the TP group (expert-TP group for experts), then
  :func:`~gspo_mcore.learner.hf.mapping.tp_unshard` (plain concatenation, except SwiGLU's ``linear_fc1``
  whose per-rank ``[gate_r; up_r]`` blocks are regrouped into ``[gate; up]``);
- expert parallelism: ``all_gather`` over the EP group (each rank holds ``num_experts / EP`` experts,
  rank ``r``'s ``j``-th being global expert ``r * num_experts / EP + j``);
- pipeline parallelism: the stage that owns a bucket's tensors broadcasts them over the PP group, one
  flat buffer per (stage, dtype);
- data parallelism: nothing; every replica gathers from its own TP/EP/PP layout.

Every collective moves equal-sized tensors (gloo cannot all-gather unequal ones). The plan (names,
shapes, dtypes, owning stage) is exchanged once per call with ``all_gather_object`` over the PP group; pass
a :func:`export_plan` result as ``plan=`` to skip that. Buckets hold views of gathered buffers: copy
a tensor to keep it beyond the next bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gspo_mcore.learner.hf.mapping import MegatronParam, to_hf, tp_unshard
from gspo_mcore.learner.hf.sharding import LocalParam, local_parameters, tp_split
from gspo_mcore.learner.lora import merged_weight
from gspo_mcore.learner.parallel import Layout, current_layout

DEFAULT_BUCKET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class ExportItem:
    """One Hugging Face tensor in the export order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stage: int
    """The pipeline stage that holds it."""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _units(local: list[LocalParam], layout: Layout) -> list[tuple[LocalParam, list[MegatronParam]]]:
    """Per local parameter, the full Megatron parameters it yields after the TP/EP gathers."""
    out = []
    for lp in local:
        p = lp.param
        if p.kind.expert and layout.ep_size > 1:
            n_local = _num_local_experts(local, p.layer)
            j = p.expert - layout.ep_rank * n_local
            out.append((lp, [MegatronParam(p.kind, p.layer, r * n_local + j) for r in range(layout.ep_size)]))
        else:
            out.append((lp, [p]))
    return out


def _num_local_experts(local: list[LocalParam], layer: int) -> int:
    return len({lp.param.expert for lp in local if lp.param.kind.expert and lp.param.layer == layer})


def _full_shape(lp: LocalParam, layout: Layout) -> tuple[int, ...]:
    size, _, _ = tp_split(layout, lp.param)
    shape = list(lp.tensor.shape)
    if size > 1:
        shape[lp.param.kind.tp_dim] *= size
    return tuple(shape)


def export_plan(model, arch, *, dtype: torch.dtype | None = None, layout: Layout | None = None) -> list[ExportItem]:
    """The Hugging Face tensors of ``model`` in export order (a collective over the PP group).
    ``layout``: the model's parallel layout (default: the current one)."""
    layout = layout or current_layout()
    mine = []
    for lp, params in _units(local_parameters(model, layout), layout):
        meta = torch.empty(_full_shape(lp, layout), dtype=dtype or lp.tensor.dtype, device="meta")
        for p in params:
            mine += [(name, tuple(t.shape), str(t.dtype)) for name, t in to_hf(p, meta, arch)]
    if layout.pp_size > 1:
        stages = [None] * layout.pp_size
        dist.all_gather_object(stages, mine, group=layout.pp_group)
    else:
        stages = [mine]
    items = [
        ExportItem(name, s, getattr(torch, d.removeprefix("torch.")), stage)
        for stage, entries in enumerate(stages)
        for name, s, d in entries
    ]
    names = [it.name for it in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise RuntimeError(f"export plan names some Hugging Face tensors twice: {dup[:5]}")
    return items


def _gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


@torch.no_grad()
def _produce(model, arch, layout: Layout, dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's stage's Hugging Face tensors, in plan order (runs the TP/EP collectives lazily)."""
    for lp, params in _units(local_parameters(model, layout), layout):
        t = merged_weight(lp.tensor).detach()  # W + (alpha/r) B A where LoRA adapts it (this rank's shard)
        size, _, group = tp_split(layout, lp.param)
        if size > 1:
            t = tp_unshard(lp.param.kind, _gather(t, size, group))
        fulls = _gather(t, layout.ep_size, layout.ep_group) if len(params) > 1 else [t]
        for p, full in zip(params, fulls):
            for name, hf in to_hf(p, full, arch):
                yield name, (hf if dtype is None else hf.to(dtype)).contiguous()


def _cut(plan: list[ExportItem], bucket_bytes: int) -> Iterator[list[ExportItem]]:
    bucket, size = [], 0
    for it in plan:
        if bucket and size + it.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(it)
        size += it.nbytes
    if bucket:
        yield bucket


def hf_buckets(
    model,
    arch,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    plan: list[ExportItem] | None = None,
    layout: Layout | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full Hugging Face ``(name, tensor)`` buckets of ``model``; every rank must iterate to the end.

    ``arch``: the :class:`~gspo_mcore.learner.ModelArch`; ``dtype``: cast to it (e.g. bf16 for the
    rollout engine), default the parameters' dtype. Tensors are on the parameters' device.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    layout = layout or current_layout()
    plan = export_plan(model, arch, dtype=dtype, layout=layout) if plan is None else plan
    device = next(p.tensor.device for p in local_parameters(model, layout))
    producer = _produce(model, arch, layout, dtype)
    for bucket in _cut(plan, bucket_bytes):
        out = []
        start = 0
        while start < len(bucket):
            stage = bucket[start].stage
            end = start
            while end < len(bucket) and bucket[end].stage == stage:
                end += 1
            items = bucket[start:end]
            if stage == layout.pp_rank:
                tensors = []
                for it in items:
                    name, t = next(producer)
                    if name != it.name or tuple(t.shape) != it.shape:
                        raise RuntimeError(
                            f"export out of step with its plan: made {name} {tuple(t.shape)}, "
                            f"plan says {it.name} {it.shape}"
                        )
                    tensors.append(t)
            else:
                tensors = None
            if layout.pp_size > 1:
                tensors = _broadcast(items, tensors, stage, layout, device)
            out += [(it.name, t) for it, t in zip(items, tensors)]
            start = end
        yield out
    if next(producer, None) is not None:
        raise RuntimeError("export made more tensors than its plan lists")


def _broadcast(items: list[ExportItem], tensors, stage: int, layout: Layout, device) -> list[torch.Tensor]:
    """Send ``tensors`` (held by ``stage``) to every stage: one flat buffer per dtype."""
    result: list[torch.Tensor | None] = [None] * len(items)
    for dtype in dict.fromkeys(it.dtype for it in items):
        idx = [i for i, it in enumerate(items) if it.dtype == dtype]
        numels = [items[i].nbytes // dtype.itemsize for i in idx]
        if tensors is not None:
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
        dist.broadcast(flat, group=layout.pp_group, group_src=stage)
        for i, part in zip(idx, flat.split(numels)):
            result[i] = part.view(items[i].shape)
    return result


def hf_state_dict(
    model, arch, *, dtype: torch.dtype | None = None, layout: Layout | None = None
) -> dict[str, torch.Tensor]:
    """All Hugging Face tensors of ``model`` at once, on every rank (small models, tests)."""
    return {name: t.clone() for bucket in hf_buckets(model, arch, dtype=dtype, layout=layout) for name, t in bucket}
