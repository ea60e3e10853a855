"""One rank's random-number generator states, as saved in ``rng/rank_<r>.pt`` of a checkpoint."""

from __future__ import annotations

import random

import torch


def rng_state() -> dict:
    """This rank's RNG states: python, numpy, torch CPU (and CUDA), Megatron's model-parallel tracker."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron_tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the states :func:`rng_state` returned (CUDA only where there is CUDA and it was saved)."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])
