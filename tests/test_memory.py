"""Gradient-written memory (ttt_flash.memory), its tasks and its Lightning modules.

The central checks: for GradMem, fast-weight TTT and GradientMemoryAttention, the outer
gradient (second order through every inner step) with ``attention="ttt_flash"`` equals the
one through materialised softmax attention (``"math"``) in float64, and differs from the
first-order gradient. The recipes' parsing and fast_dev_run are in tests/test_recipes.py.
"""

import pytest
import torch

from ttt_flash.memory import FastWeightTTT, GradientMemoryAttention, GradMem, MemoryLM, masked_lm_loss
from ttt_flash.models import GPT, GPTConfig
from ttt_flash.tasks import AssociativeRecallTasks, KeyValueRetrievalTasks, MQARTasks, RecallBatch

F64 = torch.float64
TASK = AssociativeRecallTasks(num_keys=6, num_values=5, num_pairs=3, num_queries=3, context_len=10)
V = TASK.vocab_size


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(b=2, seed=0) -> RecallBatch:
    return TASK.sample(b, generator=torch.Generator().manual_seed(seed))


def _gpt(attention, **kw):
    return GPT(GPTConfig.tiny(vocab_size=V, n_layer=2, n_head=2, d_model=16, attention=attention, **kw))


def _build(kind: str, attention: str, first_order: bool = False, **kw):
    torch.manual_seed(1)
    if kind == "gradmem":
        net = GradMem(_gpt(attention, **kw), memory_tokens=3, inner_steps=2, inner_lr=3.0, first_order=first_order)
    elif kind == "ttt":
        net = FastWeightTTT(_gpt(attention, window=3, **kw), fast_layers=[-1], chunk_size=4, inner_steps=1,
                            inner_lr=2.0, first_order=first_order)
    else:
        net = MemoryLM(V, 16, 1, 2, memory_slots=3, inner_steps=2, inner_lr=2.0, chunk_size=4,
                       attention=attention, first_order=first_order, **kw)
    return net.to(F64)


def _outer_loss(kind, net, batch):
    if kind == "layer":
        logits = net(torch.cat([batch.context, batch.query], 1))[:, batch.context.shape[1]:]
    else:
        logits = net(batch.context, batch.context_targets, batch.query)
    return masked_lm_loss(logits, batch.query_targets).sum()


def _grads(kind, attention, first_order=False, **kw):
    net = _build(kind, attention, first_order, **kw)
    _outer_loss(kind, net, _batch()).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _max_diff(a, b):
    assert set(a) == set(b)
    return max((a[n] - b[n]).abs().max().item() for n in a)


KINDS = [pytest.param("gradmem", id="gradmem"), pytest.param("ttt", id="ttt-e2e"),
         pytest.param("layer", id="memory-layer")]


@pytest.mark.parametrize("kind", KINDS)
def test_outer_gradient_matches_math_and_differs_from_first_order(kind):
    second = _grads(kind, "ttt_flash")
    exact = _grads(kind, "math")
    assert _max_diff(second, exact) <= 1e-8
    first = _grads(kind, "ttt_flash", first_order=True)
    assert _max_diff(first, _grads(kind, "math", first_order=True)) <= 1e-8
    assert _max_diff(second, first) > 1e-4
    lr_names = [n for n in second if n.endswith("log_inner_lr")]
    assert lr_names and all(second[n].abs().item() > 0 for n in lr_names)  # the step size is learned


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointing_gives_the_same_gradient(kind):
    assert _max_diff(_grads(kind, "ttt_flash", checkpoint=False), _grads(kind, "ttt_flash", checkpoint=True)) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_inference_matches_training_forward(kind):
    net, batch = _build(kind, "ttt_flash"), _batch()
    loss = _outer_loss(kind, net, batch)
    with torch.no_grad():
        loss_eval = _outer_loss(kind, net, batch)
    assert not loss_eval.requires_grad
    torch.testing.assert_close(loss_eval, loss.detach(), rtol=1e-12, atol=0)


def test_gradmem_write_lowers_the_write_loss_and_query_sees_only_memory():
    net, batch = _build("gradmem", "ttt_flash"), _batch()
    net.log_inner_lr.data.fill_(0.0)
    memory, losses = net.write(batch.context, batch.context_targets, steps=3)
    after = net.write_loss(memory, batch.context, batch.context_targets).item() / 2
    assert after < losses[0].item() and len(losses) == 3
    # forward = read(write(context)): the query sees the written memory, not the context
    memory, _ = net.write(batch.context, batch.context_targets)
    logits = net(batch.context, batch.context_targets, batch.query)
    torch.testing.assert_close(logits, net.read(memory, batch.query), rtol=0, atol=0)
    assert not torch.allclose(net.read(net.initial_memory(2), batch.query), logits)


