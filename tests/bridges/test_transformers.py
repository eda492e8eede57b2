"""The HuggingFace transformers backend (:mod:`attnnb.transformers`).

Tiny models with random weights (nothing downloaded) are built twice with
the same weights, once with a reference attention and once with
``attn_implementation="attnnb"``; their logits and the gradients of every
parameter must agree.  The reference is ``"eager"`` where its softmax runs
in the model's dtype (BERT, BART, T5: float64, tight tolerance).  Llama and
Mistral's eager softmax runs in float32 whatever the model's dtype (and
turns fully padded rows into NaN in float64), so they are compared with
``"sdpa"`` in float64 (tight) and with ``"eager"`` in float32.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import attnnb.torch  # noqa: E402
import attnnb.transformers as atf  # noqa: E402

atf.register()

VOCAB = 50
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=VOCAB, initializer_range=0.2)  # 0.2: attention far from uniform
# (reference implementation, dtype, rtol): Llama and Mistral
DECODER_CASES = [("sdpa", torch.float64, 1e-10), ("eager", torch.float32, 1e-5)]


def _pair(build, reference: str, dtype: torch.dtype):
    """The model ``build()`` makes, with ``reference`` attention, and its attnnb copy."""
    torch.manual_seed(0)
    ref = build(reference).to(dtype).eval()
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation("attnnb")
    assert ref.config._attn_implementation == reference
    assert ours.config._attn_implementation == "attnnb"
    return ref, ours


def _close(actual, expected, rtol, what, scale=None):
    """``actual == expected`` to ``rtol``; entries near zero to ``rtol * scale`` (default: the
    largest entry of ``expected``), as they carry the rounding of the large ones."""
    scale = float(expected.detach().abs().max()) if scale is None else scale
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale + 1e-300,
                               msg=lambda m: f"{what}: {m}")


def _check(ref, ours, inputs: dict, rtol: float, rows=None):
    """Logits and all parameter gradients of ``ref`` and ``ours`` agree on ``inputs``.

    ``rows`` (a bool ``(batch, seq)`` tensor) picks the positions compared and
    put in the loss: padded queries of a causal model see no key, a row that
    PyTorch's SDPA and attnnb give as zeros and eager as a uniform average.
    """
    results = []
    for model in (ref, ours):
        logits = model(**inputs).logits
        if rows is not None:
            logits = logits[rows]
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(logits.square().mean(), params, allow_unused=True)
        results.append((logits, grads, [n for n, p in model.named_parameters() if p.requires_grad]))
    (l_ref, g_ref, names), (l_ours, g_ours, _) = results
    assert torch.isfinite(l_ref).all()
    _close(l_ours, l_ref, rtol, "logits")
    assert any(g is not None and g.abs().max() > 0 for g in g_ours)
    # some gradients are zero but for rounding (a key bias shifts a whole row of logits)
    scale = max(float(g.abs().max()) for g in g_ref if g is not None)
    for name, a, b in zip(names, g_ours, g_ref):
        if b is None:
            assert a is None or not a.any(), name
            continue
        _close(a, b, rtol, f"gradient of {name}", scale)


def _tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _left_padded(seq: int = 9, pad: int = 3):
    ids = _tokens(2, seq)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


# ---------------------------------------------------------------------------
# registration


def test_register_is_idempotent():
    atf.register()
    atf.register()
    assert transformers.AttentionInterface._global_mapping["attnnb"] is atf.attention_forward
    assert AttentionMaskInterface._global_mapping["attnnb"] is atf.attention_mask
    assert "attnnb" in transformers.AttentionInterface().valid_keys()


def test_import_attnnb_does_not_import_transformers():
    code = "import sys, attnnb; assert 'transformers' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------
# decoder-only models


def _llama(**extra):
    def build(impl):
        config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2,
                                          max_position_embeddings=64, **extra)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    return build


def _mistral(impl):
    config = transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=3,
                                        max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)


@pytest.mark.parametrize("reference, dtype, rtol", DECODER_CASES)
def test_llama_gqa_left_padding(reference, dtype, rtol):
    ref, ours = _pair(_llama(), reference, dtype)
    assert ours.model.layers[0].self_attn.num_key_value_groups == 2
    ids, mask = _left_padded()
    _check(ref, ours, dict(input_ids=ids, attention_mask=mask), rtol, rows=mask.bool())


@pytest.mark.parametrize("reference, dtype, rtol", DECODER_CASES)
def test_llama_causal_without_mask(reference, dtype, rtol):
    ref, ours = _pair(_llama(), reference, dtype)
    _check(ref, ours, dict(input_ids=_tokens(2, 8)), rtol)


@pytest.mark.parametrize("reference, dtype, rtol", DECODER_CASES)
def test_mistral_sliding_window(reference, dtype, rtol):
    ref, ours = _pair(_mistral, reference, dtype)
    assert ours.config.sliding_window < 9
    _check(ref, ours, dict(input_ids=_tokens(2, 9)), rtol)
    ids, mask = _left_padded()
    _check(ref, ours, dict(input_ids=ids, attention_mask=mask), rtol, rows=mask.bool())


@pytest.mark.parametrize("build", [_llama(), _mistral], ids=["llama", "mistral"])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_cache(build, padded, cache):
    """A static cache's prefill sees more keys than queries: top-left causal, no mask."""
    ref, ours = _pair(build, "sdpa", torch.float64)
    if padded:
        ids, mask = _left_padded(seq=7)
        inputs = dict(input_ids=ids, attention_mask=mask)
    else:
        inputs = dict(input_ids=_tokens(1, 7), attention_mask=torch.ones(1, 7, dtype=torch.long))
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, use_cache=True,
                  pad_token_id=0, cache_implementation=cache)
    expected = ref.generate(**inputs, **kwargs)
    got = ours.generate(**inputs, **kwargs)
    assert got.shape == (inputs["input_ids"].shape[0], 12)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_generate_matches_eager():
    ref, ours = _pair(_llama(), "eager", torch.float32)
    ids, mask = _left_padded(seq=7)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(ours.generate(input_ids=ids, attention_mask=mask, **kwargs),
                               ref.generate(input_ids=ids, attention_mask=mask, **kwargs),
                               rtol=0, atol=0)


