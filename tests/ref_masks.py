"""The reference's attention masks, evaluated by broadcasting instead of `torch.vmap`.

transformers (4.57) builds every causal mask by vmapping the mask function over (batch, head, query, key): about
30 ms a call on a CPU, once per forward, which was most of the reference's generation time in the parity tests.
The mask functions it composes (causal, sliding window, chunked, padding) are elementwise comparisons and
indexing, so called once on broadcast index tensors they give the same boolean mask; `tests/test_ref_masks.py`
checks that against transformers' own function. Importing this module installs it (once per process).
"""

from __future__ import annotations

import torch
from transformers import masking_utils


def broadcast_sdpa_mask(batch_size: int, cache_position: torch.Tensor, kv_length: int, kv_offset: int = 0,
                        mask_function=masking_utils.causal_mask_function, attention_mask=None, local_size=None,
                        allow_is_causal_skip: bool = True, **_) -> torch.Tensor | None:
    """`masking_utils.sdpa_mask` (the torch >= 2.6 path) with the mask function called on broadcast indices."""
    padding_mask = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset, _slice=False)
    if allow_is_causal_skip and masking_utils._ignore_causal_mask_sdpa(
            padding_mask, cache_position.shape[0], kv_length, kv_offset, local_size):
        return None
    if padding_mask is not None:
        mask_function = masking_utils.and_masks(mask_function, masking_utils.padding_mask_function(padding_mask))
    device = cache_position.device
    batch = torch.arange(batch_size, device=device)[:, None, None, None]
    head = torch.arange(1, device=device)[None, :, None, None]
    query = cache_position[None, None, :, None]
    key = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
    mask = mask_function(batch, head, query, key)
    return mask.expand(batch_size, 1, cache_position.shape[0], kv_length)


# eager_mask (the reference's attention is eager) calls the module's sdpa_mask
masking_utils.sdpa_mask = broadcast_sdpa_mask
