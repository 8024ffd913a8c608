"""The mask side of ``attn_implementation="ttt_bob"``: a model's attention mask turned into
packed variable-length sequences (:class:`PackedMask`, :func:`ttt_bob_mask`), and checked to
allow exactly the keys the packed call sees (:mod:`ttt_flash.integrations.transformers`
describes what is accepted)."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["PackedMask", "ttt_bob_mask"]

# Boolean elements evaluated at once while checking a mask pattern (16 MiB).
_CHUNK_ELEMENTS = 1 << 24

_UNSUPPORTED_PATTERN = (
    "attn_implementation='ttt_bob' computes, for each batch row, causal (bottom-right aligned) "
    "or full attention over the tokens that are not padding, optionally with a sliding window; "
    "this model's attention mask is not of that form{detail}. Patterns such as several packed "
    "sequences in one row (position_ids restarting, without an attention_mask), chunked "
    "attention, bidirectional image-token blocks or a custom 4-D mask are not supported: use "
    "attn_implementation='sdpa' or 'eager' for them"
)


# --------------------------------------------------------------------------- the mask description


@dataclass(frozen=True, eq=False)
class PackedMask:
    """How :func:`ttt_bob_attention` runs one layer: what :func:`ttt_bob_mask` returns.

    Either *dense* (``q_index is None``: every query and key takes part, one
    :func:`~ttt_flash.flash_attention` call over the (B, H, N, D) tensors) or *packed*: the
    queries at flat positions ``q_index`` of the (B·N_q) tokens and the keys at ``k_index`` of
    the (B·N_k) tokens are packed, batch row b being sequence b of
    :func:`~ttt_flash.flash_attention_varlen` with ``cu_seqlens_q``/``cu_seqlens_k``; query
    positions not in ``q_index`` (padding) get 0. In both cases ``causal`` (bottom-right
    aligned per sequence) and ``window`` apply.

    Attributes:
        batch_size, q_length, kv_length: the shapes this description was built for.
        causal: causal attention (else every kept query sees every kept key of its row).
        window: with ``causal``, the number of most recent keys each query sees, or None.
        q_index, k_index: int64 flat token indices (packed), or None (dense).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) cumulative lengths (packed), or None.
        max_seqlen_q, max_seqlen_k: longest packed sequences (packed), or 0.
        padding: the 2-D boolean padding mask (by absolute position) it was built from, or
            None. transformers' ``generate`` builds masks ahead for compileable caches and
            hands them back to the model, whose mask creation then calls :func:`ttt_bob_mask`
            with this object as ``attention_mask``: the description is rebuilt from
            ``padding`` for the mask type being created.

    ``ndim`` (4) and ``shape`` ((B, 1, N_q, N_k)) let transformers' mask plumbing treat it as
    a prepared mask.
    """

    batch_size: int
    q_length: int
    kv_length: int
    causal: bool
    window: Optional[int] = None
    q_index: Optional[Tensor] = None
    k_index: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    padding: Optional[Tensor] = None

    ndim = 4

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.batch_size, 1, self.q_length, self.kv_length))

    @property
    def packed(self) -> bool:
        """True when padding is removed (``flash_attention_varlen``); False when dense."""
        return self.q_index is not None


def _row_stats(visible: Callable[[int, int], Tensor], q_valid: Optional[Tensor], batch: int, q_len: int,
               kv_len: int, device) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One pass over the visibility pattern in chunks of query rows.

    ``visible(s, e)`` returns the (B, e - s, N_k) boolean visibility of query rows s..e-1;
    rows where ``q_valid`` is False are dropped (None keeps all rows). Returns, per row, the
    number of visible keys, the first and the last visible key index, and per key whether any
    kept row sees it.
    """
    cnt = torch.zeros(batch, q_len, dtype=torch.long, device=device)
    first = torch.zeros_like(cnt)
    last = torch.zeros_like(cnt)
    col = torch.zeros(batch, kv_len, dtype=torch.bool, device=device)
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * kv_len))
    for s in range(0, q_len, step):
        e = min(q_len, s + step)
        v = visible(s, e).to(device=device, dtype=torch.bool)
        if v.shape != (batch, e - s, kv_len):
            v = v.expand(batch, e - s, kv_len)
        if q_valid is not None:
            v = v & q_valid[:, s:e, None]
        vi = v.to(torch.uint8)
        cnt[:, s:e] = vi.sum(-1)
        first[:, s:e] = vi.argmax(-1)  # first maximal element: the first visible key
        last[:, s:e] = kv_len - 1 - vi.flip(-1).argmax(-1)
        col |= v.any(1)
    return cnt, first, last, col


