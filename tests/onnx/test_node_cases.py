"""`pockjax.onnx` against ONNX's own specification: the node test cases of the `onnx`
package (`benchmarks/onnx_node_cases.py` runs them). Every case whose operators
`pockjax.onnx.OPS` runs, at opset 13 and later, either gives the expected outputs
within the case's tolerances or raises `NotImplementedError` naming what it does not
run; none gives a wrong result or another error."""
from __future__ import annotations

import collections

from benchmarks.onnx_node_cases import outcomes


def test_onnx_node_cases_pass_or_are_refused_by_name():
    rows = outcomes()
    count = collections.Counter(r["outcome"] for r in rows)
    wrong = [r["case"] for r in rows if r["outcome"] == "wrong"]
    assert not wrong, f"{len(wrong)} wrong results: {wrong[:10]}"
    raw = [(r["case"], r["said"][:200]) for r in rows if r["outcome"] == "error"]
    assert not raw, f"{len(raw)} errors other than NotImplementedError: {raw[:5]}"
    # 774 cases pass here; the refused ones are variants named in their messages (casts
    # to 8-bit floats and 4- or 2-bit integers, training-mode Dropout and
    # BatchNormalization, MaxPool's indices and Dropout's mask, string tensors).
    assert count["pass"] >= 774, count