def test_purely_causal_mask_is_none_and_attnnb_runs_causal(monkeypatch):
    """No padding, no window: no mask is built and the drop-in's own causal limit runs."""
    calls = []
    original = attnnb.torch.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((attn_mask, kwargs["is_causal"], kwargs["enable_gqa"], query.shape[-2]))
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attnnb.torch, "scaled_dot_product_attention", spy)
    _, ours = _pair(_llama(), "sdpa", torch.float64)
    ours.generate(input_ids=_tokens(1, 6), attention_mask=torch.ones(1, 6, dtype=torch.long),
                  max_new_tokens=2, do_sample=False, pad_token_id=0)
    prefill, decode = calls[0], calls[-1]
    assert prefill[0] is None and prefill[1] and prefill[2] and prefill[3] == 6
    assert decode[0] is None and not decode[1] and decode[3] == 1  # one query sees every key
    calls.clear()
    ids, mask = _left_padded()
    ours(input_ids=ids, attention_mask=mask)
    assert calls[0][0].dtype == torch.bool and not calls[0][1]


def test_sliding_window_runs_as_a_mask_function_with_no_mask_built(monkeypatch):
    """Mistral with no padding: its window layers get no mask (transformers' own window
    function recognised) and the drop-in gets ``mods.sliding_window`` (prefill and one
    query decoding from a dynamic cache), against sdpa; padding builds the mask again,
    and any other mask function (chunks) is built as it is."""
    from transformers.masking_utils import (
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )

    calls = []
    original = attnnb.torch.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((attn_mask, kwargs.get("mask_mod"), kwargs["is_causal"], query.shape[-2]))
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attnnb.torch, "scaled_dot_product_attention", spy)
    ref, ours = _pair(_mistral, "sdpa", torch.float64)
    _check(ref, ours, dict(input_ids=_tokens(2, 9)), 1e-10)
    assert calls and all(m is None and mod is not None and mod.name == "sliding_window(3)"
                         and not causal for m, mod, causal, _ in calls)
    calls.clear()
    ids = _tokens(1, 6)
    kw = dict(attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=4,
              do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))
    assert calls[-1][0] is None and calls[-1][1] is not None and calls[-1][3] == 1
    calls.clear()
    ids, mask = _left_padded()
    ours(input_ids=ids, attention_mask=mask)
    assert all(m is not None and mod is None for m, mod, _, _ in calls)
    window = dict(batch_size=1, q_length=9, kv_length=9)
    assert atf.attention_mask(mask_function=sliding_window_causal_mask_function(3),
                              **window) is None
    for other in (chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long)),
                  causal_mask_function):
        built = atf.attention_mask(mask_function=other, local_size=3, **window)
        assert built is not None and built.dtype == torch.bool


