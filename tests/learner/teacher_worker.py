"""Worker of test_teacher.py: build a real tiny Hugging Face teacher as the learner's forward-only second
model under one layout, score a fixed batch, and (rank 0) write the log-probs and the teacher's facts.

    python -m torch.distributed.run --nproc_per_node 2 teacher_worker.py --teacher DIR --out FILE \
        --cases '[{"tp": 2}]'
"""

from __future__ import annotations

import torch
from helpers.worker_cases import run_cases


def batch(vocab: int):
    """Six samples of varied lengths (prompt + response), ids drawn from the whole vocabulary."""
    from gspo_mcore.learner.batching import TrainSample

    g = torch.Generator().manual_seed(7)
    out = []
    for prompt, response in ((5, 3), (4, 6), (7, 1), (3, 9), (6, 4), (2, 2)):
        tokens = torch.randint(0, vocab, (prompt + response,), generator=g)
        mask = torch.cat([torch.zeros(prompt), torch.ones(response)])
        out.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=0.0))
    return out


def run_case(case, args):
    from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
    from gspo_mcore.learner.teacher import Teacher, check_teacher_fits

    pc = ParallelConfig(tensor=case.get("tp", 1), pipeline=case.get("pp", 1))
    import os

    arch = check_teacher_fits(args.teacher, pc, int(os.environ.get("WORLD_SIZE", "1")))
    layout = init_parallel(pc, arch, seed=1234)
    teacher = Teacher(args.teacher, arch, pc, layout, max_tokens=24, temperature=case.get("temperature", 1.0))
    samples = batch(arch.vocab_size)
    logps = teacher.logprobs(samples)
    params = [p for chunk in teacher.model for p in chunk.parameters()]
    return dict(
        case=case,
        logprobs=[lp.tolist() for lp in logps],
        tokens=[s.tokens.tolist() for s in samples],
        requires_grad=any(p.requires_grad for p in params),
        grad_buffers=sum(len(chunk.buffers) + len(chunk.expert_parallel_buffers) for chunk in teacher.model),
    )


if __name__ == "__main__":
    run_cases(run_case, {"--teacher": "the teacher's Hugging Face directory"})