def test_ttt_fast_weights_are_per_sequence():
    net, batch = _build("ttt", "ttt_flash"), _batch(3)
    together = net(batch.context, batch.context_targets, batch.query)
    alone = torch.cat([net(batch.context[i:i + 1], batch.context_targets[i:i + 1], batch.query[i:i + 1])
                       for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-12)
    fast, losses = net.adapt(batch.context, batch.context_targets)
    assert len(losses) == 3  # 10 tokens in chunks of 4
    assert all(w.shape[0] == 3 for w in fast.values())
    assert net.fast_names == [f"blocks.1.mlp.{p}.weight" for p in ("gate", "up", "down")]


def test_memory_attention_reads_earlier_chunks_only_through_slots():
    torch.manual_seed(0)
    layer = GradientMemoryAttention(8, 2, memory_slots=3, inner_steps=1, inner_lr=1.0, chunk_size=4,
                                    attention="math").to(F64)
    x = torch.randn(2, 10, 8, dtype=F64)
    y = x.clone()
    y[:, 1] += 1.0  # change a token of the first chunk
    out_x, out_y = layer(x), layer(y)
    assert torch.equal(out_x[:, 0], out_y[:, 0])  # causal
    assert not torch.allclose(out_x[:, 4:], out_y[:, 4:])  # later chunks see it through the slots
    with torch.no_grad():
        assert torch.equal(layer(x, write=False)[:, 4:], layer(y, write=False)[:, 4:])  # ... only there
    # bottom-right aligned causal read == explicit materialised attention with slots in front
    torch.testing.assert_close(layer(x, write=False), _no_write_reference(layer, x))


def _no_write_reference(layer, x):
    q, k, v = layer.qkv(x).view(2, 10, 3, 2, 4).permute(2, 0, 3, 1, 4)
    out = []
    for s in range(0, 10, 4):
        qc, kc, vc = q[:, :, s:s + 4], k[:, :, s:s + 4], v[:, :, s:s + 4]
        keys = torch.cat([layer.slot_k.expand(2, -1, -1, -1), kc], 2)
        vals = torch.cat([layer.slot_v.expand(2, -1, -1, -1), vc], 2)
        scores = qc @ keys.transpose(-1, -2) / 2.0
        n = qc.shape[2]
        mask = torch.ones(n, 3 + n, dtype=torch.bool)
        mask[:, 3:] = torch.ones(n, n, dtype=torch.bool).tril()
        out.append(scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vals)
    return layer.proj(torch.cat(out, 2).transpose(1, 2).reshape(2, 10, 8))


def test_memory_attention_replaces_gpt_attention():
    model = GPT(GPTConfig.tiny(vocab_size=V, n_layer=1, n_head=2, d_model=16))
    model.blocks[0].attn = GradientMemoryAttention(16, 2, memory_slots=4, inner_steps=1, inner_lr=1.0, chunk_size=4)
    idx = torch.randint(0, V, (2, 9))
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    assert model.blocks[0].attn.slot_v.grad.abs().sum() > 0


def test_recall_tasks():
    batch = MQARTasks(num_keys=10, num_values=4, num_pairs=3, num_queries=5, context_len=12).sample(
        4, generator=torch.Generator().manual_seed(0))
    fill = 14
    for b in range(4):
        ctx = batch.context[b].view(-1, 2)
        pairs = {int(k): int(v) for k, v in ctx.tolist() if k != fill}
        assert len(pairs) == 3 and all(k < 10 and 10 <= v < 14 for k, v in pairs.items())
        assert all(pairs[int(q)] == int(t) for q, t in zip(batch.query[b], batch.query_targets[b]))
        targets = batch.context_targets[b].view(-1, 2)
        assert (targets[:, 1] == -100).all()
        assert [int(t) for (k, _), t in zip(ctx.tolist(), targets[:, 0]) if k != fill] == list(pairs.values())
    assert len(set(batch.query[0, :3].tolist())) == 3  # distinct while pairs last
    kv = KeyValueRetrievalTasks()
    assert kv.num_queries == 1 and kv.vocab_size == 33 and kv.chance == 1 / 16
    with pytest.raises(ValueError, match="num_pairs"):
        AssociativeRecallTasks(num_keys=2, num_pairs=3)
    with pytest.raises(ValueError, match="context_len"):
        AssociativeRecallTasks(num_pairs=3, context_len=4)


def test_lightning_modules_log_pre_and_post_under_inference_mode():
    from ttt_flash.lightning.memory import GradMemKV, MemoryLayerMQAR, TTTE2EMQAR

    batch = _batch(2)
    gpt = dict(vocab_size=V, n_layer=1, d_model=16, n_head=2)
    for module in (GradMemKV(GradMem(GPTConfig(**gpt), memory_tokens=2)),
                   TTTE2EMQAR(FastWeightTTT(GPTConfig(**gpt, window=2), chunk_size=4)),
                   MemoryLayerMQAR(MemoryLM(V, 16, 1, 2, memory_slots=2, chunk_size=4))):
        train = module._metrics(batch, train=True)
        assert {"loss_pre", "acc_pre", "loss_post", "acc_post"} <= set(train)
        assert train["loss_post"].requires_grad and not train["loss_pre"].requires_grad
        logged = {}
        module.log = lambda name, value, **kw: logged.__setitem__(name, value)
        with torch.inference_mode():
            module.validation_step(batch, 0)
        assert {"val/loss_pre", "val/acc_post"} <= set(logged)


# --------------------------------------------------------------------------- the memory layer's addressing and parallel write


def _layer(parallel: bool, *, qk_norm=True, gate=True, steps=1, first_order=False, attention="math", chunk=4,
           slots=5, seed=0):
    torch.manual_seed(seed)
    layer = GradientMemoryAttention(16, 2, memory_slots=slots, inner_steps=steps, inner_lr=0.8, chunk_size=chunk,
                                    attention=attention, write_rule="slot_normalized", write_gate=gate,
                                    qk_norm=qk_norm, qk_scale=3.0, first_order=first_order,
                                    parallel_write=parallel).to(F64)
    with torch.no_grad():  # away from the zero initialisation, so every term of the write is exercised
        layer.slot_v.normal_()
        if gate:
            layer.write_gate.weight.normal_()
            layer.write_gate.bias.normal_()
    return layer


def _outer_derivatives(layer, x):
    """The outer loss's output, first derivatives (input and every parameter) and a second
    derivative (of the squared first derivatives, w.r.t. the input)."""
    out = layer(x)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), [x] + params, create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in grads), x)[0]
    return out, grads, second


