"""The artifact format's names and its manifest reader, without JAX or the compiler:
the runtime reads artifacts on devices that have neither.

Attributes:
  MANIFEST: `"manifest.json"`, the manifest's file name in an artifact directory.
  VMFB: `"train_step.vmfb"`, the compiled module's file name.
  PARAMS: `"params.irpa"`, the parameter archive's file name.
"""
from __future__ import annotations

import hashlib
import json
import os

from pockjax.export.targets import ExportError

__all__ = ["MANIFEST", "VMFB", "PARAMS", "SCHEMA_VERSION", "SCOPE", "read_manifest", "check_hashes",
           "sha256"]

MANIFEST, VMFB, PARAMS = "manifest.json", "train_step.vmfb", "params.irpa"
SCHEMA_VERSION = 2
"""The manifest's `schema_version`; `read_manifest` refuses any other."""
SCOPE = "model"
"""The parameter scope the module's named parameters live in (`manifest["parameter_scope"]`)."""


def sha256(path: str) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks.

    Args:
      path: the file.

    Returns:
      The digest as 64 lowercase hex digits.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: str, hashes: bool = True) -> dict:
    """The manifest of an artifact directory, checked for the schema version and files.

    Each file the manifest lists must be present, of the recorded size and (with
    `hashes`) of the recorded SHA-256. The hash reads every byte (about 0.7 s per GiB
    here); `pockjax.runtime.load` checks it with `check_hashes` while IREE loads the
    artifact.

    Args:
      path: the artifact directory.
      hashes: also compare every file's SHA-256 with the manifest's; False checks
        sizes only.

    Returns:
      The parsed `manifest.json`.

    Raises:
      ExportError: the directory has no `manifest.json`, it is not valid JSON, its
        schema version is not `SCHEMA_VERSION`, or a listed file is missing, of another
        size or (with `hashes`) of another hash.
    """
    mpath = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.isfile(mpath):
        raise ExportError(f"'{path}' is not a pockjax artifact: {MANIFEST} is missing")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise ExportError(f"'{mpath}' is not valid JSON: {e}") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ExportError(f"'{mpath}' has schema version {manifest.get('schema_version')!r}; this "
                          f"pockjax reads version {SCHEMA_VERSION}")
    for name, info in manifest.get("files", {}).items():
        fpath = os.path.join(os.fspath(path), name)
        if not os.path.isfile(fpath):
            raise ExportError(f"artifact file '{fpath}' is missing")
        if os.path.getsize(fpath) != info["bytes"]:
            raise _damaged(fpath)
    if hashes:
        check_hashes(path, manifest)
    return manifest


def check_hashes(path: str, manifest: dict, names=None) -> None:
    """Raise `ExportError` naming the first file of the artifact (of `names`, default
    all) whose SHA-256 is not the manifest's.

    Args:
      path: the artifact directory.
      manifest: its manifest (`read_manifest`).
      names: the file names to check; None checks every file the manifest lists.

    Raises:
      ExportError: a file's SHA-256 differs from the manifest's (modified or truncated).
    """
    for name, info in manifest.get("files", {}).items():
        if names is not None and name not in names:
            continue
        fpath = os.path.join(os.fspath(path), name)
        if sha256(fpath) != info["sha256"]:
            raise _damaged(fpath)


def _damaged(fpath: str) -> ExportError:
    return ExportError(f"artifact file '{fpath}' does not match the manifest's hash "
                       "(modified or truncated); export again")
