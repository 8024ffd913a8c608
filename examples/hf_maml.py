"""Second-order MAML on a Hugging Face causal LM through attn_implementation="ttt_bob".

A tiny randomly initialised Llama (grouped-query attention) adapts to a task with a few
differentiable SGD steps on a support batch (:func:`ttt_flash.meta.inner_loop`, built on
``torch.func.functional_call``); the loss of the adapted weights on a query batch is
differentiated back to the initial weights. The meta-gradient contains second derivatives
of attention, which ``ttt_bob`` (:func:`ttt_flash.flash_attention`) computes exactly: the
script compares it with first-order MAML (different) and with the same computation under
``attn_implementation="sdpa"`` on PyTorch's math backend (equal to rounding).

A task is a random successor rule over the vocabulary: token t+1 = perm[token t]. Batches are
left-padded (the first row) to exercise the padding path.

Run (CPU, seconds)::

    python examples/hf_maml.py --steps 2 --seq-len 16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from ttt_flash.integrations.transformers import register
from ttt_flash.meta import functional_loss, inner_loop

VOCAB = 32


def lm_loss(output, labels):
    """Next-token cross-entropy; label -100 (padding) is ignored."""
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def make_task(gen: torch.Generator, batch: int, seq_len: int):
    """(support, query) batches of one task, each ((input_ids, attention_mask), labels)."""
    perm = torch.randperm(VOCAB, generator=gen)

    def sample():
        ids = torch.empty(batch, seq_len, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
        for t in range(seq_len - 1):
            ids[:, t + 1] = perm[ids[:, t]]
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        mask[0, :2] = 0  # left padding in the first row
        return (ids, mask), ids.masked_fill(mask == 0, -100)

    return sample(), sample()


def meta_gradient(model, support, query, *, steps: int, lr: float, first_order: bool):
    fast = inner_loop(model, None, lm_loss, support, steps=steps, lr=lr, first_order=first_order)
    outer = functional_loss(model, fast, lm_loss, query)
    grads = torch.autograd.grad(outer, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def main(steps: int = 2, seq_len: int = 16, batch: int = 4, lr: float = 0.5, seed: int = 0,
         verbose: bool = True) -> dict:
    register()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.0, initializer_range=0.2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ttt_bob")
    model = model.to(torch.float64)
    support, query = make_task(torch.Generator().manual_seed(seed), batch, seq_len)

    second = meta_gradient(model, support, query, steps=steps, lr=lr, first_order=False)
    first = meta_gradient(model, support, query, steps=steps, lr=lr, first_order=True)
    model.set_attn_implementation("sdpa")
    with sdpa_kernel(SDPBackend.MATH):
        reference = meta_gradient(model, support, query, steps=steps, lr=lr, first_order=False)
    model.set_attn_implementation("ttt_bob")

    result = {
        "second_order_norm": second.norm().item(),
        "first_order_norm": first.norm().item(),
        "relative_difference_to_first_order": ((second - first).norm() / second.norm()).item(),
        "relative_difference_to_sdpa_math": ((second - reference).norm() / reference.norm()).item(),
    }
    if verbose:
        print(f"MAML meta-gradient through {steps} inner steps (tiny Llama, {sum(p.numel() for p in model.parameters())} parameters)")
        print(f"  second order (ttt_bob)         |g| = {result['second_order_norm']:.6f}")
        print(f"  first order                    |g| = {result['first_order_norm']:.6f}")
        print(f"  |second - first| / |second|        = {result['relative_difference_to_first_order']:.3e}")
        print(f"  |ttt_bob - sdpa math| / |sdpa math| = {result['relative_difference_to_sdpa_math']:.3e}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="inner SGD steps")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per support/query batch")
    parser.add_argument("--lr", type=float, default=0.5, help="inner learning rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr, seed=args.seed)
