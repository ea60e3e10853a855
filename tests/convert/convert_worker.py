"""Worker for the layout tests: several (model, layout) cases in one 2-rank launch.

For each case, on every rank:
1. build the model with layout-independent random weights (``init_weights``) and gather it with
   ``hf_buckets``: the digests must equal those of the same model gathered on every other layout, in
   particular the unsharded one (``dp2``: every rank holds the whole model);
2. load the Hugging Face checkpoint (``load_hf_weights``), run the Megatron forward on the reference
   tokens and compare with transformers' logits (max |diff|), gather again (must equal the checkpoint
   bit for bit), in small buckets whose contents must be identical on every rank;
3. optionally save a distributed checkpoint (``save``), and/or load the one a previous case saved on
   another layout (``load``) into freshly initialised weights and gather it (must equal the checkpoint).

    python -m torch.distributed.run --nproc_per_node 2 convert_worker.py --cases JSON --out FILE
Rank 0 writes one JSON line per case.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from convert_models import digest
from helpers.worker_cases import run_cases

BUCKET_BYTES = 24 * 1024  # several buckets per model, each mixing tensors of both pipeline stages


def megatron_logits(model, layout, toks: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [B, L, V] on the last pipeline stage (None elsewhere), via Megatron's schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    B, L = toks.shape
    positions = torch.arange(L).expand(B, L)
    mask = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)[None, None]
    store = {}

    def loss_func(output):
        full = gather_from_tensor_model_parallel_region(output) if layout.tp_size > 1 else output
        store["logits"] = full.detach().float().clone()
        return output.sum() * 0.0, {}

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        return chunk(toks, positions, mask), loss_func

    for chunk in model:
        chunk.eval()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=model,
        num_microbatches=1,
        seq_length=L,
        micro_batch_size=B,
        forward_only=True,
    )
    return store.get("logits")


def gather_digests(model, arch, *, dtype=None) -> tuple[dict[str, str], dict]:
    """Digests of every exported tensor, and facts about the buckets (same on all ranks? within budget?)."""
    from gspo_mcore.learner.hf.export import hf_buckets

    digests, buckets = {}, []
    for bucket in hf_buckets(model, arch, bucket_bytes=BUCKET_BYTES, dtype=dtype):
        entry = [(name, digest(t)) for name, t in bucket]
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        buckets.append((entry, nbytes))
        digests.update(entry)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [e for e, _ in buckets])
    facts = dict(
        num_buckets=len(buckets),
        identical_on_all_ranks=all(o == everyone[0] for o in everyone),
        over_budget=[n for e, n in buckets if n > BUCKET_BYTES and len(e) > 1],
        num_tensors=sum(len(e) for e, _ in buckets),
    )
    return digests, facts


def run_case(case, args):
    from gspo_mcore.convert.mcore_checkpoint import load_model, save_model
    from gspo_mcore.learner.hf.load import load_hf_weights
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    t0 = time.time()
    hf_dir = case["hf"]
    arch = load_hf_config(hf_dir)
    pc = ParallelConfig(tensor=case.get("tp", 1), pipeline=case.get("pp", 1), expert=case.get("ep", 1))
    layout = init_parallel(pc, arch, seed=1234)
    model = build_model(arch, pc, seed=11)
    result = dict(case=case["name"], model=case["model"], layout=case["layout"])
    result["seed_digests"], _ = gather_digests(model, arch)

    load_hf_weights(model, hf_dir)
    ref = torch.load(os.path.join(hf_dir, "ref.pt"))
    logits = megatron_logits(model, layout, ref["tokens"])
    diff = torch.zeros(2)
    if logits is not None:
        diff[0] = (logits - ref["logits"]).abs().max()
        diff[1] = ref["logits"].abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    result["logits_max_abs_diff"], result["logits_max_abs"] = float(diff[0]), float(diff[1])
    result["import_digests"], result["buckets"] = gather_digests(model, arch)
    if case.get("bf16"):
        result["bf16_digests"], _ = gather_digests(model, arch, dtype=torch.bfloat16)

    if case.get("load"):
        fresh = build_model(arch, pc, seed=99)
        load_model(fresh, os.path.join(args.ckpt_root, case["load"], "model"))
        result["reload_digests"], _ = gather_digests(fresh, arch)
        result["reloaded_from"] = case["load"]
    if case.get("save"):
        save_model(model, os.path.join(args.ckpt_root, case["name"]), hf_dir=hf_dir)
    result["seconds"] = round(time.time() - t0, 2)
    return result


if __name__ == "__main__":  # the checkpoint writer re-imports this module in a helper process
    run_cases(run_case, {"--ckpt-root": "folder for the cases' distributed checkpoints"})
