"""Compiled ops with pure-torch twins in :mod:`gspo_mcore.ops.reference`.

- :func:`token_logprobs`: log-probs (and entropy) of the sampled tokens from vocabulary-parallel logits.
- :func:`linear_token_logprobs`: the same from the final hidden states and the LM-head weight, in
  vocabulary chunks, never building the ``[T, V]`` logits.
- :func:`segment_sum`, :func:`segment_mean`, :func:`all_reduce_sum`: per-sequence reductions over
  packed segments (context-parallel ranks all-reduce one scalar per sequence).
- :func:`gspo_sequence_terms`: GSPO's sequence-level ratio and clipping with its backward coefficient.
"""

from gspo_mcore.ops._backend import (
    HAVE_EXTENSION,
    compiled_enabled,
    grad_buffer_cache_bytes,
    set_grad_buffer_cache,
    use_reference,
)
from gspo_mcore.ops.linear_logprobs import linear_token_logprobs
from gspo_mcore.ops.logprobs import token_logprobs
from gspo_mcore.ops.segments import all_reduce_sum, segment_mean, segment_sum
from gspo_mcore.ops.sequence import gspo_sequence_terms

__all__ = [
    "HAVE_EXTENSION",
    "all_reduce_sum",
    "compiled_enabled",
    "grad_buffer_cache_bytes",
    "gspo_sequence_terms",
    "linear_token_logprobs",
    "segment_mean",
    "segment_sum",
    "set_grad_buffer_cache",
    "token_logprobs",
    "use_reference",
]
