"""Tests of ttt_flash.models: shapes, weight tying, attention implementations agreeing,
exact second-order gradients, functional_call, activation checkpointing, RoPE positions
and config validation. CPU, float64 for every exactness check."""

import math

import pytest
import torch
from torch.func import functional_call

from ttt_flash.models import GPT, GPTConfig, causal_attention, lm_loss

V, N = 64, 16


def small(**overrides) -> GPTConfig:
    """Smaller than GPTConfig.tiny so the float64 second-order tests stay fast: D = 8."""
    return GPTConfig.tiny(**{"vocab_size": V, "d_model": 32, **overrides})


def make(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).double()


def tokens(b: int = 2, n: int = N) -> torch.Tensor:
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(1))


def rel(a, b) -> float:
    a = torch.cat([x.flatten() for x in a])
    b = torch.cat([x.flatten() for x in b])
    return ((a - b).norm() / b.norm()).item()


def hvp(model: GPT, idx: torch.Tensor, seed: int = 2):
    """(gradient, Hessian-vector product) of the LM loss w.r.t. all parameters."""
    params = list(model.parameters())
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    grads = torch.autograd.grad(loss, params, create_graph=True)
    gen = torch.Generator().manual_seed(seed)
    vecs = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    hv = torch.autograd.grad(grads, params, grad_outputs=vecs)
    return [g.detach() for g in grads], list(hv)


ATTN_CONFIGS = [
    pytest.param({}, id="mha"),
    pytest.param({"n_kv_head": 2}, id="gqa2"),
    pytest.param({"window": 5}, id="window5"),
    pytest.param({"n_kv_head": 1, "window": 3}, id="mqa-window3"),
]


# --------------------------------------------------------------------------- shapes and tying


def test_logits_and_hidden_shapes():
    model = make(small())
    idx = tokens()
    logits = model(idx)
    hidden = model(idx, return_hidden=True)
    assert logits.shape == (2, N, V) and logits.dtype == torch.float64
    assert hidden.shape == (2, N, 32)
    torch.testing.assert_close(logits, hidden @ model.tok_emb.weight.T, rtol=0, atol=1e-12)


def test_tied_weights_are_one_parameter():
    tied = make(small())
    assert tied.output_weight is tied.tok_emb.weight
    assert not any("lm_head" in k for k in tied.state_dict())
    # the head's gradient lands in the embedding, also for embedding rows never looked up
    idx = torch.zeros(1, 4, dtype=torch.long)
    (g,) = torch.autograd.grad(tied(idx)[..., V - 1].sum(), tied.tok_emb.weight)
    assert g[V - 1].abs().sum() > 0
    untied = make(small(tie_embeddings=False))
    assert untied.output_weight is not untied.tok_emb.weight
    assert untied.num_parameters() == tied.num_parameters() + V * 32
    assert untied.num_parameters(exclude_embeddings=True) == tied.num_parameters(exclude_embeddings=True)


def test_parameter_count_and_init():
    cfg = small()
    model = make(cfg)
    d, h = cfg.d_model, cfg.mlp_hidden
    per_block = d * 3 * d + d * d + 3 * d * h + 2 * d
    assert model.num_parameters() == V * d + cfg.n_layer * per_block + d
    assert model.num_parameters(exclude_embeddings=True) == model.num_parameters() - V * d
    big = GPT(GPTConfig.tiny(n_layer=8, d_model=256, vocab_size=4096))
    assert abs(big.tok_emb.weight.std().item() - 0.02) < 1e-3
    assert abs(big.blocks[0].mlp.down.weight.std().item() - 0.02 / math.sqrt(16)) < 1e-3
    assert abs(big.blocks[0].attn.proj.weight.std().item() - 0.02 / math.sqrt(16)) < 1e-3


# --------------------------------------------------------------------------- attention implementations


