"""The Gluon (Hopper, sm_90) passes: TMA and async ``warpgroup_mma`` versions of six passes
of the chain, chosen per call by ``plan.py`` where :mod:`.scope` finds the call in their
scope (the Triton kernels are the portable path: interpreter, other GPUs, every other input).

- :mod:`.fwd`: the forward (``fwd``, O and L);
- :mod:`.dq`: the first backward's dQ pass (``bwd_dq``, dQ and D = rowsum(dO∘O));
- :mod:`.dkdv`: the first backward's dK/dV pass (``bwd_dkdv``);
- :mod:`.bob_col`: the BoB column pass (``bob_col``, K̄ and V̄);
- :mod:`.bob_row`: the BoB statistics (``bob_stats``) and direct (``bob_direct``) row passes;
- :mod:`.scope`: per pass, whether it can take a call and, if not, why;
- :mod:`.common`: the guarded Gluon imports, TMA descriptor set-up, argument checks and tile
  ranges they share.

Importing this package never fails: without Gluon's Hopper API the modules define no kernels
and report themselves unavailable.
"""
