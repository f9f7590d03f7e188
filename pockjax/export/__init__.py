"""Export the training step through StableHLO to IREE: targets, lowering, artifacts."""
from pockjax.export.artifact import Artifact, export, read_manifest
from pockjax.export.targets import TARGETS, ExportError, Target, resolve_target

__all__ = ["export", "Artifact", "read_manifest", "TARGETS", "Target", "resolve_target",
           "ExportError"]
