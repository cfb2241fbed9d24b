"""Real model code with sliding windows, soft-capping and ALiBi: tiny transformers decoders
(random weights, eager attention), compiled output and parameter gradients equal to eager at
every position.

Without padding their masks are bands of diagonals and become the FlashAttention-2 op's window,
softcap and ALiBi slopes.  With padding the window or the ALiBi bias stays part of the mask of
flashv100.attention, and Gemma 2's soft-capping, which only the FlashAttention-2 op (no mask
input) computes, is left alone.  BLOOM and Falcon build their ALiBi positions from the
attention mask's cumulative sum, which the pass cannot prove to be the key position: their bias
stays a mask too."""

import pytest
import torch

T = pytest.importorskip("transformers", minversion="5")
# transformers 5 disables its models below torch 2.6, and they do not compile with a padding
# mask on torch 2.6 (see test_compile_hf_models)
if not T.utils.is_torch_available() or torch.__version__ < "2.7":
    pytest.skip(f"transformers {T.__version__} models do not compile on torch {torch.__version__}",
                allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

from compile_testing import Capture, assert_parameter_grads_close, reset  # noqa: E402
from hf_padding import V, make_decoder, padded_batch  # noqa: E402
from torch_flash_v100.compile import history  # noqa: E402

W = 4  # sliding window: each query sees itself and the 3 keys before it
_C = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=64, max_position_embeddings=64)

WINDOW = dict(window_left=W - 1, window_right=0, softcap=0.0, alibi=False)
CAUSAL_ALIBI = dict(window_left=-1, window_right=0, softcap=0.0, alibi=True)
ATTENTION = None  # flashv100.attention with the mask

MODELS = {
    # name: ((model type, config), what each attention site becomes without padding)
    "mistral": (("mistral", dict(num_key_value_heads=1, sliding_window=W, **_C)), [WINDOW] * 2),
    "qwen2": (("qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=W,
                             max_window_layers=0, **_C)), [WINDOW] * 2),
    "phi3": (("phi3", dict(num_key_value_heads=2, pad_token_id=0, sliding_window=W, **_C)),
             [WINDOW] * 2),
    "starcoder2": (("starcoder2", dict(num_key_value_heads=2, sliding_window=W, **_C)),
                   [WINDOW] * 2),
    "cohere2": (("cohere2", dict(num_key_value_heads=2, sliding_window=W, **_C)),
                [WINDOW] * 2),
    "gemma3": (("gemma3_text", dict(num_key_value_heads=2, head_dim=8, sliding_window=W, **_C)),
               [WINDOW] * 2),
    # a sliding layer and a full one, both soft-capped
    "gemma2": (("gemma2", dict(num_key_value_heads=2, head_dim=8, sliding_window=W,
                               attn_logit_softcapping=50.0, **_C)),
               [dict(WINDOW, softcap=50.0), dict(WINDOW, window_left=-1, softcap=50.0)]),
    "mpt": (("mpt", dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)),
            [CAUSAL_ALIBI] * 2),
    "bloom": (("bloom", dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4)),
              [ATTENTION] * 2),
    "falcon_alibi": (("falcon", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, new_decoder_architecture=False,
                                     multi_query=False, alibi=True)), [ATTENTION] * 2),
}


def _model(name, train):
    return make_decoder(name, decoders={n: cfg for n, (cfg, _) in MODELS.items()}).train(train)


def _compare(model, compiled, train, **inputs):
    with torch.set_grad_enabled(train):
        out_c = compiled(use_cache=False, **inputs).logits
        out_e = model(use_cache=False, **inputs).logits
    torch.testing.assert_close(out_c, out_e, atol=5e-5, rtol=1e-4)
    if train:
        go = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(1))
        assert_parameter_grads_close(out_c, out_e, list(model.parameters()), go)


def _rules(call) -> dict:
    return dict(window_left=call["window_left"], window_right=call["window_right"],
                softcap=call["softcap"], alibi=call["alibi_slopes"] is not None)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_without_padding(name, train):
    _, expected = MODELS[name]
    model = _model(name, train)
    ids, _ = padded_batch("right")
    reset()
    cap = Capture()
    _compare(model, torch.compile(model, backend=cap.backend()), train, input_ids=ids)
    print(name, [h[2] for h in history])
    assert len(history) == len(expected) and all(h[1] for h in history), history
    assert counters["flashv100"]["fused_attention"] == len(expected)
    flash = [_rules(c) for c in cap.flash_calls()]
    assert flash == [e for e in expected if e is not ATTENTION], history
    assert len(cap.attention_calls()) == expected.count(ATTENTION)
    assert "_softmax" not in cap.fw_code()


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", [n for n in MODELS if n not in ("bloom", "falcon_alibi")])
def test_with_padding(name, side, train):
    # bloom (and falcon without ALiBi) with padding: test_compile_padding_parity.py
    model = _model(name, train)
    ids, am = padded_batch(side)
    reset()
    cap = Capture()
    _compare(model, torch.compile(model, backend=cap.backend()), train, input_ids=ids,
             attention_mask=am)
    print(name, side, [h[2] for h in history])
    assert not cap.flash_calls()
    if name == "gemma2":
        assert counters["flashv100"]["fused_attention"] == 0
        assert history and all(
            not h[1] and "tanh soft-capping needs the FlashAttention-2 op" in h[2] and
            "padding" in h[2] for h in history), history
        return
    assert history and all(h[1] for h in history), history
    calls = cap.attention_calls()
    assert len(calls) == len(history) and all(c["is_causal"] and c["attn_mask"] is not None
                                              for c in calls)
    if name == "mpt":
        assert all("the ALiBi bias stays a mask" in h[2] for h in history), history
