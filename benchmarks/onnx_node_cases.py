"""`pockjax.onnx` against ONNX's own node test cases, per operator.

The `onnx` package's node test cases (`onnx.backend.test.case.node`, generated in
memory: the wheel ships no data files) are run for every operator `pockjax.onnx.OPS`
claims, at opset 13 and later. A case passes when every output equals the expected one
within the case's tolerances (integers exactly; int64 comes back as int32, JAX's
default). An axis, shape or index input that a case feeds as data is passed as a
constant, as an exported model holds it. Each case ends one of four ways: passed,
refused (`NotImplementedError` naming the variant pockjax.onnx does not run), wrong
(different outputs), or another error; the tests require no wrong result and no other
error. Writes benchmarks/results/onnx_node_cases.md.

    python -m benchmarks onnx_node_cases
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, versions  # noqa: E402


def _array(x):
    from onnx import TensorProto, numpy_helper

    return numpy_helper.to_array(x) if isinstance(x, TensorProto) else np.asarray(x)


def _matches(got, want, case) -> bool:
    got = got if isinstance(got, tuple) else (got,)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        g, w = np.asarray(g), _array(w)
        if g.shape != w.shape:
            return False
        if w.dtype.kind in "fcV":  # V: bfloat16
            if not np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=case.rtol,
                               atol=case.atol, equal_nan=True):
                return False
        elif not np.array_equal(g, w):
            return False
    return True


def _run(graph, opset, inputs):
    """The case's outputs, or the `NotImplementedError` or other exception it raised."""
    from pockjax.onnx import OnnxFunction

    try:
        try:
            return OnnxFunction(graph, {}, {}, {}, opset)({}, *inputs)
        except NotImplementedError as e:
            if "computed from the data" not in str(e):
                raise
        names = [i.name for i in graph.input]
        constants = {n: x for n, x in zip(names, inputs) if x.dtype.kind in "iub"}
        return OnnxFunction(graph, constants, {}, {}, opset)(
            {}, *[x for n, x in zip(names, inputs) if n not in constants])
    except Exception as e:  # noqa: BLE001 - the outcome is what is reported
        return e


def outcomes() -> list[dict]:
    """Every case of an operator pockjax.onnx runs: its name, operators, and outcome
    ("pass", "refused", "wrong" or "error") with the message of a raised one."""
    from pockjax.onnx import MIN_OPSET, OPS

    with warnings.catch_warnings():  # the generators divide by zero on purpose
        warnings.simplefilter("ignore")
        from onnx.backend.test.case import node

        cases = node.collect_testcases(None)
    rows = []
    for case in cases:
        graph = case.model.graph
        ops = sorted({n.op_type for n in graph.node})
        opset = max((o.version for o in case.model.opset_import
                     if o.domain in ("", "ai.onnx")), default=0)
        if opset < MIN_OPSET or not set(ops) <= set(OPS):
            continue
        for inputs, outputs in case.data_sets:
            got = _run(graph, opset, [_array(x) for x in inputs])
            if isinstance(got, NotImplementedError):
                kind, said = "refused", str(got)
            elif isinstance(got, Exception):
                kind, said = "error", f"{type(got).__name__}: {got}"
            else:
                kind, said = ("pass" if _matches(got, outputs, case) else "wrong"), ""
            rows.append({"case": case.name, "ops": ops, "outcome": kind, "said": said})
    return rows


def write(rows: list[dict], wall: float) -> str:
    """The results page: totals, and per operator (each case counted under the
    operators of its graph)."""
    total = collections.Counter(r["outcome"] for r in rows)
    per: dict = collections.defaultdict(collections.Counter)
    why: dict = collections.defaultdict(set)
    for r in rows:
        for op in r["ops"]:
            per[op][r["outcome"]] += 1
            if r["outcome"] == "refused":
                why[op].add(r["said"].split(": ", 1)[-1][:90])
    lines = ["# pockjax.onnx against ONNX's node test cases", "",
             f"{versions(['pockjax', 'onnx', 'jax'])}. Commit {commit()}. `python -m benchmarks "
             f"onnx_node_cases`, run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{wall:.0f} s. Method: the script's docstring.", "",
             f"{len(rows)} cases of the operators pockjax.onnx runs (opset 13 and later): "
             f"**{total['pass']} pass**, {total['refused']} refused by name, "
             f"{total['wrong']} wrong, {total['error']} other errors.", "",
             "| operator | pass | refused | wrong | other error | refused variants |",
             "|---|---:|---:|---:|---:|---|"]
    for op in sorted(per):
        c = per[op]
        lines.append(f"| {op} | {c['pass']} | {c['refused']} | {c['wrong']} | {c['error']} | "
                     f"{'; '.join(sorted(why[op]))[:300]} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "onnx_node_cases.md"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = outcomes()
    text = write(rows, time.perf_counter() - t0)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
