"""Worker for the CPU bf16 tests (``model.options.cpu_bf16``): one update of a toy model in fp32, in fp32 under
torch's bf16 autocast (an eager bf16 computation of the same step, the yardstick), and in Megatron's bf16
mixed precision, from the same initial weights and the same batch, on 1 or 2 (DP2) ranks.

Per case, rank 0 writes one JSON line with what the test asserts on:

- dtypes: the model's matrices are bf16 (norm weights stay fp32), every parameter the optimizer updates (the
  master weights), its gradient and Adam's two moments are fp32, the log-probs are fp32;
- the gaps to fp32 of the log-probs, the loss, the gradient (before clipping) and the gradient norm, for bf16 and
  for autocast (the test bounds the first by a multiple of the second);
- the update: the fp32 master weights after the step against Adam's first step recomputed here in float64 from
  the clipped fp32 gradient (bf16 master weights would be off by their rounding, about 1e-4 here); the model's
  bf16 weights against the masters rounded to bf16; DP2: the ranks' master weights agree;
- ``checkpoint`` cases: save after the update, update again, load: masters, model weights and Adam's state come
  back exactly.

    python -m torch.distributed.run --nproc_per_node 2 bf16_worker.py --out FILE --ckpt DIR \
        --cases '[{"name": "dense-dp2", "model": "dense"}]'
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from helpers import learner_toy as toy
from helpers.worker_cases import run_cases

LR = 1e-3
ADAM_EPS = 1e-6
MAX_TOKENS = 1000
BATCH = dict(num_samples=12, seed=3)


def build(arch, *, bf16: bool):
    from gspo_mcore.algo import LossConfig
    from gspo_mcore.learner.learner import Learner
    from gspo_mcore.learner.model import ModelOptions
    from gspo_mcore.learner.optimizer import OptimConfig
    from gspo_mcore.learner.step import BatchConfig

    return Learner.build(
        arch,
        options=ModelOptions(cpu_bf16=bf16),
        optim=OptimConfig(lr=LR, adam_eps=ADAM_EPS, weight_decay=0.01, clip_grad=1.0),
        loss=LossConfig(variant="grpo"),
        batch=BatchConfig(num_minibatches=1, max_tokens_per_microbatch=MAX_TOKENS),
        init_seed=7,
    )


def named(learner) -> dict[str, torch.nn.Parameter]:
    return dict(learner.model[0].named_parameters())


class GradCapture:
    """Around ``learner.optimizer.step``: keeps every parameter's reduced gradient (``main_grad``, fp32) as it is
    before clipping; ``skip``: no step is taken (the update reports failure and nothing changes)."""

    def __init__(self, learner, *, skip: bool = False):
        self.learner, self.skip, self.grads = learner, skip, {}

    def __enter__(self):
        opt = self.learner.optimizer
        real = opt.step

        def step():
            self.grads = {n: p.main_grad.detach().clone() for n, p in named(self.learner).items()}
            return (False, None, None) if self.skip else real()

        opt.step = step
        return self

    def __exit__(self, *exc):
        del self.learner.optimizer.step


def masters(learner) -> dict[str, torch.Tensor]:
    """Each model parameter's optimizer-side tensor (the fp32 master copy of a bf16 parameter, the parameter itself
    when it is fp32), by name."""
    out = {}
    for name, p in named(learner).items():
        out[name] = getattr(p, "main_param", p)
    return out


def adam_states(learner):
    """``(master, state)`` of every parameter the inner torch optimizers update."""
    opt = learner.optimizer
    out = []
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                out.append((p, group, inner.optimizer.state.get(p, {})))
    return out


def max_gap(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def logp_gap(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def run_case(case, args):
    from gspo_mcore.learner.checkpoint import CheckpointConfig, Checkpointer
    from gspo_mcore.learner.model_config import load_hf_config

    arch = load_hf_config(toy.MODELS[case["model"]])
    samples = toy.toy_samples(vocab=arch.vocab_size, **BATCH)

    # fp32, and the same model's step under torch's bf16 autocast (the step skipped: the weights stay)
    ref = build(arch, bf16=False)
    lp32 = ref.logprobs(samples)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_ac = ref.logprobs(samples)
    batch = toy.with_offset_old_logprobs(samples, lp32, "grpo")
    with GradCapture(ref, skip=True) as cap, torch.autocast("cpu", dtype=torch.bfloat16):
        m_ac = ref.train(batch)[0]
    g_ac = cap.grads
    with GradCapture(ref) as cap:
        m32 = ref.train(batch)[0]
    g32 = cap.grads

    # Megatron's bf16 mixed precision from the same initial weights
    learner = build(arch, bf16=True)
    params = named(learner)
    dtypes = {n: str(p.dtype).removeprefix("torch.") for n, p in params.items()}
    init_masters = {n: m.detach().clone() for n, m in masters(learner).items()}
    lp16 = learner.logprobs(samples)
    with GradCapture(learner) as cap:
        m16 = learner.train(batch)[0]
    g16 = cap.grads
    states = adam_states(learner)

    # Adam's first step in float64 from the clipped fp32 gradient each master holds after the step
    update_err, bf16_master_err, state_dtypes, grad_dtypes = 0.0, 0.0, set(), set()
    for master, group, state in states:
        state_dtypes |= {str(v.dtype) for k, v in state.items() if torch.is_tensor(v) and k != "step"}
        grad_dtypes.add(str(master.grad.dtype))
    after = masters(learner)
    for name, master in after.items():
        _, group, state = next(s for s in states if s[0] is master)
        g = master.grad.double()
        b1, b2 = group["betas"]
        m_hat = (1 - b1) * g / (1 - b1)
        v_hat = (1 - b2) * g * g / (1 - b2)
        before = init_masters[name].double()
        want = before * (1 - group["lr"] * group["weight_decay"]) - group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])
        update_err = max(update_err, float((master.double() - want).abs().max()))
        # what bf16 master weights would be off by: the updated weights rounded to bf16
        bf16_master_err = max(bf16_master_err, float((want.to(torch.bfloat16).double() - want).abs().max()))
    model_vs_master = max(
        float((p.detach().float() - after[n].detach().to(p.dtype).float()).abs().max()) for n, p in params.items()
    )
    moved = max(float((after[n].double() - init_masters[n].double()).abs().max()) for n in after)

    gaps = torch.tensor(
        [
            logp_gap(lp16, lp32),
            logp_gap(lp_ac, lp32),
            max_gap(g16, g32),
            max_gap(g_ac, g32),
            max(float(g.abs().max()) for g in g32.values()),
            abs(m16["loss"] - m32["loss"]),
            abs(m_ac["loss"] - m32["loss"]),
            abs(m16["grad_norm"] - m32["grad_norm"]),
            update_err,
            model_vs_master,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    # DP ranks hold the same masters after the step
    flat = torch.cat([m.detach().double().reshape(-1) for _, m in sorted(after.items())])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)

    result = dict(
        case=case["name"],
        world=dist.get_world_size(),
        param_dtypes=sorted(set(dtypes.values())),
        bf16_params=sorted(n for n, d in dtypes.items() if d == "bfloat16"),
        fp32_params=sorted(n for n, d in dtypes.items() if d == "float32"),
        master_dtypes=sorted({str(m.dtype) for m in after.values()}),
        optimizer_param_dtypes=sorted({str(p.dtype) for p, _, _ in states}),
        optimizer_grad_dtypes=sorted(grad_dtypes),
        optimizer_state_dtypes=sorted(state_dtypes),
        logp_dtypes=sorted({str(x.dtype) for x in lp16}),
        logp_gap_bf16=float(gaps[0]),
        logp_gap_autocast=float(gaps[1]),
        grad_gap_bf16=float(gaps[2]),
        grad_gap_autocast=float(gaps[3]),
        grad_scale=float(gaps[4]),
        loss_gap_bf16=float(gaps[5]),
        loss_gap_autocast=float(gaps[6]),
        grad_norm_gap_bf16=float(gaps[7]),
        grad_norm=m32["grad_norm"],
        loss=m32["loss"],
        update_successful=m16["update_successful"],
        update_err=float(gaps[8]),
        model_vs_master=float(gaps[9]),
        moved=moved,
        lr=LR,
        bf16_master_err=bf16_master_err,
        dp_master_spread=float((hi - lo).abs().max()),
    )
    if case.get("checkpoint"):
        folder = os.path.join(args.ckpt, case["name"])
        result.update(checkpoint_round_trip(learner, batch, folder, Checkpointer, CheckpointConfig))
    return result


def checkpoint_round_trip(learner, batch, folder, Checkpointer, CheckpointConfig) -> dict:
    """Save, update again, resume: the masters, the model weights and Adam's state as saved?"""

    def snapshot():
        return (
            {n: m.detach().clone() for n, m in masters(learner).items()},
            {n: p.detach().clone() for n, p in named(learner).items()},
            [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for _, _, s in adam_states(learner)],
        )

    saver = Checkpointer(CheckpointConfig(save_every=1), folder, learner.layout, run_config={}, total_steps=3)
    learner.save(saver, 1)
    saved = snapshot()
    learner.train(batch)
    changed = snapshot()
    loader = Checkpointer(CheckpointConfig(resume=True), folder, learner.layout, run_config={}, total_steps=3)
    resumed = learner.load(loader)
    back = snapshot()

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a) if isinstance(a, dict) else all(same(x, y) for x, y in zip(a, b))

    return dict(
        resumed_step=None if resumed is None else resumed.step,
        second_update_changed=not same(saved[0], changed[0]),
        masters_restored=same(saved[0], back[0]),
        model_restored=same(saved[1], back[1]),
        adam_restored=same(saved[2], back[2]),
        restored_master_dtypes=sorted({str(m.dtype) for m in back[0].values()}),
    )


if __name__ == "__main__":
    run_cases(run_case, {"--ckpt": "folder for the checkpoint cases"})
