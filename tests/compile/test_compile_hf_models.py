"""Real model code: HuggingFace transformers models with attn_implementation="eager", built from
tiny configs (random weights, no downloads).  Every attention site must be fused, in inference and
in training, with outputs and gradients equal to eager."""

import pytest
import torch

from compile_testing import Capture, assert_parameter_grads_close, reset

# The expectations follow transformers 5's model code (4.x builds some masks differently).
T = pytest.importorskip("transformers", minversion="5")
# transformers 5 disables its models below torch 2.6; on torch 2.6, compiling them with a padding
# mask fails inside Dynamo with any backend (transformers 5.24: NameError in output_capturing.py).
if not T.utils.is_torch_available() or torch.__version__ < "2.7":
    pytest.skip(f"transformers {T.__version__} models do not compile on torch {torch.__version__}",
                allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

from torch_flash_v100.compile import history  # noqa: E402

V = 64


def _dec(cls_cfg, cls_model, **kw):
    def make():
        cfg = getattr(T, cls_cfg)(vocab_size=V, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=64, **kw)
        return getattr(T, cls_model)._from_config(cfg, attn_implementation="eager")
    return make


MODELS = {
    # name: (factory, input kind, attention sites)
    "llama_gqa": (_dec("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2), "dec", 2),
    "qwen2_gqa": (_dec("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2), "dec", 2),
    "mistral_mqa": (_dec("MistralConfig", "MistralForCausalLM", num_key_value_heads=1,
                         sliding_window=None), "dec", 2),
    "gpt2": (lambda: T.GPT2LMHeadModel._from_config(
        T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     bos_token_id=0, eos_token_id=0), attn_implementation="eager"), "dec", 2),
    "bert": (lambda: T.BertModel._from_config(
        T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64),
        attn_implementation="eager"), "enc", 2),
    "t5": (lambda: T.T5ForConditionalGeneration._from_config(
        T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0),
        attn_implementation="eager"), "encdec", 6),
    "bart": (lambda: T.BartForConditionalGeneration._from_config(
        T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=64),
        attn_implementation="eager"), "encdec", 6),
    "vit": (lambda: T.ViTModel._from_config(
        T.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64),
        attn_implementation="eager"), "vit", 2),
}


def _auto(model_type, kind, sites, **kw):
    def make():
        cfg = T.AutoConfig.for_model(model_type, **kw)
        return T.AutoModel.from_config(cfg, attn_implementation="eager")
    return make, kind, sites


_C = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=64, max_position_embeddings=64)
_S2S = dict(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64)
MODELS.update({
    "distilbert": _auto("distilbert", "enc", 2, vocab_size=V, dim=32, n_layers=2, n_heads=4,
                        hidden_dim=64, max_position_embeddings=64),
    "roberta": _auto("roberta", "enc", 2, **_C),
    "deberta_v2": _auto("deberta-v2", "enc", 2, relative_attention=False, **_C),
    "opt": _auto("opt", "enc", 2, vocab_size=V, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                 word_embed_proj_dim=32),
    "gpt_neox": _auto("gpt_neox", "enc", 2, rotary_pct=0.5, **_C),
    "falcon_mqa": _auto("falcon", "enc", 2, vocab_size=V, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
                        alibi=False),
    "bloom_alibi": _auto("bloom", "enc", 2, vocab_size=V, hidden_size=32, n_layer=2, n_head=4),
    "gemma_mqa": _auto("gemma", "enc", 2, num_key_value_heads=1, head_dim=8, **_C),
    "phi3": _auto("phi3", "enc", 2, num_key_value_heads=2, pad_token_id=0, **_C),
    "mbart": _auto("mbart", "encdec", 3, **_S2S),
    "whisper": _auto("whisper", "audio", 3, num_mel_bins=8, max_source_positions=16,
                     max_target_positions=32, decoder_start_token_id=0, pad_token_id=0,
                     bos_token_id=0, eos_token_id=0, suppress_tokens=[],
                     begin_suppress_tokens=[], **{k: v for k, v in _S2S.items()
                                                   if k != "max_position_embeddings"}),
    "clip_text": _auto("clip_text_model", "enc", 2, **_C),
    "swin": _auto("swin", "vit", 2, image_size=16, patch_size=2, embed_dim=16, depths=[1, 1],
                  num_heads=[2, 4], window_size=2),
})


def _inputs(kind):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (2, 8), generator=g)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, 6:] = 0  # right padding
    if kind == "dec":
        return dict(input_ids=ids, attention_mask=am, use_cache=False)
    if kind == "enc":
        return dict(input_ids=ids, attention_mask=am)
    if kind == "encdec":
        return dict(input_ids=ids, attention_mask=am, decoder_input_ids=ids[:, :6],
                    use_cache=False)
    if kind == "audio":
        return dict(input_features=torch.randn(2, 8, 32, generator=g),
                    decoder_input_ids=ids[:, :6], use_cache=False)
    return dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g))


