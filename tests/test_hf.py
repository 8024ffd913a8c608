"""Hugging Face transformers integration (attn_implementation="ttt_bob").

Randomly initialised tiny models in float64 on the CPU, compared with the same model under
attn_implementation="sdpa" on PyTorch's math backend: logits at positions that are not
padding, parameter gradients and a Hessian-vector product (relative error <= 1e-8).
Llama-family RMSNorms round to float32 inside (``hidden.to(torch.float32)``), which would
hide differences below float32 precision; the tests run them in float64 (``_float64_norms``).
"""

import importlib.util
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip(
    "transformers",
    minversion="4.48",
    reason="the Hugging Face integration tests need transformers>=4.48 (pip install 'ttt-flash[hf]')",
)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from ttt_flash.integrations import transformers as tb  # noqa: E402

F64 = torch.float64
VOCAB = 61
REL = 1e-8


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tb.register()


pytestmark = pytest.mark.usefixtures("one_thread")


def _rms_forward(self, x):
    # the model's RMSNorm, without its float32 round trip
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _float64_norms(model):
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_rms_forward, m)
    return model


def _build(kind: str, **overrides):
    common = dict(vocab_size=VOCAB, initializer_range=0.3, pad_token_id=0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, attn_pdrop=0.0,
                                      resid_pdrop=0.0, embd_pdrop=0.0, **common)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, **common)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=64, sliding_window=3, **common)
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return _float64_norms(model.to(F64))


def _set(model, impl):
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl


PADDINGS = {
    "none": [[1] * 8, [1] * 8],
    "left": [[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8],
    "right": [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]],
    "mixed": [[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]],
    "interior": [[1, 1, 0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]],
}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _cat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _run(model, impl, ids, mask):
    """logits, parameter gradient and an HVP of a masked next-token loss."""
    _set(model, impl)
    params = [p for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    vecs = [torch.randn(p.shape, generator=gen, dtype=F64) for p in params]
    # next-token targets where both the predicting position and the target are not padding
    targets = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
    with sdpa_kernel(SDPBackend.MATH):
        logits = model(ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hvp = torch.autograd.grad(grads, params, grad_outputs=vecs)
    return logits.detach(), _cat(grads).detach(), _cat(hvp)


# a sliding window over interior padding: test_sliding_window_interior_padding
CASES = [pytest.param(k, p, id=f"{k}-pad-{p}") for k in ("gpt2", "llama", "mistral") for p in PADDINGS
         if not (k == "mistral" and p == "interior")]


@pytest.mark.parametrize("kind, padding", CASES)
def test_outputs_gradients_and_hvp_match_sdpa_math(kind, padding):
    model = _build(kind)
    ids = torch.randint(1, VOCAB, (2, 8))
    mask = torch.tensor(PADDINGS[padding])
    ref_logits, ref_g, ref_h = _run(model, "sdpa", ids, mask)
    logits, g, h = _run(model, tb.NAME, ids, mask)
    valid = mask.bool()
    assert _rel(logits[valid], ref_logits[valid]) <= REL
    assert _rel(g, ref_g) <= REL
    assert _rel(h, ref_h) <= REL
    assert ref_h.norm() > 0 and ref_g.norm() > 0


def test_sliding_window_is_used():
    """The Mistral comparison is meaningful: its window (3) is shorter than the sequence."""
    model = _build("mistral")
    ids = torch.randint(1, VOCAB, (1, 8))
    _set(model, tb.NAME)
    windowed = model(ids).logits
    model.config.sliding_window = 64
    wide = model(ids).logits
    assert (windowed[0, 3:] - wide[0, 3:]).abs().max() > 1e-6


def test_sliding_window_interior_padding():
    """A window over absolute positions with a hole either packs exactly or is refused."""
    model = _build("mistral")
    ids = torch.randint(1, VOCAB, (1, 8))
    mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]])
    _set(model, tb.NAME)
    with pytest.raises(NotImplementedError, match="not of that form"):
        model(ids, attention_mask=mask)


def test_no_mask_and_batch_of_one():
    model = _build("llama")
    ids = torch.randint(1, VOCAB, (1, 9))
    _set(model, "sdpa")
    with sdpa_kernel(SDPBackend.MATH):
        ref = model(ids).logits
    _set(model, tb.NAME)
    assert _rel(model(ids).logits, ref) <= REL


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_generate_with_cache_and_left_padding(kind, cache):
    """Static caches make generate() build the mask ahead and hand it back to the model."""
    model = _build(kind).eval()
    ids = torch.randint(1, VOCAB, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0, cache_implementation=cache)
    out = {}
    for impl in ("sdpa", tb.NAME):
        _set(model, impl)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            out[impl] = model.generate(ids, **kw)
    assert torch.equal(out["sdpa"].sequences, out[tb.NAME].sequences)
    for a, b in zip(out[tb.NAME].scores, out["sdpa"].scores):
        assert _rel(a, b) <= REL


