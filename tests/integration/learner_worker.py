"""The learner side of the real-SGLang integration tests: one process, one gloo rank, the main venv.

Run by the tests as ``python learner_worker.py SPEC.json REPORT.json``. It builds the Megatron learner on
the test's tiny Hugging Face checkpoint (:func:`gspo_mcore.learner.hf.load.load_hf_weights`), talks to the SGLang
server(s) through the project's own client (:class:`gspo_mcore.rollout.SGLangEngine`), and executes the
spec's ``steps`` in order, recording what it saw in the report (the tests assert on it):

- ``{"op": "perturb", "seed": int, "scale": float}``: add ``scale * N(0, 1)`` to every parameter
  (a stand-in for a training step: new weights the server does not have yet);
- ``{"op": "sync", "method": "disk"|"tensor"|"distributed", "version": int, "export_dir"?: str,
  "bucket_bytes"?: int}``: push the learner's weights, gathered by :func:`gspo_mcore.learner.hf.export.hf_buckets`
  (the rollout weight sync's gather), to every server: written as safetensors and loaded by
  ``update_weights_from_disk``; shared as CPU tensors (torch's ``file_system`` sharing strategy) through
  ``update_weights_from_tensor``; or broadcast over a gloo weight-update group (trainer = rank 0, created
  the way SGLang creates its side) through ``update_weights_from_distributed``;
- ``{"op": "generate", "name": str, "prompts": [[int]], "n": int, "params": {SamplingParams fields}}``:
  ``engine.generate``; the samples go to ``report["generate"][name]``;
- ``{"op": "start_generate", ...}`` (the fields of ``generate``): start it and go on to the next step;
  ``{"op": "finish_generate", "name": str}`` waits for it and records it like ``generate``;
- ``{"op": "wait_running", "at_least": int, "then_s": float}``: poll the first server's ``/v1/loads``
  until ``at_least`` requests are decoding, then wait ``then_s`` seconds (tokens are being made);
- ``{"op": "snapshot", "name": str}`` / ``{"op": "restore", "name": str}``: keep a copy of the learner's
  parameters / put it back (to score one set of samples under two weight versions);
- ``{"op": "load_checkpoint", "path": str}``: load a training checkpoint's model part (a run folder, its
  checkpoint directory or one ``step_<N>``) into the learner, through the exporter's loader (the trainer's);
- ``{"op": "score", "name": str, "label"?: str}``: the learner's log-probs
  (:func:`gspo_mcore.learner.forward.forward_logprobs` at the request's log-prob temperature) of those samples'
  response tokens, next to SGLang's, in ``report["score"][label or name]``.

Nothing here is SGLang-specific test support: it is what a trainer does, on one rank.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import sys
import time
import urllib.request

import torch

from gspo_mcore.learner.batching import TrainSample
from gspo_mcore.learner.forward import forward_logprobs
from gspo_mcore.learner.hf.export import export_plan, hf_buckets
from gspo_mcore.learner.hf.folder import write_safetensors
from gspo_mcore.learner.hf.load import load_hf_weights
from gspo_mcore.learner.model import ModelOptions, build_model
from gspo_mcore.learner.model_config import load_hf_config
from gspo_mcore.learner.parallel import ParallelConfig, init_parallel
from gspo_mcore.rollout import SamplingParams, SGLangClientConfig, SGLangEngine


class Worker:
    def __init__(self, spec: dict):
        self.spec = spec
        self.hf_dir = spec["hf_dir"]
        self.arch = load_hf_config(os.path.join(self.hf_dir, "config.json"))
        self.layout = init_parallel(ParallelConfig(), self.arch, seed=0)
        self.model = build_model(self.arch, ParallelConfig(), ModelOptions(use_te=False), seed=None)
        load_hf_weights(self.model, self.hf_dir)
        config = SGLangClientConfig(
            initial_weight_version=int(spec.get("initial_weight_version", 0)),
            request_timeout_s=600.0,
            max_attempts=1,
            pause_mode=spec.get("pause_mode", "abort"),
        )
        self.engine = SGLangEngine(spec["urls"], config=config)
        self.report: dict = {"generate": {}, "score": {}, "sync": [], "timings": {}}
        self.group_pg = None
        self.pending: dict = {}
        self.snapshots: dict = {}

    # ------------------------------------------------------------------------------------------ ops
    @torch.no_grad()
    def op_perturb(self, seed: int, scale: float):
        g = torch.Generator().manual_seed(seed)
        for _, p in sorted(self.model[0].named_parameters()):
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))

    def _buckets(self, bucket_bytes: int):
        return hf_buckets(self.model, self.arch, bucket_bytes=bucket_bytes)

    async def op_sync(self, method: str, version: int, export_dir: str | None = None, bucket_bytes: int = 1 << 16):
        t0 = time.monotonic()
        if method == "disk":
            plan = export_plan(self.model, self.arch)
            if os.path.exists(export_dir):
                shutil.rmtree(export_dir)
            named = (item for bucket in self._buckets(bucket_bytes) for item in bucket)
            write_safetensors(export_dir, named, [(it.name, it.nbytes) for it in plan])
            for f in os.listdir(self.hf_dir):  # config.json and the tokenizer files
                if not f.endswith(".safetensors") and not f.endswith(".index.json"):
                    src = os.path.join(self.hf_dir, f)
                    if os.path.isfile(src):
                        shutil.copy(src, export_dir)
            await self.engine.update_weights_from_disk(export_dir, version)
        elif method == "tensor":
            torch.multiprocessing.set_sharing_strategy("file_system")
            buckets = [list(b) for b in self._buckets(bucket_bytes)]
            self.report["sync_buckets"] = len(buckets)
            await self.engine.update_weights(buckets, version)
        elif method == "distributed":
            import torch.distributed as dist

            from gspo_mcore.platform.launch import free_port

            group_name = "gspo_it_weights"

            from gspo_mcore.rollout.weight_group import trainer_side_group

            def trainer_init(world_size: int) -> None:
                self.group_pg = trainer_side_group("127.0.0.1", port, world_size, group_name, backend="gloo")

            def broadcast(bucket) -> None:
                for _, t in bucket:
                    dist.broadcast(t.contiguous(), src=0, group=self.group_pg)

            port = free_port()
            world = await self.engine.control.init_group(
                master_address="127.0.0.1",
                master_port=port,
                trainer_init=trainer_init,
                broadcast=broadcast,
                group_name=group_name,
                backend="gloo",
            )
            self.report["group_world_size"] = world
            buckets = [list(b) for b in self._buckets(bucket_bytes)]
            self.report["sync_buckets"] = len(buckets)
            await self.engine.update_weights(buckets, version)  # the group's broadcast is the default path
            await self.engine.control.destroy_group()
        else:
            raise ValueError(f"unknown sync method {method!r}")
        self.report["sync"].append(
            {
                "method": method,
                "version": version,
                "engine_version": self.engine.weight_version,
                "seconds": time.monotonic() - t0,
            }
        )

    async def op_generate(self, name: str, prompts, n: int, params: dict):
        sp = SamplingParams(**params)
        t0 = time.monotonic()
        groups = await self.engine.generate(prompts, n, sp)
        self.report["timings"][f"generate:{name}"] = time.monotonic() - t0
        self.report["generate"][name] = {
            "params": params,
            "n": n,
            "num_prompts": len(prompts),
            "logprob_temperature": sp.logprob_temperature,
            "groups": [[dataclasses.asdict(s) for s in g] for g in groups],
        }

    def op_start_generate(self, name: str, prompts, n: int, params: dict):
        self.pending[name] = asyncio.create_task(self.op_generate(name, prompts, n, params))

    async def op_finish_generate(self, name: str):
        await self.pending.pop(name)

    async def op_wait_running(self, at_least: int, then_s: float = 0.0, timeout_s: float = 300.0):
        url = self.spec["urls"][0] + "/v1/loads?include=core"
        deadline = time.monotonic() + timeout_s
        while True:
            loads = (await asyncio.to_thread(_get_json, url))["loads"]
            running = sum(int(x.get("num_running_reqs", 0)) for x in loads)
            if running >= at_least:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {running} running requests after {timeout_s} s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(then_s)

    @torch.no_grad()
    def op_snapshot(self, name: str):
        self.snapshots[name] = {k: p.detach().clone() for k, p in self.model[0].named_parameters()}

    @torch.no_grad()
    def op_restore(self, name: str):
        saved = self.snapshots[name]
        for k, p in self.model[0].named_parameters():
            p.copy_(saved[k])

    def op_load_checkpoint(self, path: str):
        from gspo_mcore.convert.export_source import locate
        from gspo_mcore.convert.mcore_checkpoint import load_model

        source = locate(path, config_dir=self.hf_dir)
        load_model(self.model, source)
        self.report.setdefault("loaded", []).append({"path": source.training.path, "step": source.training.step})

    def op_score(self, name: str, label: str | None = None):
        gen = self.report["generate"][name]
        flat = [s for g in gen["groups"] for s in g if s["response_ids"]]
        samples = []
        for s in flat:
            tokens = torch.tensor(list(s["prompt_ids"]) + list(s["response_ids"]), dtype=torch.int64)
            mask = torch.zeros_like(tokens)
            mask[len(s["prompt_ids"]) :] = 1
            samples.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=0.0))
        t0 = time.monotonic()
        logps = forward_logprobs(
            self.model, samples, self.layout, max_tokens=4096, temperature=gen["logprob_temperature"]
        )
        label = label or name
        self.report["timings"][f"score:{label}"] = time.monotonic() - t0
        learner, engine = [], []
        for s, lp in zip(flat, logps):
            r = len(s["response_ids"])
            learner.append(lp[-r:].tolist())
            engine.append(list(s["response_logprobs"]))
        diffs = [abs(a - b) for la, ea in zip(learner, engine) for a, b in zip(la, ea)]
        self.report["score"][label] = {
            "learner": learner,
            "engine": engine,
            "num_tokens": len(diffs),
            "max_abs_diff": max(diffs) if diffs else 0.0,
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0,
            "min_logprob": min((x for ea in engine for x in ea), default=0.0),
        }

    async def op_teacher_score(self, name: str, label: str):
        """The SGLang-served teacher (:class:`gspo_mcore.trainer.sglang_teacher.SGLangTeacher`, connected to the
        spec's servers) and the in-process teacher (:class:`gspo_mcore.learner.teacher.Teacher` on the same HF
        folder) score those samples' token ids; their log-probs of every counted token go to
        ``report["teacher"][label]``. Every other sample counts from its third response token on (a later start)."""
        from gspo_mcore.learner.teacher import Teacher
        from gspo_mcore.rollout.sglang_server import SGLangServers
        from gspo_mcore.trainer.sglang_teacher import SGLangTeacher

        gen = self.report["generate"][name]
        flat = [s for g in gen["groups"] for s in g if len(s["response_ids"]) >= 3]
        samples = []
        for k, s in enumerate(flat):
            tokens = torch.tensor(list(s["prompt_ids"]) + list(s["response_ids"]), dtype=torch.int64)
            mask = torch.zeros_like(tokens)
            mask[len(s["prompt_ids"]) + (2 if k % 2 else 0) :] = 1
            samples.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=0.0))
        config = SGLangServers(urls=tuple(self.spec["urls"]))
        # in a thread: the teacher runs its own event loop (as on the trainer's rank 0)
        served = await asyncio.to_thread(
            SGLangTeacher, config, teacher_dir=self.hf_dir, layout=self.layout, log_dir="."
        )
        t0 = time.monotonic()
        try:
            sglang_lp = await asyncio.to_thread(served.logprobs, samples)
        finally:
            await asyncio.to_thread(served.close)
        seconds = time.monotonic() - t0
        inproc = Teacher(
            self.hf_dir, self.arch, ParallelConfig(), self.layout, ModelOptions(use_te=False), max_tokens=4096
        )
        local_lp = inproc.logprobs(samples)
        a, b, outside = [], [], 0.0
        for s, x, y in zip(samples, sglang_lp, local_lp):
            counted = s.loss_mask[1:].bool()
            assert x.shape == y.shape == counted.shape, (x.shape, y.shape, counted.shape)
            a += x[counted].tolist()
            b += y[counted].tolist()
            outside = max(outside, float(x[~counted].abs().max()) if (~counted).any() else 0.0)
        diffs = [abs(u - v) for u, v in zip(a, b)]
        self.report.setdefault("teacher", {})[label] = {
            "num_samples": len(samples),
            "num_tokens": len(diffs),
            "max_abs_diff": max(diffs),
            "mean_abs_diff": sum(diffs) / len(diffs),
            "min_logprob": min(a),
            "max_abs_outside_counted": outside,
            "seconds": seconds,
        }

    async def op_episodes(self, name: str, rows, n: int, params: dict, max_turns: int, max_total_tokens: int):
        """``n`` episodes per row of the echo environment below on the SGLang engine (the episode driver over
        :meth:`SGLangEngine.generate_turns`), recording every turn SGLang returned and every environment span the
        driver appended, then the learner's log-probs of the whole episodes in ``report["episodes"][name]``."""
        from gspo_mcore.envs import EpisodeConfig
        from gspo_mcore.rollout.episode import EpisodeDriver

        sp = SamplingParams(**params)
        log: dict[int, list] = {}

        class Recorded:
            async def generate_turns(_, prompts, params, *, keys, max_total_tokens, on_turns, caps=None, stops=None):
                def on(ends):
                    answers = on_turns(ends)
                    for e, more in zip(ends, answers):
                        log.setdefault(e.row, []).append(("policy", list(e.ids)))
                        if more is not None:
                            log[e.row].append(("env", list(more)))
                    return answers

                await self.engine.generate_turns(
                    prompts, params, keys=keys, max_total_tokens=max_total_tokens, on_turns=on, caps=caps, stops=stops
                )

        config = EpisodeConfig(max_turns=max_turns, max_total_tokens=max_total_tokens)
        driver = EpisodeDriver(EchoEnv(), CharRenderer(), config)
        t0 = time.monotonic()
        groups = await asyncio.to_thread(driver.run, Recorded(), rows, n, sp, seed=sp.seed or 0)
        seconds = time.monotonic() - t0
        flat = [s for g in groups for s in g]
        samples = []
        for s in flat:
            tokens = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.int64)
            mask = torch.tensor([0] * len(s.prompt_ids) + list(s.response_mask), dtype=torch.int64)
            samples.append(TrainSample(tokens=tokens, loss_mask=mask, advantage=0.0))
        logps = forward_logprobs(self.model, samples, self.layout, max_tokens=4096, temperature=sp.logprob_temperature)
        diffs, policy, env = [], 0, 0
        for s, lp in zip(flat, logps):
            r = len(s.response_ids)
            learner = lp[-r:].tolist()
            for m, x, y in zip(s.response_mask, learner, s.response_logprobs):
                if m:
                    diffs.append(abs(x - y))
            policy += sum(s.response_mask)
            env += r - sum(s.response_mask)
        self.report.setdefault("episodes", {})[name] = {
            "samples": [
                {
                    "prompt_ids": list(s.prompt_ids),
                    "response_ids": list(s.response_ids),
                    "response_mask": list(s.response_mask),
                    "response_logprobs": list(s.response_logprobs),
                    "token_versions": s.token_versions,
                    "weight_version": s.weight_version,
                    "turns": s.episode.turns,
                    "end": s.episode.end,
                }
                for s in flat
            ],
            "turn_log": [log[k] for k in sorted(log)],
            "max_abs_diff": max(diffs),
            "mean_abs_diff": sum(diffs) / len(diffs),
            "policy_tokens": policy,
            "env_tokens": env,
            "seconds": seconds,
        }

    # ----------------------------------------------------------------------------------------- main
    async def run(self):
        try:
            for step in self.spec["steps"]:
                step = dict(step)
                op = step.pop("op")
                fn = getattr(self, f"op_{op}")
                out = fn(**step)
                if asyncio.iscoroutine(out):
                    await out
        finally:
            await self.engine.close()  # owns no process: only drops connections
        return self.report