def _out(o):
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def _no_dropout(m):
    for mod in m.modules():
        for a in ("dropout", "dropout_rate", "attention_dropout", "p"):
            if isinstance(getattr(mod, a, None), float):
                setattr(mod, a, 0.0)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_fully_fused(name, train):
    make, kind, sites = MODELS[name]
    torch.manual_seed(0)
    model = make()
    for a in ("dropout", "attention_dropout", "attention_probs_dropout_prob",
              "hidden_dropout_prob", "dropout_rate", "attn_pdrop", "resid_pdrop", "embd_pdrop",
              "hidden_dropout", "activation_dropout"):
        if isinstance(getattr(model.config, a, None), float):
            setattr(model.config, a, 0.0)
    _no_dropout(model)  # eager and fused dropout draw different numbers
    model.train(train)
    inp = _inputs(kind)
    reset()
    cap = Capture()
    compiled = torch.compile(model, backend=cap.backend())
    with torch.set_grad_enabled(train):
        out_c = _out(compiled(**inp))
        out_e = _out(model(**inp))
    report = [h for h in history]
    fused = sum(1 for h in report if h[1])
    print(f"{name} {'train' if train else 'infer'}: fused {fused}/{len(report)} sites")
    assert fused == len(report) and fused > 0, report
    if not counters["graph_break"]:
        assert fused == sites, report
    # else: code around a graph break may run uncompiled (e.g. BART's training-time layerdrop
    # `if torch.rand([]) < p` in some transformers versions); every compiled site is fused
    assert counters["flashv100"]["fused_attention"] == fused
    fw = cap.fw_code()
    assert fw.count("flashv100._attention_forward") == fused and "_softmax" not in fw
    torch.testing.assert_close(out_c, out_e, atol=5e-5, rtol=1e-4)
    if train:
        params = [p for p in model.parameters() if p.requires_grad]
        go = torch.randn_like(out_e)
        if kind in ("dec", "enc"):
            go[1, 6:] = 0  # a loss ignores padded positions
        assert_parameter_grads_close(out_c, out_e, params, go)
        bw = cap.bw_code()
        assert bw.count("flashv100._attention_backward") == fused
        assert "_softmax_backward_data" not in bw


def test_llama_left_padding_valid_positions():
    # Left padding makes the padded query rows fully masked (garbage in eager: a uniform
    # average; the op: zeros).  Every real position must match.
    make, kind, sites = MODELS["llama_gqa"]
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(1, V, (2, 8))
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    reset()
    cap = Capture()
    out_c = _out(torch.compile(model, backend=cap.backend())(input_ids=ids, attention_mask=am,
                                                             use_cache=False))
    out_e = _out(model(input_ids=ids, attention_mask=am, use_cache=False))
    calls = cap.attention_calls()
    assert len(calls) == sites and all(c["is_causal"] and c["enable_gqa"] for c in calls)
    keep = am.bool()
    torch.testing.assert_close(out_c[keep], out_e[keep], atol=5e-5, rtol=1e-4)


def test_causal_detected_in_decoders():
    make, kind, sites = MODELS["bart"]
    model = make().eval()
    reset()
    cap = Capture()
    torch.compile(model, backend=cap.backend())(**_inputs("encdec"))
    causal = [c for c in cap.attention_calls() if c["is_causal"]]
    # decoder self-attention (2 layers) is causal with no padding: mask dropped entirely
    assert len(causal) == 2 and all(c["attn_mask"] is None for c in causal)


def test_gemma2_softcapping_with_padding_not_fused():
    # tanh soft-capping is computed by the FlashAttention-2 op only, which takes no padding
    # mask: left alone, logged (without padding it fuses: test_compile_hf_score_mods.py)
    make, kind, _ = _auto("gemma2", "enc", 2, num_key_value_heads=2, head_dim=8,
                          attn_logit_softcapping=50.0, **_C)
    model = make().eval()
    reset()
    cap = Capture()
    inp = _inputs(kind)
    out_c = _out(torch.compile(model, backend=cap.backend())(**inp))
    out_e = _out(model(**inp))
    assert counters["flashv100"]["fused_attention"] == 0
    assert len(history) == 2 and all("tanh soft-capping" in h[2] and "padding" in h[2]
                                     for h in history), history
    torch.testing.assert_close(out_c, out_e, atol=5e-5, rtol=1e-4)
