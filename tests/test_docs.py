"""The docstring examples of the public modules run and show what they print."""
import doctest
import importlib

import pytest

MODULES = ["pockjax.scheme", "pockjax.schemes", "pockjax.nnx", "pockjax.train",
           "pockjax.models.lora", "pockjax.models.llama", "pockjax.models.mobilenetv2",
           "pockjax.models.hf", "pockjax.sharding", "pockjax.schedule"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
