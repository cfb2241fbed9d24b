"""The transformers backend (torch_flash_v100.integrations.transformers) against the same tiny
random-weight models with attn_implementation="eager": logits and parameter gradients at every
real token (left and right padding), packed batches, greedy generate() and dropout training."""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, BartConfig, BertConfig,
    DataCollatorWithFlattening, Gemma2Config, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
)

from torch_flash_v100.integrations import transformers as backend  # noqa: E402

try:
    NAME = backend.register()
except ImportError as error:  # a transformers older than the backend needs
    pytest.skip(str(error), allow_module_level=True)
VOCAB = 61
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

# (name, config): decoder-only models. The windows (4) are shorter than the sequences (11).
DECODERS = [
    ("llama", LlamaConfig(**TINY)),
    ("mistral", MistralConfig(**TINY, sliding_window=4)),
    ("qwen2", Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                          layer_types=["full_attention", "sliding_attention"])),
    ("gemma2", Gemma2Config(**TINY, head_dim=8, sliding_window=4, attn_logit_softcapping=0.5,
                            final_logit_softcapping=3.0, query_pre_attn_scalar=6)),
    ("gpt2", GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
]
LENGTH = 11


@pytest.fixture
def device():
    """fp32 against eager runs on CPU; CUDA (fp16 / bf16 only) has its own tests below."""
    return "cpu"


def _model(factory, config, device):
    torch.manual_seed(0)
    return factory.from_config(config, attn_implementation="eager").to(device).eval()


def _padded_batch(side, device):
    """Two sequences of 11 and 6 real tokens, padded on `side`, and the mask (1 = real)."""
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    if side == "left":
        mask[1, :LENGTH - 6] = 0
    else:
        mask[1, 6:] = 0
    return ids.to(device), mask.to(device)