def _fit(cnt: Tensor, first: Tensor, last: Tensor, col: Tensor, q_valid: Tensor) -> Optional[Tuple[bool, Optional[int]]]:
    """The (causal, window) under which packed attention sees exactly the visible keys of every
    row in ``q_valid``, the keys packed being those in ``col``; None when there is none."""
    n_q = q_valid.sum(1, keepdim=True)
    n_k = col.sum(1, keepdim=True)
    rank = col.long().cumsum(1) - 1  # packed index of each key that some kept row sees
    lo = rank.gather(1, first)
    hi = rank.gather(1, last)
    seen = cnt > 0
    skip = ~q_valid
    # every visible key lies in `col`, so a contiguous packed range has cnt == hi - lo + 1
    if not bool((skip | ~seen | (cnt == hi - lo + 1)).all()):
        return None
    a = q_valid.long().cumsum(1) - 1  # packed query index
    e = a + n_k - n_q  # bottom-right causal: the last key query a sees
    causal_hi = torch.where(e < 0, ~seen, seen & (hi == e))
    if bool((skip | causal_hi).all()):
        windowed = q_valid & seen & (lo > 0)
        window = int(cnt[windowed].max()) if bool(windowed.any()) else None
        expect = e + 1 if window is None else (e + 1).clamp(max=window)
        if bool((skip | (e < 0) | (cnt == expect)).all()):
            return True, window
    if bool((skip | (cnt == n_k)).all()):
        return False, None
    return None


def _pack(causal: bool, window: Optional[int], q_valid: Tensor, col: Tensor) -> PackedMask:
    batch, q_len = q_valid.shape
    kv_len = col.shape[1]
    if bool(q_valid.all()) and bool(col.all()):
        return PackedMask(batch, q_len, kv_len, causal, window)
    n_q = q_valid.sum(1)
    n_k = col.sum(1)
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device=q_valid.device)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=q_valid.device)
    cu_q[1:] = n_q.cumsum(0)
    cu_k[1:] = n_k.cumsum(0)
    return PackedMask(
        batch, q_len, kv_len, causal, window,
        q_index=q_valid.reshape(-1).nonzero().squeeze(1),
        k_index=col.reshape(-1).nonzero().squeeze(1),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(n_q.max()),
        max_seqlen_k=int(n_k.max()),
    )


def _describe(visible, q_valid: Optional[Tensor], batch: int, q_len: int, kv_len: int, device,
              *, fallback_q_valid: Optional[Callable[[Tensor], Tensor]] = None) -> PackedMask:
    """Check the pattern and build the :class:`PackedMask`, or raise NotImplementedError.

    ``q_valid`` None: the queries are the rows that see some key; if that does not fit and
    ``fallback_q_valid`` is given, it maps the keys seen by any row to the query rows to keep
    (rows whose own token no row ever sees are padding) and the pattern is checked again.
    """
    if q_len == 0 or kv_len == 0:
        return PackedMask(batch, q_len, kv_len, causal=False)
    cnt, first, last, col = _row_stats(visible, q_valid, batch, q_len, kv_len, device)
    rows = cnt > 0 if q_valid is None else q_valid
    fit = _fit(cnt, first, last, col, rows)
    if fit is None and q_valid is None and fallback_q_valid is not None:
        rows = fallback_q_valid(col) & (cnt > 0)
        cnt, first, last, col = _row_stats(visible, rows, batch, q_len, kv_len, device)
        fit = _fit(cnt, first, last, col, rows)
    if fit is None:
        raise NotImplementedError(_UNSUPPORTED_PATTERN.format(detail=""))
    return _pack(fit[0], fit[1], rows, col)


# --------------------------------------------------------------------------- the mask function