def _dropout_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, attention_dropout=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="attnnb")
    return model.double().train()


def test_train_mode_with_attention_dropout_applies_it():
    model = _dropout_llama()
    ids = _tokens(2, 7)
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)  # attnnb draws its dropout seed from torch's generator
        runs.append(model(input_ids=ids).logits)
    model.eval()
    plain = model(input_ids=ids).logits
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)
    assert not torch.allclose(runs[2], runs[0]) and not torch.allclose(runs[0], plain)
    grads = torch.autograd.grad(runs[0].square().mean(), list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


def test_train_mode_without_attention_dropout():
    ref, ours = _pair(_llama(attention_dropout=0.0), "sdpa", torch.float64)
    ref.train()
    ours.train()
    ids, mask = _left_padded()
    _check(ref, ours, dict(input_ids=ids, attention_mask=mask), 1e-10, rows=mask.bool())


def test_gemma2_softcap_runs_as_a_score_function():
    """Gemma 2's logit soft-capping (a small cap, so that it binds) and its sliding window,
    logits and every gradient against eager (a float64 model, but eager's softmax runs in
    float32 here: float32's tolerance)."""
    def build(impl):
        config = transformers.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8,
                                           sliding_window=4, attn_logit_softcapping=0.5,
                                           max_position_embeddings=64)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)

    ref, ours = _pair(build, "eager", torch.float64)
    _check(ref, ours, dict(input_ids=_tokens(2, 9)), 1e-5)


# ---------------------------------------------------------------------------
# encoders and encoder-decoders (eager's softmax runs in float64: tight tolerance)


def test_bert_bidirectional_with_padding():
    def build(impl):
        config = transformers.BertConfig(**SMALL, max_position_embeddings=32)
        return transformers.AutoModelForMaskedLM.from_config(config, attn_implementation=impl)

    ref, ours = _pair(build, "eager", torch.float64)
    ids = _tokens(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    _check(ref, ours, dict(input_ids=ids, attention_mask=mask), 1e-10)
    _check(ref, ours, dict(input_ids=ids), 1e-10)


def _t5(impl):
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8,
                                   decoder_start_token_id=0, dropout_rate=0.0)
    return transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=impl)


def _bart(impl):
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32,
                                     init_std=0.2, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0)
    return transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=impl)


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_encoder_decoder_with_cross_attention(build):
    ref, ours = _pair(build, "eager", torch.float64)
    src = _tokens(2, 9, seed=2)
    src_mask = torch.ones(2, 9, dtype=torch.long)
    src_mask[0, 7:] = 0
    tgt = _tokens(2, 7, seed=3)
    _check(ref, ours, dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt), 1e-10)
    _check(ref, ours, dict(input_ids=src, decoder_input_ids=tgt), 1e-10)


def test_t5_relative_position_bias_gets_its_gradient():
    ref, ours = _pair(_t5, "eager", torch.float64)
    inputs = dict(input_ids=_tokens(1, 6, seed=2), decoder_input_ids=_tokens(1, 5, seed=3))
    bias = ours.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    (g,) = torch.autograd.grad(ours(**inputs).logits.square().mean(), [bias])
    (g_ref,) = torch.autograd.grad(ref(**inputs).logits.square().mean(),
                                   [ref.encoder.block[0].layer[0].SelfAttention
                                    .relative_attention_bias.weight])
    assert g.abs().max() > 0
    _close(g, g_ref, 1e-10, "relative_attention_bias")


