"""Integrations of :func:`ttt_flash.flash_attention` with other libraries.

Submodules (each imports its library lazily; import the submodule you need):

* :mod:`ttt_flash.integrations.transformers` — Hugging Face transformers:
  ``register()`` adds ``attn_implementation="ttt_bob"`` (attention and mask function), giving
  any model that dispatches through ``transformers.AttentionInterface`` exact second-order
  gradients through attention. Needs ``transformers>=4.48`` (the ``hf`` extra).

``higher`` and ``torch.func`` need no integration code: models that call
:func:`ttt_flash.flash_attention` work inside ``higher.innerloop_ctx`` and under
``torch.func.functional_call`` / ``grad`` / ``vjp`` as they are (see docs/integrations.md).
"""
