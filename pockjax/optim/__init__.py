"""The optax side of training: per-leaf analysis of a chain and the fused update."""
from pockjax.optim.fused import fused_step, global_step, place_updates
from pockjax.optim.perleaf import LeafUpdate, UpdatePlan, plan_updates

__all__ = ["plan_updates", "UpdatePlan", "LeafUpdate", "place_updates", "fused_step",
           "global_step"]
