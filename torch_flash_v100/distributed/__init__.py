"""Multi-GPU (and multi-process CPU) use of the flashv100 ops.

* Context parallelism: :func:`ring_attention` over a sequence sharded across ranks
  (:func:`shard_sequence` / :func:`unshard_sequence`; contiguous or load-balanced zigzag layout).
* Tensor parallelism: importing this package registers DTensor sharding rules for the flashv100
  ops (heads or batch sharded: each rank computes its own part, no communication), where torch
  has ``torch.distributed.tensor.experimental.register_sharding``; :func:`dtensor_rules_registered`
  says whether it did.
* Data parallelism (DDP, FSDP2 ``fully_shard``) needs nothing: the ops see local tensors.

Not imported by ``import torch_flash_v100`` (DTensor's import costs about a second).
"""

from . import tensor_parallel as _tensor_parallel
from .ring import LAYOUTS, ring_attention, shard_sequence, unshard_sequence


def dtensor_rules_registered() -> bool:
    """Whether the DTensor sharding rules of the flashv100 ops are registered (the API exists)."""
    return _tensor_parallel.available()


__all__ = ["LAYOUTS", "ring_attention", "shard_sequence", "unshard_sequence",
           "dtensor_rules_registered"]