@pytest.mark.parametrize("qk_norm", [False, True], ids=["dot", "qk-norm"])
@pytest.mark.parametrize("steps,first_order", [(1, False), (2, False), (2, True)],
                         ids=["1step", "2steps", "2steps-first-order"])
def test_parallel_write_equals_one_autograd_step_per_chunk(qk_norm, steps, first_order):
    """The slot_normalized write computed for all chunks at once (parallel_write) gives the
    stepwise autograd writes' output, first and second derivatives of the outer loss to 1e-10
    (N = 15: three written chunks and a partial last one)."""
    x = torch.randn(2, 15, 16, dtype=F64, requires_grad=True)
    ref = _outer_derivatives(_layer(False, qk_norm=qk_norm, steps=steps, first_order=first_order), x)
    got = _outer_derivatives(_layer(True, qk_norm=qk_norm, steps=steps, first_order=first_order), x)
    torch.testing.assert_close(got[0], ref[0], atol=1e-10, rtol=0)
    for g, r in zip(got[1], ref[1]):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)
    torch.testing.assert_close(got[2], ref[2], atol=1e-10, rtol=0)
    assert got[2].abs().max() > 1e-3  # a second derivative that is there


def test_parallel_write_matches_flash_stepwise_writes():
    """The parallel write with the ttt_flash read equals the stepwise writes through
    flash_attention (second order through its double backward) in float64."""
    x = torch.randn(2, 13, 16, dtype=F64, requires_grad=True)
    ref = _outer_derivatives(_layer(False, attention="ttt_flash"), x)
    got = _outer_derivatives(_layer(True, attention="ttt_flash"), x)
    for g, r in zip([got[0], *got[1], got[2]], [ref[0], *ref[1], ref[2]]):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_parallel_write_gradcheck_and_gradgradcheck():
    layer = _layer(True, steps=2, slots=3, chunk=2)
    b, h, s, d = 1, 1, 3, 4
    slot_k = torch.nn.functional.normalize(torch.randn(b, h, s, d, dtype=F64), dim=-1)

    def fn(slot_v, k, v, gate):
        return layer.parallel_values(slot_k, slot_v, k, v, gate)

    inputs = (torch.randn(b, h, s, d, dtype=F64, requires_grad=True),
              3 * torch.randn(b, h, 4, d, dtype=F64, requires_grad=True),
              torch.randn(b, h, 4, d, dtype=F64, requires_grad=True),
              torch.rand(b, h, 4, 1, dtype=F64, requires_grad=True) * 2)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_parallel_write_stays_bounded_for_thousands_of_writes():
    """4,000 writes of large, sharply addressed tokens: every slot stays within the range of the
    values written (the step is a contraction for any keys, values and number of writes)."""
    torch.manual_seed(0)
    layer = GradientMemoryAttention(32, 2, memory_slots=8, chunk_size=8, inner_lr=1.0, attention="math",
                                    write_rule="slot_normalized", write_gate=True, qk_norm=True, qk_scale=50.0)
    with torch.no_grad():
        layer.qkv.weight.mul_(30)
        layer.write_gate.bias.fill_(3.0)  # β ≈ 1.9: the largest writes
    x = 3 * torch.randn(2, 4001 * 8, 32)
    q, k, v = layer.qkv(x).view(2, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
    gate = 2 * torch.sigmoid(layer.write_gate(x)).transpose(1, 2).unsqueeze(-1)
    slot_k = layer.slot_k.unsqueeze(0).expand(2, -1, -1, -1)
    q, k, k_addr, slot_k = layer.addresses(q, k, slot_k)
    with torch.no_grad():
        values = layer.parallel_values(slot_k, layer.slot_v.unsqueeze(0).expand(2, -1, -1, -1),
                                       k_addr[:, :, :4000 * 8], v[:, :, :4000 * 8], gate[:, :, :4000 * 8])
    assert values.shape == (2, 2, 4001, 8, 16)
    assert torch.isfinite(values).all()
    assert values.abs().max() <= v.abs().max() * (1 + 1e-5)


def test_qk_norm_addresses_are_cosines_at_the_learned_temperature():
    layer = _layer(True, qk_norm=True)
    q, k = torch.randn(2, 2, 5, 8, dtype=F64), torch.randn(2, 2, 5, 8, dtype=F64)
    slot_k = layer.slot_k.unsqueeze(0).expand(2, -1, -1, -1)
    q2, k2, k_addr, sk = layer.addresses(q, k, slot_k)
    cos = torch.nn.functional.normalize(k, dim=-1) @ torch.nn.functional.normalize(slot_k, dim=-1).transpose(-1, -2)
    torch.testing.assert_close(k_addr @ sk.transpose(-1, -2) * 8 ** -0.5, 3.0 * cos)
    torch.testing.assert_close(k2.norm(dim=-1), torch.ones(2, 2, 5, dtype=F64))
    assert layer.log_qk_scale.shape == (2, 1, 1)
    layer(torch.randn(2, 9, 16, dtype=F64)).square().sum().backward()
    assert layer.log_qk_scale.grad.abs().sum() > 0


def test_qk_norm_refuses_bad_arguments():
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match=r"qk_scale must be a finite float > 0"):
            GradientMemoryAttention(16, 2, write_rule="slot_normalized", qk_norm=True, qk_scale=bad)


