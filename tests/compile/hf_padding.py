"""Tiny HuggingFace decoders (random weights, eager attention) and a check that a compiled model
equals eager at every position, padded ones included, in inference and training."""

from __future__ import annotations

import pytest
import torch

T = pytest.importorskip("transformers", minversion="5")
# transformers 5 disables its models below torch 2.6, and they do not compile with a padding
# mask on torch 2.6 (see test_compile_hf_models)
if not T.utils.is_torch_available() or torch.__version__ < "2.7":
    pytest.skip(f"transformers {T.__version__} models do not compile on torch {torch.__version__}",
                allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

from compile_testing import Capture, reset  # noqa: E402
from torch_flash_v100.compile import history  # noqa: E402

V = 64
_C = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=64, max_position_embeddings=64)

# name: config kwargs of AutoConfig.for_model
DECODERS = {
    "llama": ("llama", dict(num_key_value_heads=2, **_C)),
    "mistral": ("mistral", dict(num_key_value_heads=1, sliding_window=None, **_C)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, **_C)),
    "gemma": ("gemma", dict(num_key_value_heads=1, head_dim=8, **_C)),
    "phi": ("phi", dict(**_C)),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5, **_C)),
    "opt": ("opt", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32)),
    "gpt2": ("gpt2", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                          bos_token_id=0, eos_token_id=0)),
    "bloom": ("bloom", dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4)),
    "falcon": ("falcon", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, new_decoder_architecture=False,
                              multi_query=True, alibi=False)),
}


def make_decoder(name: str, dtype=torch.float32, device="cpu", decoders=DECODERS):
    model_type, kw = decoders[name]
    torch.manual_seed(0)
    cfg = T.AutoConfig.for_model(model_type, **kw)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    for mod in model.modules():  # eager and fused dropout draw different numbers
        for a in ("dropout", "attention_dropout", "p"):
            if isinstance(getattr(mod, a, None), float):
                setattr(mod, a, 0.0)
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return model.to(device=device, dtype=dtype)


def padded_batch(side: str, device="cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (3, 10), generator=g)
    am = torch.ones(3, 10, dtype=torch.long)
    if side == "left":
        am[1, :3] = 0
        am[2, :8] = 0
    else:
        am[1, 7:] = 0
        am[2, 2:] = 0
    return ids.to(device), am.to(device)


def check_all_positions(name, side, train, *, dtype=torch.float32, device="cpu", atol=5e-5,
                        rtol=1e-4, reference_dtype=None):
    """Compiled (fused) equals eager on every position and every parameter gradient.
    ``reference_dtype``: run eager in that dtype instead (fp16 on a GPU against fp32)."""
    model = make_decoder(name, dtype, device).train(train)
    ref = model if reference_dtype is None else make_decoder(
        name, reference_dtype, device).train(train)
    ids, am = padded_batch(side, device)
    reset()
    cap = Capture()
    compiled = torch.compile(model, backend=cap.backend())
    with torch.set_grad_enabled(train):
        out_c = compiled(input_ids=ids, attention_mask=am, use_cache=False).logits
        out_e = ref(input_ids=ids, attention_mask=am, use_cache=False).logits
    fused = [h for h in history if h[1]]
    assert fused and len(fused) == len(history), history
    assert counters["flashv100"]["fused_attention"] == len(fused)
    assert "_softmax" not in cap.fw_code()
    torch.testing.assert_close(out_c.float(), out_e.float(), atol=atol, rtol=rtol)
    calls = cap.attention_calls()
    if train:
        go = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(1)).to(out_e)
        pc = list(model.parameters())
        pe = list(ref.parameters())
        gc = torch.autograd.grad(out_c, pc, go.to(out_c.dtype), allow_unused=True)
        ge = torch.autograd.grad(out_e, pe, go, allow_unused=True)
        for a, b in zip(gc, ge):
            if a is not None and b is not None:
                scale = max(b.abs().max().item(), 1.0)
                torch.testing.assert_close(a.float(), b.float(), atol=atol * 10 * scale,
                                           rtol=rtol * 10)
        assert "_softmax_backward_data" not in cap.bw_code()
    return cap, calls