def _logits_and_grads(model, implementation, weights, keep, **inputs):
    """Logits at the real tokens and the gradients of a weighted sum of them."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    (logits * weights)[keep].sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[keep], grads


def _assert_same(model, weights, keep, atol=2e-5, **inputs):
    ref, ref_grads = _logits_and_grads(model, "eager", weights, keep, **inputs)
    out, out_grads = _logits_and_grads(model, NAME, weights, keep, **inputs)
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-4)
    assert out_grads.keys() == ref_grads.keys() and ref_grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(out_grads[name], grad, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name,config", DECODERS, ids=[d[0] for d in DECODERS])
def test_decoder_matches_eager_with_padding(name, config, side, device):
    model = _model(AutoModelForCausalLM, config, device)
    ids, mask = _padded_batch(side, device)
    weights = torch.randn(2, LENGTH, VOCAB, generator=torch.Generator().manual_seed(2)).to(device)
    _assert_same(model, weights, mask.bool(), input_ids=ids, attention_mask=mask)


def test_decoder_without_padding_has_no_mask(device):
    model = _model(AutoModelForCausalLM, DECODERS[0][1], device)
    ids = _padded_batch("right", device)[0]
    keep = torch.ones(2, LENGTH, dtype=torch.bool, device=device)
    _assert_same(model, torch.ones(2, LENGTH, VOCAB, device=device), keep, input_ids=ids)


@pytest.mark.parametrize("name,config", DECODERS[:2], ids=[d[0] for d in DECODERS[:2]])
def test_padding_with_holes_matches_eager(name, config, device):
    # Causal attention over the unpadded tokens keeps each query's rank among the real keys;
    # a window counts positions, so with a hole inside a row Mistral takes the dense fallback.
    model = _model(AutoModelForCausalLM, config, device)
    ids, mask = _padded_batch("right", device)
    mask[0, 3:5] = 0
    weights = torch.randn(2, LENGTH, VOCAB, generator=torch.Generator().manual_seed(2)).to(device)
    _assert_same(model, weights, mask.bool(), input_ids=ids, attention_mask=mask)


def test_softcap_with_a_general_mask_raises(device):
    model = _model(AutoModelForCausalLM, DECODERS[3][1], device)
    model.set_attn_implementation(NAME)
    ids, mask = _padded_batch("right", device)
    mask[0, 3:5] = 0  # a hole under a sliding window: only the dense fallback is exact
    with pytest.raises(NotImplementedError, match="softcap"):
        model(input_ids=ids, attention_mask=mask)


def test_custom_4d_mask_matches_eager(device):
    model = _model(AutoModelForCausalLM, DECODERS[0][1], device)
    ids = _padded_batch("right", device)[0]
    allowed = torch.rand(2, 1, LENGTH, LENGTH, generator=torch.Generator().manual_seed(3)) > 0.3
    allowed |= torch.eye(LENGTH, dtype=torch.bool)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    keep = torch.ones(2, LENGTH, dtype=torch.bool, device=device)
    _assert_same(model, torch.randn(2, LENGTH, VOCAB).to(device), keep, input_ids=ids,
                 attention_mask=additive.to(device))


@pytest.mark.parametrize("side", ["left", "right"])
def test_bert_encoder_matches_eager_with_padding(side, device):
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model = _model(AutoModel, config, device)
    ids, mask = _padded_batch(side, device)
    weights = torch.randn(2, LENGTH, 32, generator=torch.Generator().manual_seed(2)).to(device)
    keep = mask.bool()

    def last_hidden(implementation):
        model.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (hidden * weights)[keep].sum().backward()
        return hidden.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}

    ref, ref_grads = last_hidden("eager")
    out, out_grads = last_hidden(NAME)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(out_grads[name], grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padded", [False, True])
def test_modernbert_local_attention_matches_eager(padded, device):
    # Bidirectional sliding windows run the dense fallback (exact, not the varlen path).
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, local_attention=4, global_attn_every_n_layers=2,
        max_position_embeddings=64, pad_token_id=0)
    model = _model(AutoModel, config, device)
    ids, mask = _padded_batch("right", device)
    mask = mask if padded else torch.ones_like(mask)
    hidden = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            hidden[implementation] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(hidden[NAME][keep], hidden["eager"][keep], atol=2e-5, rtol=1e-4)


BART = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                  decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                  forced_eos_token_id=None)


@pytest.mark.parametrize("side", ["left", "right"])
def test_bart_cross_attention_matches_eager_with_padding(side, device):
    model = _model(AutoModelForSeq2SeqLM, BART, device)
    ids, mask = _padded_batch(side, device)
    decoder_ids, decoder_mask = _padded_batch("left" if side == "right" else "right", device)
    decoder_ids, decoder_mask = decoder_ids[:, :7], decoder_mask[:, -7:]
    weights = torch.randn(2, 7, VOCAB, generator=torch.Generator().manual_seed(2)).to(device)
    _assert_same(model, weights, decoder_mask.bool(), input_ids=ids, attention_mask=mask,
                 decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask)


def _sequences(lengths, device):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, VOCAB, (n,), generator=g).to(device) for n in lengths]


@pytest.mark.parametrize("name,config", DECODERS[:4], ids=[d[0] for d in DECODERS[:4]])
@pytest.mark.parametrize("flash_kwargs,use_cache", [(False, False), (False, True), (True, True)],
                         ids=["position_ids", "position_ids_with_cache", "cu_seq_lens"])
def test_packed_batch_matches_padded_batch(name, config, flash_kwargs, use_cache, device):
    # With a cache (use_cache=True) transformers' masks do not see the packing (eager attends
    # across sequences); the backend then finds it in position_ids.
    model = _model(AutoModelForCausalLM, config, device)
    model.set_attn_implementation(NAME)
    sequences = _sequences([3, 7, 1, 5], device)
    padded = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in sequences],
                                           batch_first=True)
    with torch.no_grad():
        expected = model(input_ids=padded, attention_mask=mask).logits[mask.bool()]
        collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs,
                                             return_position_ids=True)
        batch = collate([{"input_ids": s.tolist()} for s in sequences])
        batch.pop("labels")
        assert ("cu_seq_lens_q" in batch) == flash_kwargs
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        packed = model(**batch, use_cache=use_cache).logits[0]
        model.set_attn_implementation("eager")
        eager_packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             use_cache=False).logits[0]
    torch.testing.assert_close(packed, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(packed, eager_packed, atol=2e-5, rtol=1e-4)


def test_packed_training_gradients_match_eager(device):
    model = _model(AutoModelForCausalLM, DECODERS[0][1], device)
    sequences = _sequences([4, 6, 2], device)
    ids = torch.cat(sequences)[None]
    position_ids = torch.cat([torch.arange(len(s), device=device) for s in sequences])[None]
    keep = torch.ones(ids.shape, dtype=torch.bool, device=device)
    weights = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(2))
    _assert_same(model, weights.to(device), keep, input_ids=ids, position_ids=position_ids,
                 use_cache=False)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name,config", [DECODERS[0], DECODERS[3], DECODERS[4]],
                         ids=["llama", "gemma2", "gpt2"])
def test_greedy_generate_matches_eager(name, config, cache, device):
    model = _model(AutoModelForCausalLM, config, device)
    ids, mask = _padded_batch("left", device)
    # min_new_tokens: no row stops early at an end-of-sequence token, every step decodes
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                  cache_implementation=cache)
    if cache == "static":
        kwargs["max_length"] = kwargs.pop("max_new_tokens") + LENGTH
    tokens = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert tokens[NAME].shape == (2, LENGTH + 8)
    assert torch.equal(tokens[NAME], tokens["eager"])


def test_bart_generate_matches_eager(device):
    model = _model(AutoModelForSeq2SeqLM, BART, device)
    ids, mask = _padded_batch("right", device)
    tokens = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(input_ids=ids, attention_mask=mask,
                                                max_new_tokens=6, min_new_tokens=6,
                                                do_sample=False)
    assert torch.equal(tokens[NAME], tokens["eager"])


def test_training_step_with_dropout(device):
    config = LlamaConfig(**TINY, attention_dropout=0.5)
    model = _model(AutoModelForCausalLM, config, device)
    model.set_attn_implementation(NAME)
    model.train()
    ids, mask = _padded_batch("right", device)
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(5)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.manual_seed(6)
    other_draw = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.isfinite(loss) and loss.item() != other_draw.item()  # dropout is applied
    loss.backward()
    before = model.lm_head.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model.lm_head.weight, before)
    model.eval()
    with torch.no_grad():
        evaluated = [model(input_ids=ids, attention_mask=mask, labels=labels).loss
                     for _ in range(2)]
    assert evaluated[0].item() == evaluated[1].item()  # eval mode: no dropout


def test_output_attentions_gives_none(device):
    model = _model(AutoModelForCausalLM, DECODERS[0][1], device)
    model.set_attn_implementation(NAME)
    out = model(input_ids=_padded_batch("right", device)[0], output_attentions=True)
    assert all(weights is None for weights in out.attentions)


@pytest.mark.parametrize("name", ["flash_v100", "my-sdpa", "org/kernel", "eager", ""])
def test_register_refuses_names_transformers_reserves(name):
    with pytest.raises(ValueError, match="name"):
        backend.register(name)


def test_register_returns_a_usable_name():
    assert backend.register("v100_fused_custom") == "v100_fused_custom"
    config = LlamaConfig(**TINY)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="v100_fused_custom")
    assert model.config._attn_implementation == "v100_fused_custom"


def test_package_import_does_not_import_transformers():
    code = "import sys, torch_flash_v100; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("mode", ["dense", "padded", "static_decode"])
def test_every_layer_runs_the_kernels(mode, monkeypatch):
    calls = []

    def counting(function):
        def wrapper(*args, **kwargs):
            calls.append((function.__name__, args[1].shape))
            return function(*args, **kwargs)
        return wrapper

    for function in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                     "_dense_attention"):
        monkeypatch.setattr(backend, function, counting(getattr(backend, function)))
    model = _model(AutoModelForCausalLM, DECODERS[0][1], "cpu")
    model.set_attn_implementation(NAME)
    ids, mask = _padded_batch("left", "cpu")
    if mode == "dense":
        model(input_ids=ids)
        assert calls == [("flash_attn_func", (2, LENGTH, 2, 8))] * 2
    elif mode == "padded":
        model(input_ids=ids, attention_mask=mask)
        assert calls == [("flash_attn_varlen_func", (LENGTH + 6, 2, 8))] * 2
    else:
        model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                       cache_implementation="static", max_length=LENGTH + 2)
        # the prefill over the unpadded tokens, then one decode step on the cache's first 12
        # keys in place (the kernels skip each row's left padding)
        assert calls == [("flash_attn_varlen_func", (LENGTH + 6, 2, 8))] * 2 + [
            ("flash_attn_with_kvcache", (2, LENGTH + 1, 2, 8))] * 2


def _counting(monkeypatch, name):
    """Replaces backend.<name> with a wrapper that records each call's first argument."""
    calls, function = [], getattr(backend, name)
    monkeypatch.setattr(backend, name, lambda *args: calls.append(args[0]) or function(*args))
    return calls


