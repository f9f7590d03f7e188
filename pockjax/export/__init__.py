"""Export of the training step through StableHLO to IREE (targets, artifacts).

Not implemented yet: `pockjax.export` currently provides nothing.
"""
__all__: list[str] = []