def _lookup_layer(kv_shift: bool, slot_query: str) -> GradientMemoryAttention:
    """One head, D = 8: k = the first 4 input features, v = the last 4, q = 0, output = o; the
    4 slot keys are the first 4 unit vectors, compared at temperature 50 (one-hot addresses)."""
    layer = GradientMemoryAttention(8, 1, memory_slots=4, chunk_size=2, inner_lr=1.0, attention="math",
                                    write_rule="slot_normalized", qk_norm=True, qk_scale=50.0, kv_shift=kv_shift,
                                    slot_query=slot_query).to(F64)
    with torch.no_grad():
        w = torch.zeros(24, 8, dtype=F64)
        w[8:12, :4] = torch.eye(4)  # k
        w[16:20, 4:] = torch.eye(4)  # v: the value features, in the first 4 outputs
        layer.qkv.weight.copy_(w)
        layer.proj.weight.copy_(torch.eye(8))
        layer.slot_k.zero_()
        layer.slot_k[0, :, :4] = torch.eye(4)
    return layer


@pytest.mark.parametrize("kv_shift,slot_query,finds", [(True, "key", True), (False, "key", False),
                                                       (True, "query", False)],
                         ids=["shift-key", "no-shift", "query-read"])
def test_kv_shift_and_key_read_look_up_the_value_written_after_the_same_key(kv_shift, slot_query, finds):
    """[key j, value u] then a query chunk [key j]: with kv_shift the value is written at key j's
    slot, and with slot_query="key" the query token reads that slot: it returns u."""
    layer = _lookup_layer(kv_shift, slot_query)
    u = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=F64)
    key = torch.zeros(8, dtype=F64)
    key[2] = 1.0
    value = torch.cat([torch.zeros(4, dtype=F64), u])
    x = torch.stack([key, value, key]).unsqueeze(0)  # (1, 3, 8): chunk [key, value], then the query chunk
    with torch.no_grad():
        read = layer(x)[0, 2, :4]  # v's features land in the first 4 outputs
    assert torch.allclose(read, u, atol=1e-9) == finds
    if not finds:
        assert (read - u).abs().max() > 0.1


