import os
import sys

# TensorFlow exports the LLVM it is built with to every library loaded after it, and Mesa's
# lavapipe (LLVM 15, the Vulkan tests' driver) then crashes in the same process; Keras
# imports TensorFlow to save a file when it is installed. Test processes run without it:
# pockjax.tf's cases run in a process of their own (tests/tf/test_tf.py), which sets
# POCKJAX_TEST_TENSORFLOW=1.
if not os.environ.get("POCKJAX_TEST_TENSORFLOW"):
    sys.modules.setdefault("tensorflow", None)

import jax
from hypothesis import settings

# Four host CPU devices, so the SPMD tests (tests/test_sharding.py) have a mesh to
# run on. Other tests use the first device only, as JAX does by default.
jax.config.update("jax_num_cpu_devices", 4)

settings.register_profile("pockjax", deadline=None, max_examples=12, derandomize=True)
settings.load_profile("pockjax")


# The files that take longest, longest first (worker-seconds in a full `make test` on a
# 2-core host, 2026-11-27; test_prefix, test_lowbit and test_workarounds placed by their
# times run alone, test_docs by its guides' programs, about 6 minutes). `make test` hands whole files to the workers in collection
# order (`--dist loadfile --no-loadscope-reorder`); starting the long ones first keeps
# one worker from running a long file alone at the end.
LONGEST_FIRST = (
    "tests/test_examples.py", "tests/benchmarks/test_quality.py", "tests/test_docs.py",
    "tests/export/test_targets.py",
    "tests/gguf/test_gguf.py", "tests/train/test_differential.py", "tests/torch/test_torch.py", "tests/finetuning/test_finetune.py",
    "tests/test_remat.py", "tests/models/test_mobilenetv2.py",
    "tests/models/test_mobilenetv2_kernels.py", "tests/transforms/test_sparse_grad.py",
    "tests/export/test_vulkan.py", "tests/export/test_host_cpu.py", "tests/prefix/test_prefix.py",
    "tests/lowbit/test_lowbit.py", "tests/scheme_search/test_search.py", "tests/test_workarounds.py",
    "tests/models/test_batchnorm.py", "tests/models/test_llama_mixed_precision.py",
    "tests/export/test_stream.py", "tests/transforms/test_rules.py",
    "tests/export/test_arm64.py",
)


# Markers (declared in pyproject.toml) for deselecting groups locally: `-m "not emulator"`.
SLOW_FILES = ("tests/test_examples.py", "tests/benchmarks/test_quality.py", "tests/test_demo.py")
EMULATOR_WORDS = ("vulkan", "arm64", "lavapipe", "qemu")


def _markers(nodeid: str) -> list[str]:
    path, lowered = nodeid.split("::")[0], nodeid.lower()
    marks = []
    if path.startswith("tests/export/") or "export" in lowered:
        marks.append("export")
    if any(word in lowered for word in EMULATOR_WORDS):
        marks.append("emulator")
    if path in SLOW_FILES:
        marks.append("slow")
    return marks


def pytest_collection_modifyitems(items):
    for item in items:
        for name in _markers(item.nodeid):
            item.add_marker(name)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))
