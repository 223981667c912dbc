"""cp_attention: context-parallel (sequence-sharded) attention that honours every mask.

Sliding windows, chunked attention, packed documents, soft-capping, sinks and GQA are computed
exactly under context parallelism: a planner derives, for every pair of ranks, the varlen kernel
calls and the K/V halo the mask needs, and one ring autograd function executes the plan.
"""

from . import layout
from .api import ContextParallel, attention, context_parallel, forward_plan_stats, last_plan_stats
from .balance import balanced_layout, plan_stats
from .layout import Layout
from .comm import RankFailedError
from .masks import MaskSpec, SequenceMeta
from .plan import PlanStats, RankPlan, build_plan

__all__ = ["attention", "context_parallel", "ContextParallel", "last_plan_stats", "forward_plan_stats", "MaskSpec",
           "RankFailedError",
           "SequenceMeta", "PlanStats", "RankPlan", "build_plan", "layout", "Layout", "balanced_layout", "plan_stats"]
__version__ = "0.1.0"

from .integrations import install as _install_integrations

_install_integrations()  # attn_implementation="cp_flash" in transformers (lazily)