@pytest.mark.parametrize("overrides", ATTN_CONFIGS)
def test_attention_impls_give_same_logits(overrides):
    idx = tokens()
    out = {impl: make(small(attention=impl, **overrides))(idx) for impl in ("ttt_flash", "math", "sdpa")}
    torch.testing.assert_close(out["ttt_flash"], out["math"], rtol=0, atol=1e-10)
    torch.testing.assert_close(out["sdpa"], out["math"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("impl", ["ttt_flash", "math", "sdpa"])
@pytest.mark.parametrize("window", [None, 1, 4], ids=["full", "w1", "w4"])
def test_causal_attention_matches_hand_loop(impl, window):
    b, hq, hkv, n, d = 1, 4, 2, 9, 8
    q = torch.randn(b, hq, n, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, n, d, dtype=torch.float64) for _ in range(2))
    out = causal_attention(q, k, v, impl=impl, window=window)
    expected = torch.empty_like(q)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(n):
            lo = 0 if window is None else max(0, i - window + 1)
            p = torch.softmax(k[0, kh, lo : i + 1] @ q[0, h, i] / math.sqrt(d), dim=0)
            expected[0, h, i] = p @ v[0, kh, lo : i + 1]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_window_changes_output_only_beyond_the_window():
    idx = tokens()
    full = make(small())(idx)
    windowed = make(small(window=4))(idx)
    # the first 4 tokens see their whole prefix either way
    torch.testing.assert_close(windowed[:, :4], full[:, :4], rtol=0, atol=1e-12)
    assert (windowed[:, 4:] - full[:, 4:]).abs().amax(dim=-1).min() > 1e-6


# --------------------------------------------------------------------------- second order


@pytest.mark.parametrize("overrides", [ATTN_CONFIGS[0], ATTN_CONFIGS[3]])
def test_hvp_ttt_flash_equals_math(overrides):
    idx = tokens(n=13)
    g_flash, h_flash = hvp(make(small(attention="ttt_flash", **overrides)), idx)
    g_math, h_math = hvp(make(small(attention="math", **overrides)), idx)
    assert rel(g_flash, g_math) < 1e-10
    assert rel(h_flash, h_math) < 1e-8
    assert all(h.abs().sum() > 0 for h in h_flash[1:])  # attention weights get a real HVP


# --------------------------------------------------------------------------- functional_call


def test_functional_call_equals_loading_params():
    model = make(small(n_kv_head=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    params = {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in model.named_parameters()}
    idx = tokens()
    out = functional_call(model, params, (idx,))
    loaded = make(small(n_kv_head=2), seed=5)
    loaded.load_state_dict(params)
    torch.testing.assert_close(out, loaded(idx), rtol=0, atol=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # the module itself is untouched


def maml_meta_grad(model: GPT, idx: torch.Tensor, lr: float = 0.5):
    """One inner SGD step on the first half of the batch through functional_call, outer loss
    on the second half, gradient w.r.t. the initial parameters (second order)."""
    params = dict(model.named_parameters())
    inner = lm_loss(functional_call(model, params, (idx[:1, :-1],)), idx[:1, 1:])
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {k: p - lr * g for (k, p), g in zip(params.items(), grads)}
    outer = lm_loss(functional_call(model, fast, (idx[1:, :-1],)), idx[1:, 1:])
    return torch.autograd.grad(outer, list(params.values()))


# --------------------------------------------------------------------------- checkpointing


def test_checkpoint_same_first_and_second_order():
    idx = tokens(n=11)
    g_plain, h_plain = hvp(make(small(window=4)), idx)
    g_ckpt, h_ckpt = hvp(make(small(window=4, checkpoint=True)), idx)
    assert rel(g_ckpt, g_plain) < 1e-12
    assert rel(h_ckpt, h_plain) < 1e-12


def test_checkpoint_under_functional_call_meta_gradient():
    # The block recomputation must use the parameters passed to functional_call, not the
    # module's own (which are back in place by the time backward runs).
    idx = tokens(n=11)
    plain = maml_meta_grad(make(small(n_kv_head=2)), idx)
    ckpt = maml_meta_grad(make(small(n_kv_head=2, checkpoint=True)), idx)
    math_ = maml_meta_grad(make(small(n_kv_head=2, attention="math")), idx)
    assert rel(ckpt, plain) < 1e-12
    assert rel(plain, math_) < 1e-8


# --------------------------------------------------------------------------- inputs and positions


def test_inputs_embeds_matches_idx_and_memory_tokens():
    model = make(small())
    idx = tokens()
    emb = model.tok_emb(idx)
    torch.testing.assert_close(model(inputs_embeds=emb), model(idx), rtol=0, atol=0)
    # prepend 3 learned memory tokens; causal, so they change every later output
    memory = torch.randn(1, 3, 32, dtype=torch.float64, requires_grad=True)
    x = torch.cat([memory.expand(2, -1, -1), emb], dim=1)
    hidden = model(inputs_embeds=x, positions=torch.arange(-3, N), return_hidden=True)
    assert hidden.shape == (2, N + 3, 32)
    (g,) = torch.autograd.grad(hidden[:, 3:].square().sum(), memory)
    assert g.abs().sum() > 0
    with pytest.raises(ValueError, match="exactly one of idx and inputs_embeds"):
        model(idx, inputs_embeds=emb)
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=emb[..., :16])


def test_rope_is_relative_shifting_positions_changes_nothing():
    model = make(small(n_kv_head=2, window=6))
    idx = tokens()
    base = model(idx)
    torch.testing.assert_close(model(idx, positions=1000), base, rtol=0, atol=1e-10)
    per_batch = torch.tensor([[7], [-50]]) + torch.arange(N)  # (B, N): a different shift per row
    torch.testing.assert_close(model(idx, positions=per_batch), base, rtol=0, atol=1e-10)
    # positions are really used: spreading them apart changes the logits
    assert (model(idx, positions=3 * torch.arange(N)) - base).abs().max() > 1e-6
    with pytest.raises(ValueError, match="positions"):
        model(idx, positions=torch.arange(N + 1))


# --------------------------------------------------------------------------- losses, dropout


def test_lm_loss_ignore_index():
    logits = torch.randn(2, 5, V, dtype=torch.float64)
    targets = torch.randint(0, V, (2, 5))
    targets[0, :2] = -100
    keep = targets != -100
    expected = -torch.log_softmax(logits, -1)[keep].gather(-1, targets[keep][:, None]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), expected)


def test_dropout_only_in_training():
    model = make(small(dropout=0.2))
    idx = tokens()
    model.eval()
    torch.testing.assert_close(model(idx), model(idx), rtol=0, atol=0)
    model.train()
    assert (model(idx) - make(small())(idx)).abs().max() > 1e-6


# --------------------------------------------------------------------------- config


def test_presets_and_defaults():
    tiny = GPTConfig.tiny()
    assert (tiny.n_layer, tiny.d_model, tiny.n_head, tiny.vocab_size) == (2, 64, 4, 256)
    assert tiny.n_kv_head == 4 and tiny.mlp_hidden == 192 and tiny.head_dim == 16
    small_ = GPTConfig.gpt2_small(vocab_size=256)
    assert (small_.n_layer, small_.d_model, small_.n_head, small_.vocab_size) == (12, 768, 12, 256)
    assert small_.mlp_hidden == 2048 and GPTConfig.gpt2_small().vocab_size == 50304
    with pytest.raises(TypeError, match="unknown GPTConfig field"):
        GPTConfig.tiny(n_layers=3)


@pytest.mark.parametrize(
    "overrides, field",
    [
        pytest.param({"d_model": 30}, r"d_model \(30\) must be divisible by GPTConfig\.n_head", id="d_model-indivisible"),
        pytest.param({"d_model": 12}, r"head dim", id="odd-head-dim"),
        pytest.param({"n_kv_head": 3}, r"multiple of GPTConfig\.n_kv_head", id="n_kv_head"),
        pytest.param({"attention": "flash"}, r"GPTConfig\.attention", id="attention"),
        pytest.param({"window": 0}, r"GPTConfig\.window", id="window"),
        pytest.param({"n_layer": 0}, r"GPTConfig\.n_layer", id="n_layer"),
        pytest.param({"vocab_size": 0}, r"GPTConfig\.vocab_size", id="vocab_size"),
        pytest.param({"dropout": 1.0}, r"GPTConfig\.dropout", id="dropout"),
        pytest.param({"rope_base": 0.5}, r"GPTConfig\.rope_base", id="rope_base"),
        pytest.param({"mlp_hidden": 0}, r"GPTConfig\.mlp_hidden", id="mlp_hidden"),
    ],
)
def test_bad_config_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig.tiny(**overrides)


def test_config_type_errors():
    with pytest.raises(TypeError, match=r"GPTConfig\.window"):
        GPTConfig.tiny(window=2.5)
    with pytest.raises(TypeError, match=r"GPTConfig\.checkpoint"):
        GPTConfig.tiny(checkpoint="yes")
