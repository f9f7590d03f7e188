"""`pockjax.tf`, tested in a process of its own (`tf_cases.py`): TensorFlow exports the
LLVM it is built with to everything the process loads later, and Mesa's lavapipe (the
Vulkan tests' driver, on LLVM 15) then crashes in the same pytest worker."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_pockjax_tf_cases_in_their_own_process():
    if importlib.util.find_spec("tf2jax") is None:  # found, not imported: no TensorFlow here
        pytest.skip("the tf extra (TensorFlow, tf2jax) is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         str(HERE / "tf_cases.py")],
        cwd=HERE.parents[1], capture_output=True, text=True, timeout=900,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "POCKJAX_TEST_TENSORFLOW": "1"})
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "6 passed" in summary, done.stdout[-6000:] + done.stderr[-2000:]
