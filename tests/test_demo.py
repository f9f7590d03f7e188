"""`examples/demo.py` on a machine without a Vulkan driver says what it skipped and how
to get it (the full demo runs in tests/test_examples.py)."""
import importlib
from pathlib import Path

import iree.runtime
import pytest

import pockjax as pj

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def demo(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("demo")


def test_without_vulkan_the_demo_names_what_it_skipped_and_the_fix(demo, monkeypatch, capsys):
    def no_driver(name):
        raise RuntimeError("Error creating driver 'vulkan': vkCreateInstance failed "
                           "(VK_ERROR_INCOMPATIBLE_DRIVER)")

    monkeypatch.setattr(iree.runtime, "get_driver", no_driver)
    loaded = []
    monkeypatch.setattr(pj.runtime, "load", lambda path, device: loaded.append(device) or path)
    sessions, device, skipped = demo.open_sessions({"host-cpu": "h", "android-vulkan": "v"})
    assert (list(sessions), device, loaded) == (["host-cpu"], None, ["local-task"])
    assert skipped == [
        "the android-vulkan artifact was compiled but not run: this machine has no Vulkan driver "
        "(no Vulkan driver here (Error creating driver 'vulkan': vkCreateInstance failed "
        "(VK_ERROR_INCOMPATIBLE_DRIVER))). `make system-deps` (as root, Debian/Ubuntu) installs "
        "mesa-vulkan-drivers, whose lavapipe is a Vulkan driver that runs on the CPU, with QEMU "
        "and the aarch64 libraries for android-arm64 artifacts; then run `make demo` again"]
    assert capsys.readouterr().out == f"skipping: {skipped[0]}\n"
