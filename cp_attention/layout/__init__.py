"""Which global tokens each rank holds, in which local order.

* :mod:`.layouts`: :class:`Zigzag`, :class:`Contiguous` and :class:`Layout` (any assignment) and the
  functions that shard and unshard along them;
* :mod:`.balanced`: the :class:`Balanced` policy and :func:`balanced_layout` (a layout per packed
  batch), built on :mod:`.costs` (the cost and traffic models), :mod:`.partition` and :mod:`.split`.
"""

from .balanced import Balanced, as_policy, balanced_layout, balanced_layout_of
from .costs import token_costs
from .layouts import (LAYOUTS, Contiguous, Layout, NamedLayout, Zigzag, as_layout, check_layout, global_index,
                      infer_seq_len, layout_code, local_lengths, merge_ranges, rank_ranges, shard, slice_bounds,
                      unshard)

__all__ = ["LAYOUTS", "Layout", "NamedLayout", "Zigzag", "Contiguous", "Balanced", "as_layout", "as_policy",
           "balanced_layout", "balanced_layout_of", "token_costs", "merge_ranges", "check_layout", "layout_code",
           "slice_bounds", "rank_ranges", "local_lengths", "global_index", "shard", "unshard", "infer_seq_len"]