def _hf_mask_evaluator(mask_function, batch: int, q_pos: Tensor, q_offset, kv_length: int, kv_offset,
                       use_vmap: bool, device, legacy: bool):
    """``(s, e) -> (B, e - s, N_k)`` bool: transformers' own ``sdpa_mask`` evaluating
    ``mask_function`` (no padding) for query rows s..e-1."""
    from transformers import masking_utils

    def visible(s: int, e: int) -> Tensor:
        if legacy:  # transformers 4.53 - 4.57: positions as `cache_position`
            m = masking_utils.sdpa_mask(
                batch_size=batch, cache_position=q_pos[s:e], kv_length=kv_length, kv_offset=kv_offset,
                mask_function=mask_function, attention_mask=None, allow_is_causal_skip=False,
            )
        else:
            m = masking_utils.sdpa_mask(
                batch_size=batch, q_length=e - s, kv_length=kv_length, q_offset=q_offset + s,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=None,
                allow_is_causal_skip=False, use_vmap=use_vmap, device=device,
            )
        if m is None:  # pragma: no cover - skips are disabled above
            raise RuntimeError("transformers' sdpa_mask returned no mask with skips disabled")
        return m[:, 0]

    return visible


def ttt_bob_mask(
    batch_size: int,
    q_length: Optional[int] = None,
    kv_length: Optional[int] = None,
    q_offset=0,
    kv_offset=0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[Tensor] = None,
    *,
    cache_position: Optional[Tensor] = None,
    use_vmap: bool = False,
    device=None,
    **kwargs,
) -> PackedMask:
    """The mask function registered in ``transformers.masking_utils.AttentionMaskInterface``.

    Called by transformers' ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
    ``create_bidirectional_mask`` with the arguments of its ``sdpa_mask`` (transformers 5.x:
    ``q_length``/``q_offset``; 4.53–4.57: ``cache_position``). Query row i sits at absolute
    position ``q_offset + i`` (or ``cache_position[i]``), key j at ``kv_offset + j``;
    ``attention_mask`` is the (B, positions) 0/1 padding mask indexed by absolute position (or
    a :class:`PackedMask` built ahead, whose ``padding`` is used).
    Returns a :class:`PackedMask` after checking that it reproduces ``mask_function`` and the
    padding for every query that is not padding; raises ``NotImplementedError`` otherwise.
    Other keyword arguments (``dtype``, ``config``, ``local_size``, ...) are ignored.
    """
    from transformers import masking_utils

    if mask_function is None:
        mask_function = masking_utils.causal_mask_function
    legacy = "cache_position" in inspect.signature(masking_utils.sdpa_mask).parameters
    if device is None:
        for t in (cache_position, attention_mask):
            if isinstance(t, Tensor):
                device = t.device
                break
        else:
            device = torch.device("cpu")
    if kv_length is None or (q_length is None and cache_position is None) or (legacy and cache_position is None):
        raise TypeError(
            "ttt_bob_mask is called by transformers with kv_length and q_length (5.x) or "
            "cache_position (4.53 - 4.57)"
        )
    if q_length is None:
        q_pos = cache_position.to(device=device, dtype=torch.long)
        q_length = q_pos.shape[0]
    else:
        q_pos = torch.arange(q_length, device=device) + q_offset
    k_pos = torch.arange(kv_length, device=device) + kv_offset
    if isinstance(attention_mask, PackedMask):  # built ahead by generate(): rebuild for this mask type
        attention_mask = attention_mask.padding
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"ttt_bob_mask expects a 2-D (batch, positions) padding mask, got shape "
                f"{tuple(attention_mask.shape)}"
            )
        pad = attention_mask.to(device=device, dtype=torch.bool)
        need = int(k_pos.max()) + 1 if kv_length else 0
        if q_length:
            need = max(need, int(q_pos.max()) + 1)
        if pad.shape[1] < need:  # like transformers: positions beyond the mask are padding
            pad = torch.nn.functional.pad(pad, (0, need - pad.shape[1]))
        key_valid = pad[:, k_pos]
        q_valid = pad[:, q_pos]
    else:
        key_valid = None
        q_valid = torch.ones(batch_size, q_length, dtype=torch.bool, device=device)
    evaluate = _hf_mask_evaluator(mask_function, batch_size, q_pos, q_offset, kv_length, kv_offset,
                                  use_vmap, device, legacy)

    def visible(s: int, e: int) -> Tensor:
        v = evaluate(s, e)
        return v if key_valid is None else v & key_valid[:, None, :]

    return dataclasses.replace(_describe(visible, q_valid, batch_size, q_length, kv_length, device),
                               padding=pad if attention_mask is not None else None)