def _mqar_accuracy_after_training(steps: int, **layer_kw) -> float:
    """Query accuracy of a 1-layer MemoryLM trained ``steps`` Adam steps on a small MQAR task."""
    torch.manual_seed(0)
    task = AssociativeRecallTasks(num_keys=8, num_values=16, num_pairs=4, num_queries=4, context_len=32)
    net = MemoryLM(task.vocab_size, 32, 1, 2, memory_slots=16, chunk_size=16, attention="math", write_gate=True,
                   write_rule="slot_normalized", **layer_kw)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        b = task.sample(32, generator=gen)
        logits = net(torch.cat([b.context, b.query], 1))[:, 32:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.query_targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    b = task.sample(256, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return (net(torch.cat([b.context, b.query], 1))[:, 32:].argmax(-1) == b.query_targets).float().mean().item()


def test_memory_layer_learns_mqar_where_dot_product_addresses_do_not():
    """MQAR, 4 pairs in 32 tokens (two written chunks), the queries in a chunk of their own: 40
    steps make the key-addressed layer (qk_norm, kv_shift, slot_query="key") exact, while the
    slot-normalised write with dot-product addresses is still near chance (1/16) — it plateaus
    at one pair in four ("bag of values")."""
    assert _mqar_accuracy_after_training(40, qk_norm=True, kv_shift=True, slot_query="key", conv=1) >= 0.95
    assert _mqar_accuracy_after_training(40, conv=2) <= 0.3


def test_key_read_equals_one_softmax_over_key_scored_slots_and_query_scored_chunk():
    """slot_query="key": slot scores g·cos(k_t, K_s), chunk scores q_t·k_j / √D, one softmax."""
    torch.manual_seed(0)
    layer = GradientMemoryAttention(16, 2, memory_slots=3, chunk_size=4, attention="math", write_rule="slot_normalized",
                                    qk_norm=True, qk_scale=3.0, slot_query="key").to(F64)
    with torch.no_grad():
        layer.slot_v.normal_()
    x = torch.randn(2, 10, 16, dtype=F64)
    with torch.no_grad():
        q, k, v = layer.qkv(x).view(2, 10, 3, 2, 8).permute(2, 0, 3, 1, 4)
        q, k, k_addr, slot_k = layer.addresses(q, k, layer.slot_k.unsqueeze(0).expand(2, -1, -1, -1))
        outs = []
        for s in range(0, 10, 4):
            n = min(4, 10 - s)
            slots = k_addr[:, :, s:s + n] @ slot_k.transpose(-1, -2) / 8 ** 0.5
            chunk = (q[:, :, s:s + n] @ k[:, :, s:s + n].transpose(-1, -2) / 8 ** 0.5).masked_fill(
                ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            p = torch.cat([slots, chunk], -1).softmax(-1)
            outs.append(p @ torch.cat([layer.slot_v.expand(2, -1, -1, -1), v[:, :, s:s + n]], 2))
        ref = layer.proj(torch.cat(outs, 2).transpose(1, 2).reshape(2, 10, 16))
        torch.testing.assert_close(layer(x, write=False), ref, atol=1e-12, rtol=0)


def test_slot_query_refuses_bad_values():
    with pytest.raises(ValueError, match=r"slot_query must be one of \('query', 'key'\), got 'value'"):
        GradientMemoryAttention(16, 2, slot_query="value")


@pytest.mark.parametrize("rule", ["slot_normalized", "gradient"])
def test_recall_layer_with_flash_attention_matches_math(rule):
    """qk_norm, kv_shift and slot_query="key" (the read on concatenated features), with either
    write rule: the outer gradient with ttt_flash equals the materialised one to 1e-10 in
    float64 (the gradient rule: second order through flash_attention's double backward)."""
    x = torch.randn(2, 13, 16, dtype=F64, requires_grad=True)
    results = []
    for attention in ("ttt_flash", "math"):
        torch.manual_seed(0)
        layer = GradientMemoryAttention(16, 2, memory_slots=5, chunk_size=4, inner_lr=0.8, attention=attention,
                                        write_rule=rule, write_gate=True, qk_norm=True, qk_scale=3.0,
                                        kv_shift=True, slot_query="key").to(F64)
        with torch.no_grad():
            layer.slot_v.normal_()
        results.append(_outer_derivatives(layer, x))
    got, ref = results
    for g, r in zip([got[0], *got[1], got[2]], [ref[0], *ref[1], ref[2]]):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_lightning_modules_take_their_network_and_check_it():
    """Each recall module takes its network as ``net`` (the class its recipes name) and refuses
    another; a network whose vocabulary is smaller than the data's is refused when fitting
    starts, naming the recipe key to raise."""
    from types import SimpleNamespace

    from ttt_flash.lightning.memory import AssociativeRecallDataModule, GradMemKV, MemoryLayerMQAR, TTTE2EMQAR

    gpt = GPTConfig(vocab_size=17, n_layer=1, n_head=2, d_model=16)
    gradmem = GradMem(gpt, memory_tokens=2)
    module = GradMemKV(gradmem, lr=0.01)
    assert module.net is gradmem and "net" not in module.hparams and module.hparams.lr == 0.01
    with pytest.raises(TypeError, match=r"GradMemKV's net must be a ttt_flash.memory.GradMem .*got MemoryLM"):
        GradMemKV(MemoryLM(17))
    with pytest.raises(TypeError, match=r"MemoryLayerMQAR's net must be a ttt_flash.memory.MemoryLM"):
        MemoryLayerMQAR(gradmem)
    with pytest.raises(ValueError, match="lr must be > 0"):
        TTTE2EMQAR(FastWeightTTT(GPTConfig(vocab_size=17, n_layer=1, n_head=2, d_model=16, window=2)), lr=0.0)
    data = AssociativeRecallDataModule(num_keys=16, num_values=16)  # 33 token ids
    for module, key in ((GradMemKV(gradmem), "model.init_args.net.init_args.model.vocab_size"),
                        (MemoryLayerMQAR(MemoryLM(17)), "model.init_args.net.init_args.vocab_size")):
        module._trainer = SimpleNamespace(datamodule=data)
        with pytest.raises(ValueError, match=f"network's vocab_size is 17; set {key} >= 33"):
            module.on_fit_start()


def test_graphed_step_writes_the_gradients_backward_would_in_place():
    """The step a CUDA graph captures (_graphed_metrics) leaves in p.grad what zero_grad() and
    loss_post.backward() leave, copying into the existing gradient tensors on later calls."""
    from ttt_flash.lightning.memory import GradMemKV, MemoryLayerMQAR, TTTE2EMQAR

    batch = _batch(2)
    gpt = dict(vocab_size=V, n_layer=1, d_model=16, n_head=2)
    for build in (lambda: GradMemKV(GradMem(GPTConfig(**gpt), memory_tokens=2)),
                  lambda: TTTE2EMQAR(FastWeightTTT(GPTConfig(**gpt, window=2), chunk_size=4)),
                  lambda: MemoryLayerMQAR(MemoryLM(V, 16, 1, 2, memory_slots=2, chunk_size=4))):
        torch.manual_seed(0)
        module = build()
        module._metrics(batch, train=True)["loss_post"].backward()
        expected = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        assert expected
        for p in module.parameters():
            if p.grad is not None:
                p.grad.fill_(7.0)  # stale values the graphed step must overwrite
        held = {n: p.grad for n, p in module.named_parameters()}
        module._graphed_metrics(*batch)
        for n, p in module.named_parameters():
            if n in expected:
                assert p.grad is held[n] and torch.equal(p.grad, expected[n]), n
            else:
                assert p.grad is None, n
