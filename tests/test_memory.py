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
    small = dict(vocab_size=V, n_layer=1, d_model=16)
    for module in (GradMemKV(n_head=2, memory_tokens=2, **small), TTTE2EMQAR(n_head=2, window=2, chunk_size=4, **small),
                   MemoryLayerMQAR(heads=2, memory_slots=2, chunk_size=4, **small)):
        train = module._metrics(batch, train=True)
        assert {"loss_pre", "acc_pre", "loss_post", "acc_post"} <= set(train)
        assert train["loss_post"].requires_grad and not train["loss_pre"].requires_grad
        logged = {}
        module.log = lambda name, value, **kw: logged.__setitem__(name, value)
        with torch.inference_mode():
            module.validation_step(batch, 0)
        assert {"val/loss_pre", "val/acc_post"} <= set(logged)
