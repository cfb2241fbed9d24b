"""Multi-GPU (and multi-process CPU) use of the flashv100 ops.

* Context parallelism: :func:`ring_attention` over a sequence sharded across ranks
  (:func:`shard_sequence` / :func:`unshard_sequence`; contiguous or load-balanced zigzag layout).
* Data parallelism (DDP, FSDP2 ``fully_shard``) needs nothing: the ops see local tensors.
"""

from .ring import LAYOUTS, ring_attention, shard_sequence, unshard_sequence

__all__ = ["LAYOUTS", "ring_attention", "shard_sequence", "unshard_sequence"]