class EchoEnv:
    """Answers each turn with ``"<k>:"`` and the turn's last three characters (so the observation depends on the
    action); never done (episodes end at ``max_turns``)."""

    def reset(self, row):
        from gspo_mcore.envs import Reset

        return Reset(observation=row["prompt"], state={"turn": 0})

    def step(self, state, action):
        from gspo_mcore.envs import Step

        state["turn"] += 1
        return Step(observation=f"{state['turn']}:{action[-3:]}>", info={"tool_calls": 1})


class CharRenderer:
    """Observations <-> ids of the tiny checkpoint's character tokenizer (sglang_cpu.encode, no template)."""

    def first(self, observation, tools=()):
        from sglang_cpu import encode

        return encode(observation)

    def after_turn(self, observation, last):
        from sglang_cpu import encode

        return encode(observation)[1:]  # no BOS inside the episode

    def decode(self, ids):
        from examples.tiny.task import CHARS, SPECIALS

        k = len(SPECIALS)
        return "".join(CHARS[i - k] for i in ids if k <= i < k + len(CHARS))  # specials and fillers dropped


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.monotonic()
    worker = Worker(spec)
    report = asyncio.run(worker.run())
    report["timings"]["total"] = time.monotonic() - t0
    with open(out_path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(out_path + ".tmp", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
