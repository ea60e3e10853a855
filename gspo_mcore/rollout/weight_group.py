"""The trainer's side of SGLang's weight-update process group (``update_weights_from_distributed``).

SGLang's servers join a group created by ``init_custom_process_group`` (``sglang/srt/utils/common.py``):
a TCP rendezvous on the trainer's address and a process group that is NOT the default group. The
trainer (rank 0 of that group) must create its side the same way; a plain ``init_process_group`` hangs.
Checked against SGLang 0.5.23 on CPU with gloo (tests/integration).
"""

from __future__ import annotations

from datetime import timedelta


def trainer_side_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    *,
    backend: str = "nccl",
    timeout_s: float = 120.0,
):
    """Rank 0 of the weight-update group shared with the servers; returns the process group."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(init_method, 0, world_size, timeout=timedelta(seconds=timeout_s)))
    store.set_timeout(timedelta(seconds=timeout_s))
    store = PrefixStore(group_name, store)
    # "backend_options" is the keyword torch >= 2.6 uses (SGLang picks it the same way)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        timeout=default_pg_timeout,
        backend_options=None,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_bucket(group):
    """A ``broadcast(bucket)`` callback for :meth:`SGLangEngine.init_weight_update_group`: sends each tensor
    of the bucket from rank 0 of ``group``, in order."""
    import torch.distributed as dist

    def broadcast(bucket) -> None:
        for _, t in bucket:
            dist.broadcast(t.contiguous(), src=0, group=group)

    return broadcast
