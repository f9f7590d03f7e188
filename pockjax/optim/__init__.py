"""The optax side of training: per-leaf analysis of a chain, the fused update, and AdamW
with 8- or 16-bit moments (`adamw(..., moments="int8")`)."""
from pockjax.optim import moments
from pockjax.optim.fused import fused_step, global_step, place_updates
from pockjax.optim.moments import adamw, scale_by_adam, state_bytes
from pockjax.optim.perleaf import LeafUpdate, UpdatePlan, plan_updates

__all__ = ["plan_updates", "UpdatePlan", "LeafUpdate", "place_updates", "fused_step",
           "global_step", "adamw", "scale_by_adam", "state_bytes", "moments"]