def test_t5_generate_with_cache():
    ref, ours = _pair(_t5, "eager", torch.float64)
    src = _tokens(2, 8, seed=2)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    kwargs = dict(input_ids=src, attention_mask=mask, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(ours.generate(**kwargs), ref.generate(**kwargs), rtol=0, atol=0)


# ---------------------------------------------------------------------------
# the attention function called directly


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(heads=4, kv_heads=2, q_len=5, kv_len=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(2, heads, q_len, 8, generator=gen, dtype=dtype),
            torch.randn(2, kv_heads, kv_len, 8, generator=gen, dtype=dtype),
            torch.randn(2, kv_heads, kv_len, 8, generator=gen, dtype=dtype))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_position_bias_matches_sdpa_integration(mask_kind, is_causal):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(kv_heads=4)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 4, 5, 5, generator=gen, dtype=torch.float64)
    keep = torch.rand(2, 1, 5, 5, generator=gen) > 0.3
    keep[..., 0] = True
    mask = {"none": None, "bool": keep,
            "float": torch.where(keep, 0.0, -1e9).to(torch.float64)}[mask_kind]
    kwargs = dict(scaling=1.0, is_causal=is_causal, position_bias=bias)
    out, weights = atf.attention_forward(_Module(), q, k, v, mask, **kwargs)
    expected, _ = sdpa_attention_forward(_Module(), q, k, v, mask, **kwargs)
    assert weights is None and out.shape == (2, 5, 4, 8) and out.is_contiguous()
    _close(out, expected, 1e-12, "attention output")


@pytest.mark.parametrize("name, value, words", [
    ("indices", torch.zeros(2, 5, 2, dtype=torch.int32), "indexer"),
])
def test_refused_keywords(name, value, words):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=f"{words}.*{name}="):
        atf.attention_forward(_Module(), q, k, v, None, **{name: value})
    atf.attention_forward(_Module(), q, k, v, None, **{name: None})  # None: not asked for


def test_ignored_and_unknown_keywords(recwarn, monkeypatch):
    monkeypatch.setattr(atf, "_warned", set())  # each name warns once per process
    q, k, v = _qkv()
    expected, _ = atf.attention_forward(_Module(), q, k, v, None)
    out, _ = atf.attention_forward(_Module(), q, k, v, None, sliding_window=64,
                                   position_ids=torch.arange(5)[None],
                                   cu_seq_lens_q=torch.tensor([0, 5]), output_attentions=False)
    assert not recwarn.list
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.warns(UserWarning, match="some_new_keyword"):
        atf.attention_forward(_Module(), q, k, v, None, some_new_keyword=1.5)
    with pytest.warns(UserWarning, match="output_attentions"):
        atf.attention_forward(_Module(), q, k, v, None, output_attentions=True)


def test_bert_training_step_with_attention_dropout():
    """BERT's default attention dropout (0.1) in train mode: an AdamW step runs through
    attnnb's dropout, reproducibly under ``torch.manual_seed``; with the dropout at 0 the
    same step gives eager's loss."""
    def step(impl, dropout, seed):
        torch.manual_seed(0)
        config = transformers.BertConfig(**SMALL, max_position_embeddings=32,
                                         hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=dropout)
        model = transformers.AutoModelForMaskedLM.from_config(config, attn_implementation=impl)
        model = model.double().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = _tokens(2, 9)
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
        torch.manual_seed(seed)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach()), [p.detach().clone() for p in model.parameters()]

    loss, params = step("attnnb", 0.1, 1)
    again, params_again = step("attnnb", 0.1, 1)
    other, _ = step("attnnb", 0.1, 2)
    assert loss == again and loss != other
    assert all(torch.equal(a, b) for a, b in zip(params, params_again))
    assert all(bool(torch.isfinite(p).all()) for p in params)
    plain, _ = step("attnnb", 0.0, 1)
    eager, _ = step("eager", 0.0, 1)
    assert plain == pytest.approx(eager, rel=1e-10) and loss != plain


def test_gpt_oss_sinks_against_eager():
    """gpt-oss's learned sinks (``s_aux``) run as attnnb's ``sinks``: logits and every
    parameter's gradient, the sinks' included, against eager (float32: the experts'
    grouped products take no float64; sliding-window layers and full layers)."""
    def build(impl):
        torch.manual_seed(0)
        config = transformers.GptOssConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_local_experts=2,
            num_experts_per_tok=1, sliding_window=4, max_position_embeddings=64,
            initializer_range=0.2, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
        return model.eval()

    ref, ours = build("eager"), build("attnnb")
    ids = _tokens(2, 9)
    results = []
    for model in (ref, ours):
        logits = model(input_ids=ids).logits
        sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
        assert sinks
        grads = torch.autograd.grad(logits.square().mean(), list(model.parameters()))
        results.append((logits, grads))
    (ref_logits, ref_grads), (logits, grads) = results
    _close(logits, ref_logits, 1e-5, "logits")
    for g, r in zip(grads, ref_grads):
        _close(g, r, 1e-4, "gradient")
