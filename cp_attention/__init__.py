"""cp_attention: context-parallel (sequence-sharded) attention that honours every mask.

Sliding windows, chunked attention, packed documents, soft-capping, sinks and GQA are computed
exactly under context parallelism: a planner derives, for every pair of ranks, the varlen kernel
calls and the K/V halo the mask needs, and one ring autograd function executes the plan.

The floor plan of the package, its layer rules and the path of one forward: docs/architecture.md.
"""

from . import layout
from .api import attention
from .comm import RankFailedError
from .engine.context import ContextParallel, context_parallel
from .engine.stats import forward_mixer_stats, forward_plan_stats, last_plan_stats, plan_stats
from .layout import Balanced, Contiguous, Layout, Zigzag, balanced_layout
from .masks import MaskSpec, SequenceMeta
from .plan import PlanStats, RankPlan, build_plan
from .strategies import CostModel

__all__ = ["attention", "context_parallel", "ContextParallel", "last_plan_stats", "forward_plan_stats",
           "forward_mixer_stats", "MaskSpec", "RankFailedError", "SequenceMeta", "PlanStats", "RankPlan", "build_plan", "layout", "Layout", "Zigzag",
           "Contiguous", "Balanced", "balanced_layout", "plan_stats", "CostModel"]
__version__ = "0.1.0"

from .integrations import install as _install_integrations

_install_integrations()  # attn_implementation="cp_flash" and cp.shard_batch's conventions (lazily)
