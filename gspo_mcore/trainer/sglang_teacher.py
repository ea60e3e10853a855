"""An SGLang-served distillation teacher (``distill.engine: sglang``, docs/distill.md): SGLang servers score
the student's own token ids, nothing is generated.

Global rank 0 drives the servers (launched here from ``distill.teacher_dir``, or connected by URL) through the
project's SGLang client (:meth:`gspo_mcore.rollout.SGLangEngine.score`: ``/generate`` with ``input_ids``,
``max_new_tokens`` 0, ``return_logprob`` and ``logprob_start_len`` at the first counted token) and broadcasts
the log-probs, so :class:`SGLangTeacher` answers :meth:`logprobs` like the in-process
:class:`~gspo_mcore.learner.teacher.Teacher`: one ``[L-1]`` float32 tensor per sample, aligned with
``tokens[1:]`` (0 before the first counted token, where nothing is scored).
"""

from __future__ import annotations

import asyncio
import logging
import os

import torch
import torch.distributed as dist

from gspo_mcore.rollout.sglang_server import SGLangServers

logger = logging.getLogger(__name__)


class SGLangTeacher:
    """The teacher as SGLang servers, driven by global rank 0 (see the module docstring)."""

    nbytes = 0
    """Teacher parameter bytes on the learner's ranks: none (they live in the servers)."""

    def __init__(self, cfg: SGLangServers, *, teacher_dir: str, layout, log_dir: str):
        self.cfg, self.teacher_dir, self.layout = cfg, teacher_dir, layout
        self.is_driver = layout.rank == 0
        self.engine = self.loop = None
        if not self.is_driver:
            return
        from gspo_mcore.rollout.sglang import SGLangEngine

        self.loop = asyncio.new_event_loop()
        if cfg.urls:
            self.engine = SGLangEngine(list(cfg.urls), config=cfg.client, restart=cfg.restart_policy())
            try:  # reachable now, not at the first step
                self._run(self.engine.control.server_info(refresh=True))
            except Exception as exc:
                self.close()
                raise ValueError(f"distill.sglang.urls: {exc}") from None
        else:
            self.engine = SGLangEngine.launch(
                cfg.launch_configs(teacher_dir), config=cfg.client, log_dir=log_dir, restart=cfg.restart_policy()
            )

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    @torch.no_grad()
    def logprobs(self, samples) -> list[torch.Tensor]:
        """The teacher's log-probs of ``tokens[1:]`` for every sample (``[L-1]`` float32 on the CPU, every
        rank), from the first counted token (``loss_mask == 1``) on; 0 before it. SGLang 0.5.23's scoring
        log-probs are of the raw logits: temperature 1 (``DistillConfig`` refuses another with this engine)."""
        out = [None]
        if self.is_driver:
            starts = [_first_counted(s.loss_mask) for s in samples]
            scored = [i for i, t in enumerate(starts) if t is not None]
            seqs = [samples[i].tokens.tolist() for i in scored]
            lps = self._run(self.engine.score(seqs, [starts[i] for i in scored])) if scored else []
            result = [torch.zeros(len(s.tokens) - 1, dtype=torch.float32) for s in samples]
            for i, lp in zip(scored, lps):
                result[i][starts[i] - 1 :] = torch.tensor(lp, dtype=torch.float32)
            out = [result]
        if self.layout.world_size > 1:
            dist.broadcast_object_list(out, src=0)
        return out[0]

    def close(self) -> None:
        """Stop the servers this teacher launched (connected ones keep running)."""
        if self.engine is not None:
            self._run(self.engine.close())
            self.engine = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None


def _first_counted(loss_mask: torch.Tensor) -> int | None:
    """The first position whose token counts in the loss (>= 1: position 0 has no context), or ``None``."""
    idx = torch.nonzero(loss_mask[1:]).flatten()
    return int(idx[0]) + 1 if len(idx) else None


def log_dir(output_dir: str) -> str:
    """Where launched teacher servers write their logs."""
    return os.path.join(output_dir, "sglang_teacher_logs")
