"""The scheme search on a problem whose answer is known, its pieces, and its CLI.

Three branches, each seeing its own third of the input, add up to the output. The
student equals the teacher except for branch 1's first kernel, so training branch 1
is the only thing that helps: the other branches cannot see its inputs.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax.scheme_search import (Candidate, CandidateResult, _knapsack, find_candidates,
                                   parse_budget)
from tests.helpers import assert_matches_dense

D, BRANCHES, STEPS = 16, 3, 20
# Tight enough that only branch 1 fits: its kernel, second kernel and bias need 39.5 kB
# of the 45.0 kB this leaves, and half of branch 2's first kernel, which improves the
# held-out loss by 3.7% of branch 1's kernel (above the 2% noise floor), needs 9.2 kB
# more. (At 70%, 52.5 kB since the fused step's writes are tied by data, it fitted.)
BUDGET = "60%"


def init(key):
    ks = jax.random.split(key, 2 * BRANCHES)
    return {f"branch{i}": {"l1": {"kernel": jax.random.normal(ks[2 * i], (D, D)) / np.sqrt(D),
                                  "bias": jnp.zeros(D)},
                           "l2": {"kernel": jax.random.normal(ks[2 * i + 1], (D, 1)) / np.sqrt(D)}}
            for i in range(BRANCHES)}


TEACHER = init(jax.random.key(0))


def student():
    p = jax.tree_util.tree_map(jnp.copy, TEACHER)
    noise = jax.random.normal(jax.random.key(1), (D, D)) / np.sqrt(D)
    p["branch1"]["l1"]["kernel"] = p["branch1"]["l1"]["kernel"] + 0.8 * noise
    return p


def forward(p, x):
    parts = jnp.split(x, BRANCHES, axis=-1)
    return sum(jnp.tanh(xi @ p[f"branch{i}"]["l1"]["kernel"] + p[f"branch{i}"]["l1"]["bias"])
               @ p[f"branch{i}"]["l2"]["kernel"] for i, xi in enumerate(parts))


def loss(p, batch):
    x, y = batch
    return jnp.mean((forward(p, x) - y) ** 2)


def batch(i, n=64):
    x = np.asarray(jax.random.normal(jax.random.key(100 + i), (n, D * BRANCHES)))
    return x, np.asarray(forward(TEACHER, x))


DATA = ([batch(i) for i in range(STEPS)], [batch(1000 + i) for i in range(2)])


def factory(scheme):
    return pj.sparse_train(loss, optimizer=optax.adam(3e-2), scheme=scheme)


def problem():
    """For the CLI: `pockjax search tests/scheme_search/test_search.py:problem`."""
    return factory, student(), DATA


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("search-cache"))
    scheme, report = pj.search_scheme(factory, student(), DATA, budget=BUDGET, steps=STEPS, cache=cache,
                               progress=False)
    return scheme, report, cache


def test_the_layer_that_matters_is_found(searched):
    scheme, report, _ = searched
    by_name = {r.name: r for r in report.results}
    best = max(report.results, key=lambda r: r.contribution)
    assert best.group.startswith("branch1/")
    others = [r.contribution for r in report.results if not r.group.startswith("branch1/")]
    assert by_name["branch1/l1/kernel full"].contribution > 10 * max(others)
    # Only branch 1 trains, its first kernel included; the rest is noise.
    decisions = pj.scheme.leaves_with_paths(scheme.resolve(student()))[0]
    trained = {p for p, d in decisions if not isinstance(d, pj.Frozen)}
    assert "branch1/l1/kernel" in trained
    assert all(p.startswith("branch1/") for p in trained), trained
    assert report.measured_bytes <= report.budget_bytes
    assert report.budget_bytes == int(0.6 * report.full_bytes)


def test_costs_come_from_the_compiler(searched):
    _, report, _ = searched
    by_name = {r.name: r for r in report.results}
    for r in report.results:
        assert r.peak_bytes > report.forward_bytes and r.flops > 0
        assert r.added_bytes == r.peak_bytes - report.forward_bytes
    # A quarter of the input channels costs less than the whole kernel.
    assert by_name["branch1/l1/kernel 1/4 in"].peak_bytes < by_name["branch1/l1/kernel full"].peak_bytes
    # Its real step: the chosen scheme compiled again gives the reported figure.
    step = factory(report.scheme)
    state = step.init(student())
    compiled = step.lower(state, DATA[0][0]).compile()
    assert pj.compiled_memory(compiled)["peak"] == report.measured_bytes


def test_the_scheme_round_trips_and_trains(searched, tmp_path):
    scheme, report, _ = searched
    again = pj.Scheme.from_json(scheme.to_json())
    assert again == scheme
    assert_matches_dense(loss, again, student(), DATA[0][0])
    trainer = factory(again)
    state = trainer.init(student())
    before = float(loss(state.params, DATA[1][0]))
    for b in DATA[0]:
        state, _ = trainer(state, b)
    assert float(loss(state.params, DATA[1][0])) < 0.5 * before
    text = str(report)
    assert "* branch1/l1/kernel" in text and "budget" in text and "compiled" in text
    report.plot(str(tmp_path / "search.png"))
    assert (tmp_path / "search.png").stat().st_size > 10_000
    import unittest.mock
    with unittest.mock.patch.dict(sys.modules, {"matplotlib": None}):
        with pytest.raises(ImportError, match="needs matplotlib: pip install matplotlib"):
            report.plot(str(tmp_path / "other.png"))
    report.save(str(tmp_path / "report.json"))
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["chosen"] == report.chosen and len(saved["results"]) == len(report.results)


def test_an_interrupted_analysis_resumes_from_the_cache(searched, tmp_path):
    _, report, _ = searched
    runs = []

    def counting(scheme, stop_after=None):
        trainer = factory(scheme)
        original = trainer.init

        def init(params, **kw):
            if not isinstance(jax.tree_util.tree_leaves(params)[0], jax.core.Tracer):
                runs.append(scheme)  # a candidate's run (cost checks trace init abstractly)
                if stop_after is not None and len(runs) > stop_after:
                    raise KeyboardInterrupt
            return original(params, **kw)

        trainer.init = init
        return trainer

    cache = str(tmp_path / "cache")
    with pytest.raises(KeyboardInterrupt):
        pj.search_scheme(lambda s: counting(s, stop_after=5), student(), DATA, budget=BUDGET,
                  steps=STEPS, cache=cache, progress=False)
    assert len(runs) == 6
    runs.clear()
    _, resumed = pj.search_scheme(counting, student(), DATA, budget=BUDGET, steps=STEPS, cache=cache,
                           progress=False)
    assert len(runs) == len(report.results) - 5
    assert [r.contribution for r in resumed.results] == [r.contribution for r in report.results]
    assert resumed.chosen == report.chosen


def _result(name, group, value, cost, flops=1.0):
    return CandidateResult(name=name, group=group, rules=[], loss=0.0, contribution=value,
                           peak_bytes=cost, added_bytes=cost, flops=flops, seconds=0.0)


def test_knapsack_is_exact_on_small_problems():
    rng = np.random.default_rng(0)
    for trial in range(30):
        results = [_result(f"g{g}/{o}", f"g{g}", float(rng.uniform(0, 1)),
                           int(rng.integers(1, 50)) * 100, float(rng.integers(1, 10)))
                   for g in range(4) for o in range(int(rng.integers(1, 4)))]
        capacity = int(rng.integers(5, 120)) * 100
        flop_budget = float(rng.integers(3, 20)) if trial % 2 else None
        got = _knapsack(results, capacity, flop_budget)
        groups = sorted({r.group for r in results})
        options = [[None] + [r for r in results if r.group == g] for g in groups]
        best = 0.0
        for combo in itertools.product(*options):
            chosen = [r for r in combo if r is not None]
            if sum(r.added_bytes for r in chosen) <= capacity and (
                    flop_budget is None or sum(r.flops for r in chosen) <= flop_budget):
                best = max(best, sum(r.contribution for r in chosen))
        assert sum(r.contribution for r in got) == pytest.approx(best)
        assert len({r.group for r in got}) == len(got)
        assert sum(r.added_bytes for r in got) <= capacity


def test_flop_budget_is_kept(searched):
    _, report, cache = searched
    by_name = {r.name: r for r in report.results}
    full, half = by_name["branch1/l1/kernel full"].flops, by_name["branch1/l1/kernel 1/2 in"].flops
    assert half < full
    limit = (half + full) / 2
    _, small = pj.search_scheme(factory, student(), DATA, budget=BUDGET, steps=STEPS, cache=cache,
                         progress=False, flop_budget=limit)
    assert small.measured_flops <= limit
    assert "branch1/l1/kernel full" not in small.chosen and small.chosen
    with pytest.raises(ValueError, match="FLOP budget .* is below every candidate's step"):
        pj.search_scheme(factory, student(), DATA, budget=BUDGET, steps=STEPS, cache=cache,
                  progress=False, flop_budget=1.0)


def test_budgets_out_of_range_say_what_makes_sense(searched):
    _, report, cache = searched
    run = lambda budget: pj.search_scheme(factory, student(), DATA, budget=budget, steps=STEPS,
                                   cache=cache, progress=False)
    with pytest.raises(ValueError, match=r"at least full fine-tuning's step memory.*between"):
        run("100%")
    with pytest.raises(ValueError, match=r"does not exceed the forward pass.*between .* and "
                                         r"full fine-tuning's .*%' to '"):
        run("10%")
    smallest = min(r.peak_bytes for r in report.results)
    if smallest - 1 > report.forward_bytes:
        with pytest.raises(ValueError, match=r"below every candidate's step: the smallest is"):
            run(smallest - 1)
    with pytest.raises(ValueError, match="cannot read budget 'lots'"):
        run("lots")
    with pytest.raises(ValueError, match="ambiguous; write '40%'"):
        run(0.4)
    assert parse_budget("2GiB", 0) == 2 * 2**30 and parse_budget("40%", 1000) == 400
    assert parse_budget("512 MB", 0) == 512_000_000 and parse_budget(1234, 0) == 1234
    with pytest.raises(ValueError, match="at least 20"):
        pj.search_scheme(factory, student(), (DATA[0][:5], DATA[1]), steps=STEPS, progress=False)


def test_candidates():
    params = {"blocks": [{"conv": {"kernel": jnp.zeros((3, 3, 8, 16)), "bias": jnp.zeros(16)},
                          "norm": {"scale": jnp.ones(16)}} for _ in range(3)],
              "head": {"kernel": jnp.zeros((16, 4)), "bias": jnp.zeros(4)},
              "stack": {"kernel": jnp.zeros((5, 16, 16))},
              "count": jnp.zeros((), jnp.int32)}
    cands = find_candidates(params, stacked=["stack/**"])
    names = [c.name for c in cands]
    assert "blocks/0/conv/kernel full" in names and "blocks/0/conv/kernel 1/8 in" in names
    one = next(c for c in cands if c.name == "blocks/2/conv/kernel 1/4 in")
    assert one.rules == (("blocks/2/conv/kernel", pj.Channels(count=2, axis=2)),)
    last2 = next(c for c in cands if c.name == "biases of the last 2 blocks")
    assert [p for p, _ in last2.rules] == ["blocks/1/conv/bias", "blocks/2/conv/bias"]
    assert "head/bias full" in names                       # a vector outside the blocks
    assert "stack/kernel last 2/5 layers" in names and "stack/kernel last 5/5 layers" in names
    assert not any("count" in n for n in names)            # integers never train
    # Ratios that round to the whole axis are dropped: head/kernel has 16 inputs.
    tiny = find_candidates({"w": jnp.zeros((2, 3))})
    assert [c.name for c in tiny] == ["w full", "w 1/8 in"]
    only = find_candidates(params, include=["head/**"], vectors=("scale",))
    assert {c.group for c in only} == {"head/kernel", "head/bias"}
    with pytest.raises(pj.SchemeError, match="no candidates"):
        find_candidates(params, include=["nothing/**"])
    with pytest.raises(pj.SchemeError, match="ratios must be in"):
        find_candidates(params, ratios=(1.0,))
    # A stacked candidate trains the last layers of the stack, and its gradient is jax.grad's.
    stacked = next(c for c in cands if c.name == "stack/kernel last 2/5 layers")
    p = {"stack": {"kernel": jax.random.normal(jax.random.key(0), (5, 4, 4))}}
    fn = lambda p, x: jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x,
                                           p["stack"]["kernel"])[0] ** 2)
    assert_matches_dense(fn, stacked.scheme(), p, jnp.ones((2, 4)))


def test_module_candidates_cover_the_whole_model():
    """`unit="module"`: one candidate per block module and ratio, the weights outside the
    blocks on their own; the embedding's Channels train its first rows (the vocabulary
    axis) and their gradient is jax.grad's, a lookup's scatter restricted to those rows."""
    from flax import nnx

    from pockjax.models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                         num_heads=2, max_position_embeddings=16)
    graphdef, params, rest = pj.nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    cands = {c.name: c for c in find_candidates(params, ratios=(0.25,), unit="module")}
    assert {"layers/0/attn full", "layers/1/mlp 1/4 in", "embed/embedding full",
            "embed/embedding 1/4 in", "lm_head/kernel full", "norm/scale full",
            "vectors of the last 2 blocks"} <= set(cands)
    attn = cands["layers/1/attn 1/4 in"]
    assert attn.group == "layers/1/attn"
    assert sorted(p for p, _ in attn.rules) == sorted(f"layers/1/attn/{w}_proj/kernel"
                                                      for w in ("q", "k", "v", "o"))
    assert all(d == pj.Channels(count=4, axis=0) for _, d in attn.rules)
    # A third as many candidates as one per weight (4 + 3 weights a block).
    assert len(cands) < len(find_candidates(params, ratios=(0.25,))) / 2
    rows = cands["embed/embedding 1/4 in"]
    assert rows.rules == (("embed/embedding", pj.Channels(count=16, axis=0)),)
    tokens = jnp.array([[1, 20, 3, 63, 0, 15, 16, 2]])  # ids inside and outside the rows

    def lm(p, t):
        logits = pj.nnx.merge(graphdef, p, rest)(t)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                                       t[:, 1:]))

    for name in ("embed/embedding 1/4 in", "layers/0/mlp 1/4 in", "lm_head/kernel 1/4 in"):
        assert_matches_dense(lm, cands[name].scheme(), params, tokens)
    with pytest.raises(pj.SchemeError, match="unit must be one of"):
        find_candidates(params, unit="layer")


def test_nnx_search_and_trainer(tmp_path):
    from flax import nnx

    from tests.nnx.test_nnx import Net, xent

    kx, ky = jax.random.split(jax.random.key(3))
    x = np.asarray(jax.random.normal(kx, (64, 6)))
    y = np.asarray(jax.random.randint(ky, (64,), 0, 3))
    train = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)] * 2
    heldout = [(x[48:], y[48:])]
    scheme, report = pj.nnx.search_scheme(Net(nnx.Rngs(0)), xent, optimizer=optax.adam(1e-2),
                                   data=(train, heldout), budget="80%", steps=6,
                                   include=["blocks/**", "head/**"], progress=False)
    assert report.measured_bytes <= report.budget_bytes and report.chosen
    trainer = pj.nnx.Trainer(Net(nnx.Rngs(0)), xent, optimizer=optax.adam(1e-2), scheme=scheme)
    first = float(trainer(train[0])["loss"])
    for b in train[1:]:
        last = float(trainer(b)["loss"])
    assert np.isfinite(last) and last < first


def test_cli_search_then_export_with_the_scheme(searched, tmp_path):
    _, report, cache = searched
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    out = tmp_path / "scheme.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pockjax.cli", "search", "tests/scheme_search/test_search.py:problem",
         "--budget", BUDGET, "--steps", str(STEPS), "--cache", cache, "--out", str(out),
         "--report", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chosen (*)" in proc.stdout and (tmp_path / "r.png").exists()
    assert pj.Scheme.from_json(out.read_text()) == report.scheme
    bad = subprocess.run(
        [sys.executable, "-m", "pockjax.cli", "search", "tests/scheme_search/test_search.py:problem",
         "--budget", "100%", "--steps", str(STEPS), "--cache", cache, "--out", str(tmp_path / "x")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "at least full fine-tuning's step memory" in bad.stderr
    # `pockjax export --scheme` trains a scheme from a file instead of the trainer's.
    pytest.importorskip("iree.compiler")
    mlp_scheme = pj.Scheme({"dense_0/bias": pj.Full()})
    (tmp_path / "mlp.json").write_text(mlp_scheme.to_json())
    proc = subprocess.run(
        [sys.executable, "-m", "pockjax.cli", "export", "examples/export_mlp.py:make",
         "--target", "host-cpu", "--out", str(tmp_path / "art"), "--scheme",
         str(tmp_path / "mlp.json")], cwd=root, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = pj.export.read_manifest(str(tmp_path / "art"))
    trainable = [p["name"] for p in manifest["parameters"] if p["role"] == "trainable"]
    assert trainable == ["params/dense_0/bias"]
