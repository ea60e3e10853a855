"""Worker for the LoRA tests: runs several layouts in one launch (1, 2 or 4 ranks).

For each case: build the toy model with LoRA adapters, check what is frozen and what the optimizer holds,
compare the log-probs at initialisation (``B = 0``) with the base model's (bit for bit), then one rollout batch of
2 mini-batches (2 optimizer steps, as the invariance tests). A case with ``"save": true`` (1 rank) saves its
results and the adapters as the reference; every other case compares its adapter shards with it. After the
update: the base weights unchanged, the in-process engine's log-probs (KV-cache decode of the live modules)
against the learner's, and a merged export (``W + (alpha/r) B A``) loaded into a model without LoRA against the
learner's log-probs. Rank 0 writes one JSON line per case.

    python -m torch.distributed.run --nproc_per_node 2 lora_worker.py --ref DIR --out FILE \
        --cases '[{"name": "tp2", "tp": 2}]'
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from helpers import learner_toy as toy
from helpers.worker_cases import run_cases
from invariance_worker import BATCH, MAX_TOKENS, compare_with_reference, token_figures

LORA = dict(rank=4, alpha=8.0, target_modules=["all-linear"], init_seed=11)
ADAM_EPS = 1e-5
"""Adam's eps of the LoRA runs, 10x the invariance tests' (see invariance_worker.ADAM_EPS for the mechanism). With
their 1e-6 the adapters after 2 updates differed between TP2 and 1 rank by 8.7e-6 against PARAM_ATOL 1e-5: the
element was B of layer 1's linear_proj (row-parallel) at [27, 3], whose first-mini-batch gradient is -2.44e-7 on 1
rank and -2.57e-7 at TP2 (its partial ``A x`` summed over TP in another order: 1.4e-8 of fp32 noise on a gradient
that cancels to 1e-5 of its key's largest, 0.041). Adam's first step, lr * g / (|g| + eps), has slope lr * eps /
(|g| + eps)^2, up to lr / eps = 1e3 near g = 0, which turns that noise into lr * 1.4e-8 * eps / (1.24e-6)^2 =
9e-6 of parameter. A LoRA gradient has many such elements (B ~ N(0, 0.05) and A are small: 1% of the
first-mini-batch gradient's elements are below 1.3e-5 in size), so the margin was thin by chance, not by a layout
error (the gradients themselves agree within 5e-8). eps = 1e-5 divides that slope by up to 10: TP2 then differs
by 1.3e-6 (the same element)."""
B_STD = 0.05
"""Tests fill ``B`` with ``N(0, B_STD)`` after the bit-exact check at ``B = 0``, so that the first mini-batch's
gradient reaches ``A`` too (with ``B = 0`` it is zero)."""


def adapter_grad_shards(model):
    """``toy.local_shards`` of the adapters' ``main_grad`` (the DP-reduced gradients), adapter keys only."""
    from gspo_mcore.learner.lora import is_adapter

    params = [p for chunk in model for p in chunk.parameters() if p.requires_grad]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        return [s for s in toy.local_shards(model) if is_adapter(s[0])]
    finally:
        for p, d in zip(params, saved):
            p.data = d


def engine_logprobs(model, layout, samples):
    """The in-process engine's log-probs of ``tokens[1:]`` per sample: its KV-cache decode model, fed each
    sample's own tokens (prefill of the first token, then one step per token)."""
    from gspo_mcore.learner.inference import decode_model

    dm = decode_model(model, layout)
    out = []
    for s in samples:
        t = s.tokens.long()
        session, logits = dm.start(t[None, :1], torch.tensor([1]), len(t))
        lps = [torch.log_softmax(logits.float(), -1)[0, t[1]]]
        for i in range(1, len(t) - 1):
            logits = session.step(t[i : i + 1])
            lps.append(torch.log_softmax(logits.float(), -1)[0, t[i + 1]])
        out.append(torch.stack(lps).cpu())
    return out


def projection_weights(peft) -> list[str]:
    """The Hugging Face weight names (``model.layers.0.self_attn.q_proj.weight``...) a PEFT state dict adapts."""
    from gspo_mcore.learner.hf.export_peft import PEFT_PREFIX

    return sorted({k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] + ".weight" for k in peft})


def run_case(case, args):
    from gspo_mcore.algo.loss_config import LossConfig
    from gspo_mcore.learner.batching import split_minibatches
    from gspo_mcore.learner.forward import forward_logprobs
    from gspo_mcore.learner.hf.export import hf_state_dict
    from gspo_mcore.learner.hf.export_peft import PEFT_PREFIX, peft_tensors
    from gspo_mcore.learner.hf.load import load_hf_weights
    from gspo_mcore.learner.lora import LoraConfig, adapter_parameters, global_adapters, init_adapters, is_adapter
    from gspo_mcore.learner.model import build_model, unwrap
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.optimizer import OptimConfig, build_optimizer, zero_grads
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
    from gspo_mcore.learner.step import BatchConfig, StepSettings, forward_backward, train_step

    t0 = time.time()
    arch = load_hf_config(toy.MODELS[case.get("model", "dense")])
    pc = ParallelConfig(tensor=case.get("tp", 1), pipeline=case.get("pp", 1))
    layout = init_parallel(pc, arch, seed=1234)
    distopt = case.get("distopt", False)
    lora = LoraConfig(**{**LORA, **case.get("lora", {})})
    # "groups": samples sharing their prompts in groups; "share": batch.share_prompt (its reference, "ref", is the
    # same grouped batch unshared)
    samples = toy.toy_samples(vocab=arch.vocab_size, shared_prompts=case.get("groups", False), **BATCH)
    share = case.get("share", False)
    fwd = dict(max_tokens=MAX_TOKENS, packing="padded", share_prompt=share)
    ref_file = os.path.join(args.ref, f"lora-{case.get('ref', 'plain')}.pt")

    base = build_model(arch, pc, seed=7)
    base_logp = torch.cat(forward_logprobs(base, samples, layout, **fwd))
    model = build_model(arch, pc, seed=7, use_distributed_optimizer=distopt, lora=lora)
    logp0 = torch.cat(forward_logprobs(model, samples, layout, **fwd))
    init_bitwise = bool(torch.equal(logp0, base_logp))

    trainable = [n for chunk in model for n, p in unwrap(chunk).named_parameters() if p.requires_grad]
    adapters = adapter_parameters(model)
    optim = OptimConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.01, adam_eps=ADAM_EPS, use_distributed_optimizer=distopt)
    optimizer, scheduler = build_optimizer(model, optim)
    opt_numel = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    if distopt:  # each DP rank holds a shard of the adapters' fp32 state
        n = torch.tensor([opt_numel])
        dist.all_reduce(n, group=layout.dp_group)
        opt_numel = int(n)
    frozen_grad_buffers = sum(
        1 for chunk in model for p in chunk.parameters() if hasattr(p, "main_grad") and not p.requires_grad
    )

    init_adapters(model[0], seed=lora.init_seed + 1, b_std=B_STD)  # A and B redrawn, B != 0 from here on
    initial = toy.local_shards(model)
    logp = forward_logprobs(model, samples, layout, **fwd)
    batch = toy.with_offset_old_logprobs(samples, logp, "gspo")
    loss_cfg = LossConfig(variant="gspo")
    parts = split_minibatches(len(batch), 2)
    forward_backward(model, [batch[i] for i in parts[0]], layout, loss_cfg, **fwd)
    grads = None if distopt else adapter_grad_shards(model)
    zero_grads(model, optimizer)
    metrics = train_step(
        model,
        optimizer,
        scheduler,
        batch,
        layout,
        StepSettings(
            loss=loss_cfg,
            batch=BatchConfig(num_minibatches=2, max_tokens_per_microbatch=MAX_TOKENS, share_prompt=share),
        ),
    )
    final = toy.local_shards(model)
    base_changed = max(float((a[3] - b[3]).abs().max()) for a, b in zip(initial, final) if not is_adapter(a[0]))
    adapters_moved = max(float((a[3] - b[3]).abs().max()) for a, b in zip(initial, final) if is_adapter(a[0]))
    logp_after = forward_logprobs(model, samples, layout, **fwd)
    result = dict(
        case=case["name"],
        world=layout.world_size,
        init_bitwise=init_bitwise,
        trainable=sorted(trainable),
        num_adapters=len(adapters),
        adapter_numel=sum(p.numel() for _, p in adapters),
        opt_numel=opt_numel,
        frozen_grad_buffers=frozen_grad_buffers,
        losses=[m["loss"] for m in metrics],
        grad_norms=[m["grad_norm"] for m in metrics],
        base_changed=base_changed,
        adapters_moved=adapters_moved,
        **token_figures(parts, batch, MAX_TOKENS, share),
    )
    if layout.pp_size == 1:
        # the in-process engine decodes from the live modules (adapters applied, unmerged)
        eng = engine_logprobs(model, layout, samples)
        result["engine_diff"] = max(float((a - b).abs().max()) for a, b in zip(eng, logp_after))
    # merged export, loaded into a model without LoRA
    state = hf_state_dict(model, arch, layout=layout)
    plain = build_model(arch, pc, seed=3)
    load_hf_weights(plain, state, arch, layout=layout)
    merged_logp = forward_logprobs(plain, samples, layout, **fwd)
    result["merged_diff"] = max(float((a - b).abs().max()) for a, b in zip(merged_logp, logp_after))
    result["export_has_adapters"] = any("lora" in k for k in state)
    # the PEFT export (full adapters gathered from this layout, fused groups split into Hugging Face projections)
    # applied to the base's weights in pure torch equals the merged export
    peft = peft_tensors(global_adapters(model), arch)
    base_state = hf_state_dict(base, arch, layout=layout)
    merge_diffs = {}
    for name in projection_weights(peft):
        a = peft[f"{PEFT_PREFIX}{name.removesuffix('.weight')}.lora_A.weight"]
        b = peft[f"{PEFT_PREFIX}{name.removesuffix('.weight')}.lora_B.weight"]
        w = base_state[name] + lora.scale * b @ a
        merge_diffs[name] = float((w - state[name]).abs().max())
    result.update(peft_names=sorted(peft), peft_merge_diff=max(merge_diffs.values()))
    flat_after = torch.cat(logp_after)
    adapter_final = [s for s in final if is_adapter(s[0])]
    if case.get("save"):
        torch.save(
            {
                "final": toy.assemble(adapter_final),
                "grads": toy.assemble(grads),
                "logp": flat_after,
                "result": result,
            },
            ref_file,
        )
    else:
        ref = torch.load(ref_file)
        result.update(compare_with_reference(ref, final=adapter_final, logp=flat_after, grads=grads))
    result["seconds"] = round(time.time() - t0, 2)
    return result