# --------------------------------------------------------------------------- masks given to the attention


def _pattern(q_len: int, kv_len: int, causal: bool, window: Optional[int], device) -> Tensor:
    """(N_q, N_k) bool: bottom-right causal / sliding window, or all True."""
    if not causal:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    i = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep &= j > i - window
    return keep


def from_padding(mask2d: Tensor, batch: int, q_len: int, kv_len: int, causal: bool,
                  window: Optional[int]) -> PackedMask:
    """A (B, N_k) 0/1 padding mask, as transformers' flash-attention path receives it."""
    if mask2d.shape[0] != batch or mask2d.shape[1] < kv_len:
        raise ValueError(
            f"2-D attention_mask of shape {tuple(mask2d.shape)} does not match batch {batch} and "
            f"key length {kv_len}"
        )
    key_valid = mask2d[:, -kv_len:].to(torch.bool) if kv_len else mask2d[:, :0].to(torch.bool)
    base = _pattern(q_len, kv_len, causal, window, mask2d.device)
    if q_len <= kv_len:
        q_valid = key_valid[:, kv_len - q_len:]
    else:
        q_valid = torch.ones(batch, q_len, dtype=torch.bool, device=mask2d.device)
    return _describe(lambda s, e: base[None, s:e] & key_valid[:, None, :], q_valid, batch, q_len, kv_len,
                     mask2d.device)


def from_4d(mask: Tensor, batch: int, heads: int, q_len: int, kv_len: int) -> PackedMask:
    """A 4-D boolean (True = attend) or additive float (0 / -inf) mask."""
    if mask.shape[-2] == 1 and q_len > 1:
        raise ValueError(
            f"4-D attention_mask of shape {tuple(mask.shape)} is a padding mask broadcast over the "
            "queries: it carries no causal structure and is not what this layer needs (GPT-2 in "
            "transformers < 4.53 builds it for custom attention implementations): upgrade "
            "transformers to >= 4.53, or run without padding"
        )
    if mask.shape[-1] < kv_len or mask.shape[-2] != q_len or mask.shape[0] not in (1, batch) \
            or mask.shape[1] not in (1, heads):
        raise ValueError(
            f"4-D attention_mask of shape {tuple(mask.shape)} does not match (batch, heads, q_len, "
            f"kv_len) = ({batch}, {heads}, {q_len}, {kv_len})"
        )
    mask = mask[..., :kv_len]  # transformers <= 4.52 may build one column more than the keys
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        drop = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
        if not bool((keep | drop).all()):
            raise ValueError(
                "attention_mask is an additive float mask with values other than 0 and -inf (or the "
                "dtype's minimum): an attention bias (ALiBi, relative position bias, ...). "
                "attn_implementation='ttt_bob' computes softmax(q·kᵀ·scale) without a bias; use "
                "'sdpa' or 'eager' for this model"
            )
    else:
        raise TypeError(f"a 4-D attention_mask must be boolean or floating point, got {mask.dtype}")
    if keep.shape[1] > 1:
        if not bool((keep == keep[:, :1]).all()):
            raise NotImplementedError(_UNSUPPORTED_PATTERN.format(detail=" (it differs between heads)"))
    keep = keep[:, 0].expand(batch, q_len, kv_len)

    def own_token_seen(col: Tensor) -> Tensor:  # query i is token i + N_k - N_q
        if q_len > kv_len:
            return torch.ones(batch, q_len, dtype=torch.bool, device=col.device)
        return col[:, kv_len - q_len:]

    return _describe(lambda s, e: keep[:, s:e], None, batch, q_len, kv_len, mask.device,
                     fallback_q_valid=own_token_seen)
