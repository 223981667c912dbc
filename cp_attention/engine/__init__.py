"""The engine: contexts, batches and one attention call, single-device or across ranks.

* :mod:`.context`: :func:`context_parallel` and :class:`ContextParallel` (a group, its layout, backend,
  failure channel, plan cache and live batches) and the registries the integrations fill;
* :mod:`.batch`: the record of a ``cp.shard_batch`` call, bound to the tensors it returned;
* :mod:`.agreement`: the header every rank exchanges before any K/V moves;
* :mod:`.checks`: the one input check;
* :mod:`.planning`: one rank's plan and its keys in the context's cache (shared by a call and by
  preparing a batch ahead); :mod:`.prepare`: planning a batch before its step (``cp.prepare``);
* :mod:`.attend`: one call (:func:`attend`); :mod:`.layer`: the layer entry of integrations
  (:func:`attend_layer`) and the compiled multi-rank op; :mod:`.local`: the single-device op;
* :mod:`.stats`: what the most recent calls did.
"""

from .attend import attend
from .context import ContextParallel, context_parallel
from .layer import LayerDocs, attend_layer

__all__ = ["attend", "attend_layer", "LayerDocs", "ContextParallel", "context_parallel"]