def test_4d_additive_mask_matches_sdpa():
    """A 4-D 0/min float mask (what transformers < 4.53 builds) with right and left padding."""
    model = _build("llama")
    ids = torch.randint(1, VOCAB, (2, 7))
    pad = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]).bool()
    causal = torch.ones(7, 7).tril().bool()
    keep = causal[None] & pad[:, None, :]
    mask4d = torch.zeros(2, 1, 7, 7, dtype=F64).masked_fill(~keep[:, None], torch.finfo(F64).min)
    out = {}
    for impl in ("sdpa", tb.NAME):
        _set(model, impl)
        with sdpa_kernel(SDPBackend.MATH):
            out[impl] = model(ids, attention_mask=mask4d).logits
    assert _rel(out[tb.NAME][pad], out["sdpa"][pad]) <= REL
    assert (out[tb.NAME][~pad] - out["sdpa"][~pad]).abs().max() > 0  # padded rows: ours are 0-attention


def test_attention_bias_is_refused():
    model = _build("llama")
    _set(model, tb.NAME)
    ids = torch.randint(1, VOCAB, (1, 5))
    bias = torch.randn(1, 1, 5, 5, dtype=F64)
    with pytest.raises(ValueError, match="attention bias"):
        model(ids, attention_mask=bias)


def test_unrepresentable_4d_mask_is_refused():
    model = _build("llama")
    _set(model, tb.NAME)
    ids = torch.randint(1, VOCAB, (1, 6))
    keep = torch.ones(6, 6).tril().bool()
    keep[4, 1] = False  # a hole inside the causal range
    with pytest.raises(NotImplementedError, match="not of that form"):
        model(ids, attention_mask=keep[None, None])


def test_packed_sequences_without_mask_are_refused():
    model = _build("llama")
    _set(model, tb.NAME)
    ids = torch.randint(1, VOCAB, (1, 7))
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    with pytest.raises(NotImplementedError, match="not of that form"):
        model(ids, position_ids=position_ids, use_cache=False)


def test_dropout_in_training_is_refused():
    model = _build("gpt2", attn_pdrop=0.1)
    _set(model, tb.NAME)
    ids = torch.randint(1, VOCAB, (1, 5))
    model.eval()
    model(ids)  # dropout is 0 in eval mode
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(ids)


def test_softcap_and_sinks_are_refused():
    module = torch.nn.Module()
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8)
    with pytest.raises(NotImplementedError, match="softcap"):
        tb.ttt_bob_attention(module, q, kv, kv, None, softcap=30.0)
    with pytest.raises(NotImplementedError, match="sinks"):
        tb.ttt_bob_attention(module, q, kv, kv, None, s_aux=torch.zeros(4))


def test_attention_function_layout_gqa_and_value_dim():
    """Direct call: (B, N, H, D) output, GQA without repeat, D_v < D_qk, causal from module."""
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(2, 4, 5, 8, dtype=F64)
    k = torch.randn(2, 2, 5, 8, dtype=F64)
    v = torch.randn(2, 2, 5, 6, dtype=F64)
    out, weights = tb.ttt_bob_attention(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 5, 4, 6)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                             is_causal=True, scale=0.3)
    assert _rel(out, ref.transpose(1, 2)) <= 1e-12


def test_register_is_idempotent():
    from transformers.masking_utils import AttentionMaskInterface

    before = dict(transformers.AttentionInterface._global_mapping)
    before_mask = dict(AttentionMaskInterface._global_mapping)
    assert tb.register() == "ttt_bob"
    assert tb.register() == "ttt_bob"
    assert dict(transformers.AttentionInterface._global_mapping) == before
    assert dict(AttentionMaskInterface._global_mapping) == before_mask
    assert before[tb.NAME] is tb.ttt_bob_attention
    assert before_mask[tb.NAME] is tb.ttt_bob_mask
    assert "flash" not in tb.NAME


def test_maml_example_runs():
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_maml.py"
    spec = importlib.util.spec_from_file_location("hf_maml", path)
    hf_maml = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_maml)
    result = hf_maml.main(steps=2, seq_len=8, batch=2, seed=0, verbose=False)
    assert result["second_order_norm"] > 0
    assert result["relative_difference_to_first_order"] > 1e-3
    assert result["relative_difference_to_sdpa_math"] <= REL


def test_torch_func_hvp_matches_autograd():
    """torch.func.grad / vjp over functional_call of an HF model with padding."""
    from torch.func import functional_call, grad, vjp

    model = _build("llama")
    _set(model, tb.NAME)
    ids = torch.randint(1, VOCAB, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    labels = ids.masked_fill(mask == 0, -100)
    params = {n: p.detach() for n, p in model.named_parameters()}
    vecs = {n: torch.randn_like(t) for n, t in params.items()}

    def loss(p):
        return functional_call(model, p, (ids,), {"attention_mask": mask, "labels": labels}).loss

    _, pull = vjp(grad(loss), params)
    (hvp,) = pull(vecs)
    names = list(params)
    leaves = [params[n].clone().requires_grad_(True) for n in names]
    g = torch.autograd.grad(loss(dict(zip(names, leaves))), leaves, create_graph=True)
    ref = torch.autograd.grad(g, leaves, grad_outputs=[vecs[n] for n in names])
    assert _rel(_cat([hvp[n] for n in names]), _cat(ref)) <= 1e-12