def run_layer_case(case, args):
    """One LoRA linear (``case["column"]``: column- or row-parallel) in float64 against a pure-torch reference:
    the output, and the gradients of ``A``, ``B`` and the input, with the ``alpha / rank`` scale (TP = world)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from gspo_mcore.learner.lora import LoraConfig, adapt_linear
    from gspo_mcore.learner.model_config import load_hf_config, transformer_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    tp = case.get("tp", 1)
    arch = load_hf_config(toy.MODELS["dense"])
    layout = init_parallel(ParallelConfig(tensor=tp), arch, seed=1234)
    config = transformer_config(arch, tensor=tp, on_gpu=False, bf16=False)
    config.params_dtype = torch.float64
    n_in, n_out, rank, alpha = 12, 16, 3, 5.0
    p = float(case.get("dropout", 0.0))  # on the adapter's input only, in the training forward only
    cfg = LoraConfig(rank=rank, alpha=alpha, dropout=p)
    column = case["column"]
    gen = torch.Generator().manual_seed(5)
    W, A, B = (
        torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((n_out, n_in), (rank, n_in), (n_out, rank))
    )
    x = torch.randn(5, 2, n_in, generator=gen, dtype=torch.float64)
    G = torch.randn(5, 2, n_out, generator=gen, dtype=torch.float64)
    r = layout.tp_rank
    rows, cols = slice(r * n_out // tp, (r + 1) * n_out // tp), slice(r * n_in // tp, (r + 1) * n_in // tp)
    kw = dict(config=config, init_method=lambda w: None, bias=False)
    if column:
        layer = ColumnParallelLinear(n_in, n_out, gather_output=False, **kw)
    else:
        layer = RowParallelLinear(n_in, n_out, input_is_parallel=True, skip_bias_add=False, **kw)
    layer.weight.requires_grad_(False)  # frozen, as attach() leaves every base weight
    adapt_linear(layer, cfg, column=column)
    with torch.no_grad():
        layer.weight.copy_(W[rows] if column else W[:, cols])
        layer.lora_A.copy_(A if column else A[:, cols])
        layer.lora_B.copy_(B[rows] if column else B)
    x_in = (x if column else x[..., cols]).clone().requires_grad_(True)
    layer.train()
    torch.manual_seed(99)  # the dropout mask's draw (the reference redraws it from the same seed)
    out, _ = layer(x_in)
    (out * (G[..., rows] if column else G)).sum().backward()

    # the reference form: base(x) + (alpha/r) B A (mask * x / (1 - p)); the base sees the undropped x
    mask = torch.ones_like(x)
    if p > 0:
        if tp != 1:
            raise ValueError("the dropout case runs at 1 rank (the mask is drawn per rank)")
        torch.manual_seed(99)
        mask = torch.nn.functional.dropout(torch.ones_like(x), p=p, training=True)
    ref = [t.clone().requires_grad_(True) for t in (x, A, B)]
    ref_out = ref[0] @ W.t() + (alpha / rank) * ((ref[0] * mask) @ ref[1].t()) @ ref[2].t()
    (ref_out * G).sum().backward()
    extra = {}
    if p > 0:
        undropped = (x @ W.t() + (alpha / rank) * (x @ A.t()) @ B.t()).detach()
        with torch.no_grad():  # forward-only (log-probs, the engine's decode): no dropout, even in train mode
            no_grad_out = layer(x_in.detach())[0]
        layer.eval()  # eval mode: no dropout, even with a gradient
        eval_out = layer(x_in.detach())[0]
        layer.train()
        extra = dict(
            dropped=float((mask == 0).double().mean()),
            no_grad_out=float((no_grad_out - undropped).abs().max()),
            eval_out=float((eval_out - undropped).abs().max()),
            out_vs_undropped=float((out.detach() - undropped).abs().max()),
        )
    ref_x, ref_a, ref_b = (t.grad for t in ref)
    if column:
        checks = dict(
            out=(out, ref_out.detach()[..., rows]),
            grad_A=(layer.lora_A.grad, ref_a),
            grad_B=(layer.lora_B.grad, ref_b[rows]),
            grad_x=(x_in.grad, ref_x),
        )
    else:
        checks = dict(
            out=(out, ref_out.detach()),
            grad_A=(layer.lora_A.grad, ref_a[:, cols]),
            grad_B=(layer.lora_B.grad, ref_b),
            grad_x=(x_in.grad, ref_x[..., cols]),
        )
    diffs = torch.tensor([float((a - b).abs().max()) for a, b in checks.values()], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    scale = max(float(b.abs().max()) for _, b in checks.values())
    return dict(case=case["name"], world=layout.world_size, scale=scale, **dict(zip(checks, diffs.tolist())), **extra)


def run_refusal_case(case, args):
    """Build the toy model with ``case["lora"]``; the error message (or ``None``) is the result."""
    from gspo_mcore.learner.lora import LoraConfig
    from gspo_mcore.learner.model import build_model
    from gspo_mcore.learner.model_config import load_hf_config
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel

    arch = load_hf_config(toy.MODELS[case.get("model", "dense")])
    pc = ParallelConfig(tensor=case.get("tp", 1))
    init_parallel(pc, arch, seed=1234)
    try:
        build_model(arch, pc, seed=7, lora=LoraConfig(**{**LORA, **case["lora"]}))
    except ValueError as exc:
        return dict(case=case["name"], error=str(exc))
    return dict(case=case["name"], error=None)


def run_any(case, args):
    kind = case.get("kind", "train")
    return {"train": run_case, "layer": run_layer_case, "refuse": run_refusal_case}[kind](case, args)


if __name__ == "__main__":
    run_cases(run_any, {"--ref": "folder of the 1-rank reference results"})
