"""flash_attn.bert_padding's helpers (torch_flash_v100.bert_padding): packing against an explicit
loop over the mask, the round trip at every position (padding included), gradients, bad input,
and a padded batch through flash_attn_varlen_func against the per-sequence fp64 reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_flash_v100.bert_padding import (index_first_axis, index_put_first_axis, pad_input,
                                           unpad_input, unpad_input_for_concatenated_sequences)
from torch_flash_v100.flash_attn_interface import flash_attn_varlen_func
from flash_testing import assert_close, varlen_reference

# Left and right padding, an empty row, a full row.
MASK = torch.tensor([[0, 0, 1, 1, 1],
                     [1, 1, 1, 0, 0],
                     [0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 1]])


def _expected_packing(mask):
    """(flat indices, per-row lengths) by walking the mask."""
    indices, lengths = [], []
    for b in range(mask.shape[0]):
        row = [b * mask.shape[1] + s for s in range(mask.shape[1]) if mask[b, s]]
        indices += row
        lengths.append(len(row))
    return indices, lengths


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_unpad_input_packs_real_tokens_in_order(device, mask_dtype):
    hidden = torch.randn(4, 5, 3, 2, device=device)
    mask = MASK.to(device=device, dtype=mask_dtype)
    packed, indices, cu, longest, used = unpad_input(hidden, mask)
    expected_indices, lengths = _expected_packing(MASK)
    assert indices.tolist() == expected_indices and indices.dtype == torch.int64
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 6, 6, 11]
    assert longest == 5 and isinstance(longest, int)
    assert used.dtype == torch.int32 and used.tolist() == lengths
    assert torch.equal(packed, hidden.flatten(0, 1)[expected_indices])
    # Back: every position, the padded ones zero.
    padded = pad_input(packed, indices, 4, 5)
    assert torch.equal(padded, hidden * MASK.to(device)[:, :, None, None])


def test_unpad_input_unused_tokens(device):
    hidden = torch.randn(2, 4, 3, device=device)
    attention = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], device=device)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 1]], device=device)
    packed, indices, cu, longest, used = unpad_input(hidden, attention, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert cu.tolist() == [0, 3, 7] and longest == 4 and used.tolist() == [2, 1]
    assert torch.equal(packed, hidden.flatten(0, 1)[indices])


def test_unpad_input_for_concatenated_sequences(device):
    hidden = torch.randn(3, 6, 2, device=device)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]],
                           device=device)
    packed, indices, cu, longest = unpad_input_for_concatenated_sequences(hidden, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16] and longest == 6
    assert torch.equal(packed, hidden.flatten(0, 1)[indices])


def test_gradients_first_and_second_order():
    hidden = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)

    def round_trip(x):
        packed, indices, *_ = unpad_input(x, MASK)
        return pad_input(packed * packed, indices, 4, 5)

    torch.autograd.gradcheck(round_trip, (hidden,))
    torch.autograd.gradgradcheck(round_trip, (hidden,))
    # Padded positions get no gradient.
    (grad,) = torch.autograd.grad(round_trip(hidden).sum(), hidden)
    assert torch.equal(grad == 0, (MASK == 0)[:, :, None].expand_as(grad) | (hidden == 0))


@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_through_varlen(causal):
    """unpad -> flash_attn_varlen_func -> pad equals attention over each sequence's real tokens,
    at every position (padded rows zero); gradients at every position of q, k, v. fp64 on the
    CPU kernels: the composition is device-independent (the CUDA varlen numerics: tests/cuda)."""
    device = "cpu"
    g = torch.Generator().manual_seed(3)
    batch, seqlen, heads, dim = 4, 5, 2, 16
    q, k, v = (torch.randn(batch, seqlen, heads, dim, generator=g, dtype=torch.float64)
               .to(device).requires_grad_() for _ in range(3))
    mask = MASK.to(device)
    q_u, indices, cu, longest, _ = unpad_input(q, mask)
    k_u, v_u = (unpad_input(t, mask)[0] for t in (k, v))
    out = pad_input(flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, longest, longest,
                                           causal=causal), indices, batch, seqlen)
    expected_packed, _ = varlen_reference(q_u.detach().cpu(), k_u.detach().cpu(),
                                          v_u.detach().cpu(), cu.cpu(), cu.cpu(), causal=causal)
    expected = pad_input(expected_packed, indices.cpu(), batch, seqlen)
    assert_close(out.cpu(), expected, "out")
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_inputs = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    ref_packed = [unpad_input(t, MASK)[0] for t in ref_inputs]
    ref_out = pad_input(varlen_reference(*ref_packed, cu.cpu(), cu.cpu(), causal=causal)[0],
                        indices.cpu(), batch, seqlen)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.cpu())
    for name, actual, expect in zip("qkv", grads, ref_grads):
        assert_close(actual.cpu(), expect, f"d{name}")


def test_bad_input_raises_naming_the_argument(device):
    hidden = torch.randn(2, 3, 4, device=device)
    with pytest.raises(ValueError, match="attention_mask must be \\[batch, seqlen\\]"):
        unpad_input(hidden, torch.ones(2, 4, device=device))
    with pytest.raises(ValueError, match="attention_mask must hold 0 or 1"):
        unpad_input(hidden, torch.full((2, 3), 2, device=device))
    with pytest.raises(ValueError, match="unused_mask must hold 0 or 1"):
        unpad_input(hidden, torch.ones(2, 3, device=device), torch.full((2, 3), -1, device=device))
    with pytest.raises(ValueError, match="both mark a token"):
        unpad_input(hidden, torch.ones(2, 3, device=device), torch.ones(2, 3, device=device))
    with pytest.raises(TypeError, match="integer lengths"):
        unpad_input_for_concatenated_sequences(hidden, torch.ones(2, 3, device=device))
    with pytest.raises(ValueError, match="at most seqlen \\(3\\)"):
        unpad_input_for_concatenated_sequences(hidden, torch.tensor([[2, 2, 0], [1, 0, 0]],
                                                                    device=device))
    indices = torch.tensor([0, 5], device=device)
    with pytest.raises(ValueError, match="index_first_axis: indices must lie in \\[0, 2\\)"):
        index_first_axis(hidden, indices)
    with pytest.raises(ValueError, match="index_put_first_axis: indices must lie in \\[0, 5\\)"):
        index_put_first_axis(hidden, indices, 5)
    with pytest.raises(ValueError, match="indices must lie in \\[0, 6\\)"):
        pad_input(hidden, torch.tensor([0, -1], device=device), 2, 3)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        pad_input(hidden, torch.tensor([0.0, 1.0], device=device), 2, 3)
    with pytest.raises(ValueError, match="one row per index"):
        index_put_first_axis(hidden, torch.tensor([0], device=device), 5)
    # Valid indices pass with or without the check.
    for check in (True, False):
        out = index_put_first_axis(hidden, torch.tensor([4, 1], device=device), 5,
                                   check_index_values=check)
        assert torch.equal(out[[4, 1]], hidden) and not out[[0, 2, 3]].any()


@settings(max_examples=60, deadline=None)
@given(mask=st.lists(st.lists(st.booleans(), min_size=1, max_size=9), min_size=1, max_size=5)
       .filter(lambda rows: len({len(r) for r in rows}) == 1),
       unused_share=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_fuzz_unpad_pad_against_the_mask(mask, unused_share, seed):
    """Random masks (unused tokens after a row's real ones): packing against a walk over the
    mask, and the round trip at every position."""
    attention = torch.tensor(mask, dtype=torch.int64)
    batch, seqlen = attention.shape
    # Unused tokens: the first `unused_share` padded positions of each row.
    unused = torch.zeros_like(attention)
    for b in range(batch):
        free = [s for s in range(seqlen) if not mask[b][s]][:unused_share]
        unused[b, free] = 1
    hidden = torch.randn(batch, seqlen, 2, generator=torch.Generator().manual_seed(seed))
    packed, indices, cu, longest, used = unpad_input(hidden, attention, unused)
    kept = (attention + unused).bool()
    expected_indices, lengths = _expected_packing(kept)
    assert indices.tolist() == expected_indices
    assert cu.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert longest == max(lengths) and used.tolist() == attention.sum(1).tolist()
    assert torch.equal(pad_input(packed, indices, batch, seqlen), hidden * kept[:, :, None])
