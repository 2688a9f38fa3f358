"""The allowed-token mask kernel against its reference (Triton interpreter on CPU); the bit layout
against llguidance's own masks is checked in tests/replicas/test_structured_output.py."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.token_mask import (
    apply_token_mask,
    apply_token_mask_reference,
    pack_allowed_reference,
    words_for,
)


@pytest.mark.parametrize("vocab", [31, 2048, 5003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(dtype)
    allowed = torch.rand(5, vocab, generator=g) < 0.3
    allowed[1] = True  # an unconstrained row: all ones
    allowed[2] = False
    allowed[2, vocab - 1] = True  # only the last token, in the last partial word
    bitmask = pack_allowed_reference(allowed)
    assert bitmask.shape == (5, words_for(vocab)) and bitmask.dtype == torch.int32
    assert (bitmask[1, : vocab // 32] == -1).all()
    out = torch.full_like(logits, 7.0)
    got = apply_token_mask(logits, bitmask, out=out)
    want = apply_token_mask_reference(logits, bitmask)
    assert got is out
    assert torch.equal(got, want)
    assert torch.isneginf(got[~allowed]).all()
    assert torch.equal(got[allowed], logits[allowed])


def test_in_place_on_a_row_slice_of_a_wider_buffer() -> None:
    """`out` may be the logits themselves, and rows may be a slice of a padded buffer."""
    buffer = torch.randn(8, 300)
    logits = buffer[2:5]
    allowed = torch.zeros(3, 300, dtype=torch.bool)
    allowed[:, [0, 31, 32, 299]] = True
    want = apply_token_mask_reference(logits.clone(), pack_allowed_reference(allowed))
    untouched = buffer[5:].clone()
    apply_token_mask(logits, pack_allowed_reference(allowed), out=logits)
    assert torch.equal(buffer[2:5], want)
    assert torch.equal(buffer[5:], untouched)


def test_a_narrow_mask_bans_what_it_does_not_cover() -> None:
    logits = torch.zeros(1, 100)
    narrow = pack_allowed_reference(torch.ones(1, 64, dtype=torch.bool))  # 2 words
    for apply in (apply_token_mask, apply_token_mask_reference):
        got = apply(logits, narrow)
        assert torch.isneginf(got[0, 64:]).all() and (got[0, :64] == 0).all()

