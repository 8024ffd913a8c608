"""Hugging Face ``transformers`` integration: ``attn_implementation="ttt_bob"``.

After :func:`register`, any model that dispatches attention through
``transformers.AttentionInterface`` (Llama, Mistral, Qwen2, GPT-2, ... — the models with
``_supports_attention_backend``) runs its attention with :func:`ttt_flash.flash_attention`
and gets exact second-order gradients (MAML, Hessian-vector products) through it::

    >>> import torch, transformers
    >>> from ttt_flash.integrations.transformers import register
    >>> register()
    'ttt_bob'
    >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="ttt_bob")
    >>> ids = torch.randint(0, 50, (2, 6))
    >>> mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])   # left padding
    >>> model(ids, attention_mask=mask).logits.shape
    torch.Size([2, 6, 50])

The name contains no "flash" on purpose: transformers treats every implementation name
containing "flash" as a request for a flash-attention kernel from its kernel hub.

**Masks.** Two functions are registered under the same name: the attention
(:func:`ttt_bob_attention`, in ``transformers.AttentionInterface``) and its mask function
(:func:`ttt_bob_mask`, in ``transformers.masking_utils.AttentionMaskInterface``, which exists
from transformers 4.53). The mask function never builds a 4-D float mask. It evaluates the
model's mask pattern (causal, sliding window, bidirectional, and the batch's 2-D padding
mask; in query-row chunks of bounded memory) and turns it into a :class:`PackedMask`: the
padding removed, each batch row one sequence of :func:`ttt_flash.flash_attention_varlen`
(or, with no padding, plain :func:`ttt_flash.flash_attention`). It then *checks* that the
packed call sees exactly the keys the model's mask allows, for every query that is not
padding; a pattern that packed causal/sliding-window attention cannot express (packed
sequences in one row without an attention mask, chunked attention, bidirectional image
blocks, ...) raises ``NotImplementedError`` instead of being approximated. Left, right and
interior padding all work; padded query positions return 0 (sdpa returns an arbitrary value
there: compare only the positions that are not padding). The check costs O(batch · N_q ·
N_k) boolean operations once per forward pass and mask type, shared by all layers.

The attention also accepts what older transformers (4.48–4.52, no mask interface) and
users pass: ``None`` (causal and sliding window from the layer, bottom-right aligned as in
transformers' flash-attention path), a 2-D padding mask, or a 4-D boolean / additive
(0 and −inf or the dtype's minimum) mask whose pattern is checked in the same way. A 4-D
float mask with any other value is an attention bias and raises ``ValueError``.

**Arguments honoured.** ``scaling``; grouped-query attention (key/value with
``num_key_value_heads`` heads, never repeated); sliding window (from the mask, or from the
``sliding_window`` argument / ``module.sliding_window`` when there is no mask); ``is_causal``
/ ``module.is_causal`` likewise; value head dim ≠ query head dim (zero-padded). Refused with
an error rather than ignored: ``dropout > 0`` (the model is in training mode with attention
dropout: set ``attention_dropout``/``attn_pdrop`` to 0), ``softcap``, attention sinks
(``s_aux``/``sinks``), ``position_bias``, ``head_mask``, and padding-free packed batches
(``cu_seq_lens_q``/``cu_seq_lens_k``). ``output_attentions=True`` warns and returns ``None``
weights, as transformers' own flash and sdpa paths do.

Public names: :data:`NAME`, :data:`MIN_TRANSFORMERS`, :func:`register`,
:func:`ttt_bob_attention`, :func:`ttt_bob_mask`, :class:`PackedMask`.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..attention import flash_attention, flash_attention_varlen
from ..attention.registry import HF_NAME
from .masks import PackedMask, from_4d, from_padding, ttt_bob_mask

__all__ = [
    "NAME",
    "MIN_TRANSFORMERS",
    "register",
    "ttt_bob_attention",
    "ttt_bob_mask",
    "PackedMask",
]

#: The attention implementation name: ``model.set_attn_implementation(NAME)``.
NAME = HF_NAME

#: Oldest transformers release supported (the first with ``ALL_ATTENTION_FUNCTIONS``).
MIN_TRANSFORMERS = "4.48"



# --------------------------------------------------------------------------- the attention function


_REFUSED = {
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "head_mask": "a head mask",
    "cu_seq_lens_q": "padding-free packed batches (cu_seq_lens_q)",
    "cu_seq_lens_k": "padding-free packed batches (cu_seq_lens_k)",
}


def _refuse(dropout: float, softcap: Optional[float], kwargs: dict) -> None:
    """Raise for the arguments the attention cannot honour; warn for ``output_attentions``."""
    if dropout:
        raise ValueError(
            f"attn_implementation='ttt_bob' does not support attention dropout (got dropout={dropout}; "
            "transformers passes the config's attention dropout in training mode): set "
            "attention_dropout=0.0 (attn_pdrop=0.0 for GPT-2) in the config, or call model.eval()"
        )
    if softcap is not None:
        raise NotImplementedError(
            f"attn_implementation='ttt_bob' does not support attention logit softcapping (softcap="
            f"{softcap}); set attn_logit_softcapping=None in the config or use 'eager'"
        )
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attn_implementation='ttt_bob' does not support {what} (argument {name!r}); use "
                "'sdpa' or 'eager' for this model"
            )
    if kwargs.get("output_attentions", False):
        warnings.warn("attn_implementation='ttt_bob' does not return attention weights "
                      "(output_attentions=True): they are None", stacklevel=3)


def _packed_mask(module, attention_mask, shape: Tuple[int, int, int, int], sliding_window: Optional[int],
                 is_causal: Optional[bool]) -> PackedMask:
    """The :class:`PackedMask` of a call, from the mask transformers passes (its own
    :class:`PackedMask`, None, 2-D padding or a 4-D mask); ``shape`` is (B, H_q, N_q, N_k)."""
    batch, heads, q_len, kv_len = shape
    if isinstance(attention_mask, PackedMask):
        pm = attention_mask
        if (pm.batch_size, pm.q_length, pm.kv_length) != (batch, q_len, kv_len):
            raise ValueError(
                f"the ttt_bob mask was built for (batch, q_len, kv_len) = ({pm.batch_size}, {pm.q_length}, "
                f"{pm.kv_length}) but this layer has ({batch}, {q_len}, {kv_len})"
            )
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
        if window is not None and not causal:
            raise NotImplementedError(
                "attn_implementation='ttt_bob' supports sliding windows with causal attention only"
            )
        if attention_mask is None:
            pm = PackedMask(batch, q_len, kv_len, bool(causal), window)
        elif not isinstance(attention_mask, Tensor):
            raise TypeError(
                f"attn_implementation='ttt_bob' got an attention_mask of type {type(attention_mask).__name__}; "
                "expected the mask of its own mask function (register() registers it), None or a tensor"
            )
        elif attention_mask.dim() == 2:
            pm = from_padding(attention_mask, batch, q_len, kv_len, bool(causal), window)
        elif attention_mask.dim() == 4:
            pm = from_4d(attention_mask, batch, heads, q_len, kv_len)
        else:
            raise ValueError(f"attention_mask must be 2-D or 4-D, got shape {tuple(attention_mask.shape)}")
    return pm


def ttt_bob_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """The attention registered in ``transformers.AttentionInterface`` under :data:`NAME`.

    Args:
        module: the calling attention layer (read: ``is_causal``, ``sliding_window``).
        query: (B, H_q, N_q, D); key, value: (B, H_kv, N_k, D) with H_q a multiple of H_kv
            (not repeated: :func:`~ttt_flash.flash_attention` does grouped-query attention).
        attention_mask: a :class:`PackedMask` (from :func:`ttt_bob_mask`), None, a 2-D
            padding mask or a 4-D boolean/additive mask (see the module docstring).
        dropout: must be 0 (refused otherwise: attention dropout is not supported).
        scaling: softmax scale; None for D^-1/2.
        sliding_window, is_causal: used only when ``attention_mask`` is None or 2-D; None
            reads ``module.sliding_window`` / ``module.is_causal`` (default causal).
        softcap: must be None.

    Returns:
        ``(output, None)`` with output (B, N_q, H_q, D_v), as transformers expects. Padded
        query positions are 0.
    """
    _refuse(dropout, softcap, kwargs)
    batch, heads, q_len, head_dim = query.shape
    kv_len, v_dim = key.shape[2], value.shape[-1]
    pm = _packed_mask(module, attention_mask, (batch, heads, q_len, kv_len), sliding_window, is_causal)

    scale = scaling if scaling is not None else head_dim ** -0.5
    width = max(head_dim, v_dim)  # flash_attention needs one head dim for q, k and v: zero-pad
    if head_dim < width:
        query = torch.nn.functional.pad(query, (0, width - head_dim))
        key = torch.nn.functional.pad(key, (0, width - head_dim))
    if v_dim < width:
        value = torch.nn.functional.pad(value, (0, width - v_dim))

    if not pm.packed:
        out = flash_attention(query, key, value, causal=pm.causal, scale=scale, window=pm.window, layout="bhnd")
        out = out.transpose(1, 2)
    else:
        def pack(x: Tensor, index: Tensor) -> Tensor:
            b, h, n, d = x.shape
            return x.transpose(1, 2).reshape(b * n, h, d).index_select(0, index)

        o = flash_attention_varlen(
            pack(query, pm.q_index), pack(key, pm.k_index), pack(value, pm.k_index),
            pm.cu_seqlens_q, pm.cu_seqlens_k, pm.max_seqlen_q, pm.max_seqlen_k,
            causal=pm.causal, scale=scale, window=pm.window,
        )
        out = o.new_zeros(batch * q_len, heads, width).index_copy(0, pm.q_index, o)
        out = out.view(batch, q_len, heads, width)
    if v_dim < width:
        out = out[..., :v_dim]
    return out.contiguous(), None


# --------------------------------------------------------------------------- registration


def register() -> str:
    """Register :func:`ttt_bob_attention` and :func:`ttt_bob_mask` under :data:`NAME`.

    Afterwards ``model.set_attn_implementation("ttt_bob")`` (transformers >= 4.56), or
    ``attn_implementation="ttt_bob"`` in ``from_config``/``from_pretrained``, runs the model's
    attention through :func:`ttt_flash.flash_attention`. Idempotent: calling it again changes
    nothing. Registers in the global ``transformers.AttentionInterface`` (the plain
    ``ALL_ATTENTION_FUNCTIONS`` dict before it existed) and, from transformers 4.53, in
    ``transformers.masking_utils.AttentionMaskInterface``.

    Returns:
        :data:`NAME` (``"ttt_bob"``).

    Raises:
        ImportError: transformers is not installed or older than :data:`MIN_TRANSFORMERS`.
    """
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"ttt_flash.integrations.transformers needs transformers>={MIN_TRANSFORMERS}: "
            "pip install 'ttt-flash[hf]'"
        ) from e
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"ttt_flash.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, found "
            f"{transformers.__version__}"
        )
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is not None:
        interface.register(NAME, ttt_bob_attention)
    else:  # transformers 4.48 - 4.51: a plain dict
        from transformers import modeling_utils

        modeling_utils.ALL_ATTENTION_FUNCTIONS[NAME] = ttt_bob_attention
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53: models build 4-D masks themselves (handled above)
        pass
    else:
        AttentionMaskInterface.register(NAME, ttt_bob_mask)
    return NAME