LAYERS3 = LlamaConfig(**dict(TINY, num_hidden_layers=3))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decode_steps_derive_their_indices_once(cache, monkeypatch):
    """A one-token step's cache indices are derived once for all three layers (one host sync);
    every layer's flash_attn_with_kvcache trusts them (no host copies of index values)."""
    derived = _counting(monkeypatch, "_decode_indices")
    kvcache_calls = []
    kvcache = backend.flash_attn_with_kvcache
    monkeypatch.setattr(backend, "flash_attn_with_kvcache", lambda *args, **kwargs: (
        kvcache_calls.append(kwargs) or kvcache(*args, **kwargs)))
    model = _model(AutoModelForCausalLM, LAYERS3, "cpu")
    model.set_attn_implementation(NAME)
    ids, mask = _padded_batch("left", "cpu")
    steps = 3
    kwargs = dict(max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                  pad_token_id=0, cache_implementation=cache)
    tokens = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    model.set_attn_implementation("eager")
    assert torch.equal(tokens, model.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert len(derived) == steps  # the prefill (11 queries) runs varlen
    assert len(kvcache_calls) == 3 * steps
    assert all(call["check_index_values"] is False for call in kvcache_calls)


def test_padded_and_packed_forwards_derive_their_lengths_once(monkeypatch):
    """The varlen indices and lengths of a padded batch, and the sequences of a packed one, are
    derived once per forward for all three layers."""
    unpadded = _counting(monkeypatch, "_unpadding")
    packed_ids = _counting(monkeypatch, "_packed_cu_seqlens")
    model = _model(AutoModelForCausalLM, LAYERS3, "cpu")
    model.set_attn_implementation(NAME)
    ids, mask = _padded_batch("left", "cpu")
    model(input_ids=ids, attention_mask=mask)
    assert len(unpadded) == 1
    flat = DataCollatorWithFlattening(return_tensors="pt")(
        [{"input_ids": row[row != 0].tolist()} for row in ids])
    for use_cache in (False, True):  # sequence ids from the mask function / position_ids
        packed_ids.clear()
        model(input_ids=flat["input_ids"], position_ids=flat["position_ids"], use_cache=use_cache)
        assert len(packed_ids) == 1, use_cache


def test_step_memo_entries_go_with_their_mask():
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert backend._StepMemo.get(mask, "x", lambda: 1) == 1
    assert backend._StepMemo.get(mask, "x", lambda: 2) == 1
    mask[0, 0] = False  # written in place: derived again
    assert backend._StepMemo.get(mask, "x", lambda: 3) == 3
    key = id(mask)
    del mask
    assert key not in backend._StepMemo._by_mask


def test_decode_indices():
    seqlens, leftpad = backend._decode_indices(torch.tensor([[False, True, True],
                                                             [True, True, True]]))
    assert seqlens.tolist() == [3, 3] and leftpad.tolist() == [1, 0]
    assert backend._decode_indices(torch.tensor([[True, False, True]])) is None  # a hole
    assert backend._decode_indices(torch.tensor([[True, True, False]])) is None  # right padding


# fp16 on CUDA (the fused kernels take fp16 / bf16 only): head dim 64.
CUDA_TINY = dict(TINY, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
CUDA_DECODERS = [
    ("llama", LlamaConfig(**CUDA_TINY)),
    ("mistral", MistralConfig(**CUDA_TINY, sliding_window=4)),
    ("gemma2", Gemma2Config(**CUDA_TINY, head_dim=64, sliding_window=4,
                            attn_logit_softcapping=0.5, query_pre_attn_scalar=48)),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,config", CUDA_DECODERS, ids=[d[0] for d in CUDA_DECODERS])
def test_cuda_fp16_matches_eager_fp32(name, config, atom):
    model = _model(AutoModelForCausalLM, config, "cuda")
    ids, mask = _padded_batch("left", "cuda")
    keep = mask.bool()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(input_ids=ids, attention_mask=mask).logits[keep]
        model.half()
        eager_half = model(input_ids=ids, attention_mask=mask).logits[keep].float()
        model.set_attn_implementation(NAME)
        ours = model(input_ids=ids, attention_mask=mask).logits[keep].float()
    # no further from the fp32 result than eager attention in fp16, up to fp16 rounding
    assert (ours - reference).abs().max() <= 2 * (eager_half - reference).abs().max() + 2e-3

    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                               min_new_tokens=6, do_sample=False, pad_token_id=0)
    model.float().set_attn_implementation("eager")
    with torch.no_grad():
        full_mask = torch.cat([mask, torch.ones_like(mask[:, :6])], dim=1)
        logits = model(input_ids=generated, attention_mask=full_mask).logits[:, LENGTH - 1:-1]
    logits[..., model.generation_config.eos_token_id] = float("-inf")  # min_new_tokens hides it
    chosen = logits.gather(-1, generated[:, LENGTH:, None]).squeeze(-1)
    # each generated token is the fp32 argmax, up to fp16-sized near ties
    assert (logits.max(dim=-1).values - chosen).max() <= 1e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_raises_clearly():
    model = _model(AutoModelForCausalLM, CUDA_DECODERS[0][1], "cuda")
    ids, mask = _padded_batch("left", "cuda")
    model.set_attn_implementation(NAME)
    with torch.no_grad(), pytest.raises(TypeError, match="fp16 / bf16 on CUDA"):
        model(input_ids=ids, attention_mask=mask)
