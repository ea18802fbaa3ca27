"""The reference's masks built by broadcasting (tests/ref_masks.py) are transformers' vmapped masks, exactly."""

import pytest
import torch
from ref_masks import broadcast_sdpa_mask
from transformers import masking_utils

FUNCTIONS = {
    "causal": masking_utils.causal_mask_function,
    "sliding": masking_utils.sliding_window_causal_mask_function(3),
    "chunked": masking_utils.chunked_causal_mask_function(4, torch.tensor([0, 1, 2]))  # left padding per row,
}


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("queries,kv_length,kv_offset", [(7, 7, 0), (1, 12, 0), (3, 9, 2), (5, 20, 0)])
@pytest.mark.parametrize("padded", [False, True])
def test_broadcast_mask_equals_the_vmapped_one(name, queries, kv_length, kv_offset, padded):
    batch = 3
    start = kv_length + kv_offset - queries
    cache_position = torch.arange(start, start + queries)
    attention_mask = None
    if padded:  # left padding of 0, 2 and 4 positions, as a batch of prompts of different lengths has
        attention_mask = torch.ones(batch, kv_length + kv_offset, dtype=torch.bool)
        for row, pad in enumerate((0, 2, 4)):
            attention_mask[row, :pad] = False
    kwargs = dict(batch_size=batch, cache_position=cache_position, kv_length=kv_length, kv_offset=kv_offset,
                  mask_function=FUNCTIONS[name], attention_mask=attention_mask, allow_is_causal_skip=False)
    ours = broadcast_sdpa_mask(**kwargs)
    theirs = masking_utils.sdpa_mask_recent_torch(**kwargs)
    assert ours.dtype == theirs.dtype == torch.bool
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)
    if queries > 1:
        assert not ours.all()  # a mask that masks something: the case compares more than two all-True tensors
