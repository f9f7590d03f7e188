"""benchmarks/real_size.py's own machinery: the memory guard, the direct-dtype model
builder and its noise."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pockjax as pj
from pockjax import lowbit
from benchmarks.common import malloc_env
from benchmarks.real_size import PRESETS, _uniform, build_params, guarded, scheme_for

HOG = ("import sys, time; print('STAGE init', flush=True); time.sleep(0.3); "
       "print('STAGE step 1', flush=True); x = bytearray(400 * 2**20); "
       "x[::4096] = b'1' * len(x[::4096]); time.sleep(30)")


def test_guard_kills_a_row_over_the_limit_and_says_where(tmp_path):
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    r = guarded([str(script)], limit_gib=0.25, timeout=60)
    assert r["error"].startswith("does not fit: ") and r["error"].endswith("GiB at step 1"), r
    assert r["wall_s"] < 20


def test_guard_times_out_and_reports_failures(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time; print('STAGE compile', flush=True); time.sleep(30)")
    assert guarded([str(slow)], limit_gib=8, timeout=1)["error"] == \
        "timed out after 1 s at compile"
    bad = tmp_path / "bad.py"
    bad.write_text("raise ValueError('no such weight')")
    assert "ValueError: no such weight" in guarded([str(bad)], limit_gib=8, timeout=30)["error"]
    good = tmp_path / "good.py"
    good.write_text('print(\'RESULT {"times": [1.0]}\')')
    assert guarded([str(good)], limit_gib=8, timeout=30)["times"] == [1.0]


def test_guard_runs_the_row_with_the_allocator_setting(tmp_path):
    script = tmp_path / "env.py"
    script.write_text("import json, os; print('RESULT ' + json.dumps("
                      "{'tunables': os.environ.get('GLIBC_TUNABLES', '')}))")
    for mode, huge in (("hugepages", True), ("pockjax", False), ("system", False)):
        env, _ = malloc_env(mode)
        tunables = guarded([str(script)], limit_gib=8, timeout=30, env=env)["tunables"]
        assert ("glibc.malloc.hugetlb=1" in tunables.split(":")) == huge, (mode, tunables)


def test_params_are_made_in_their_storage_dtypes():
    s = PRESETS["smoke"]
    row = "pockjax sparse last-k bf16-frozen upcast"
    _, abstract, scheme, arrays = build_params(s, scheme_for(row, s), jnp.bfloat16, jnp.float32)
    params = arrays()
    for x, a, d in zip(jax.tree.leaves(params), jax.tree.leaves(abstract),
                       jax.tree.leaves(scheme.resolve(params))):
        assert x.dtype == a.dtype == (jnp.bfloat16 if isinstance(d, pj.Frozen) else jnp.float32)
    kernel = params["layers"][0]["mlp"]["up_proj"]["kernel"]   # frozen: a lowbit node
    assert lowbit.is_quantized(kernel) and kernel.data.dtype == jnp.bfloat16
    w = np.asarray(lowbit.dequantize(kernel, jnp.float32))
    assert abs(w.std() - 0.02) < 1e-3 and abs(w.mean()) < 1e-3
    assert np.all(np.asarray(params["norm"]["scale"]) == 1)


def test_uniform_noise_differs_by_seed():
    a = np.asarray(_uniform(jnp.uint32(1), (64, 64), jnp.float32, 0.02))
    b = np.asarray(_uniform(jnp.uint32(2), (64, 64), jnp.float32, 0.02))
    assert np.abs(a).max() <= 0.02 * 3 ** 0.5 + 1e-6
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.1


def test_stages_say_where_the_peak_happened():
    from benchmarks.real_size import stages_table

    s = PRESETS["smoke"]
    stages = [["init", 0.16, 0.16], ["compile", 0.2, 0.2], ["weights", 0.3, 0.46],
              ["optimizer state", 2.86, 2.86], ["step 1", 4.84, 4.84], ["step 2", 5.1, 5.21],
              ["step 3", 5.1, 5.23], ["end", 5.1, 5.23]]
    r = {"stages": stages, "rss_imports_mib": 0.16 * 1024, "args_gib": 4.51, "temp_gib": 0.28,
         "compiled_peak_gib": 4.79}
    row = stages_table(s, {"pockjax sparse last-k f32": r})[-2]
    assert row.startswith("| pockjax sparse last-2 f32 | 0.16 | 0.46 | 0.30 | 2.86 | 4.84 | 5.21 "
                          "| 5.23 | step 2 | 0.33 | 0.39 | 4.79 (4.51 + 0.28) |"), row
    # a peak from compiling (small models) is not put down to the steps
    early = [["init", 0.16, 0.16], ["compile", 0.2, 0.2], ["weights", 0.26, 0.4],
             ["optimizer state", 0.28, 0.4], ["step 1", 0.3, 0.4], ["step 2", 0.31, 0.4],
             ["end", 0.31, 0.4]]
    small = {**r, "stages": early, "args_gib": 0.02, "temp_gib": 0.0, "compiled_peak_gib": 0.02}
    row = stages_table(s, {"pockjax sparse last-k f32": small})[-2]
    assert "| 0.40 | compile | 0.28 | - |" in row, row


def test_jax_optax_full_trains_every_parameter():
    s = PRESETS["smoke"]
    _, abstract, scheme, _ = build_params(s, scheme_for("jax+optax full f32", s))
    assert all(isinstance(d, pj.Full) for d in jax.tree.leaves(scheme.resolve(abstract)))


def test_iree_rows_export_a_jax_row_and_say_which_plan_was_kept():
    from benchmarks.real_size import IREE_ROWS, ROWS, iree_table

    assert set(IREE_ROWS) <= set(ROWS) and set(IREE_ROWS.values()) <= set(ROWS)
    s = PRESETS["smoke"]
    row = "pockjax paper last-2 bf16-frozen upcast iree host-cpu"
    split = {"total": 1.0, "file": 0.5, "anon": 0.5}
    iree = {"export_s": 12.0, "export_rss_peak_mib": 400.0, "archive_gib": 0.02,
            "flags": ["--x"], "imports_jax": False, "load_s": 0.1, "rss_load_gib": split,
            "rss_end_gib": split, "times": [0.02, 0.01, 0.03], "rss_peak_mib": 100.0,
            "losses": [7.0, 6.5]}
    jax_row = {"times": [0.02], "rss_peak_mib": 200.0, "losses": [7.0, 6.5]}

    def text(**recorded):
        results = {row: {**iree, **recorded}, IREE_ROWS[row]: jax_row}
        return "\n".join(iree_table("smoke", s, row, results))

    assert "The step allocates 3.00 MiB beside its state (stream plan), its trained weights' " \
           "matmul reads tied" in text(step_alloc_bytes=3 * 2**20, tied_weight_reads=True)
    assert "The step allocates 1.50 GiB beside its state (stream plan), the untied step" in \
        text(step_alloc_bytes=3 * 2**30 // 2, tied_weight_reads=False)
    older = text()  # rows recorded before the plan was
    assert "The step allocates" not in older and "`--x`. The runtime process imports no JAX" in older
    assert "| s/step (median) | 0.02 | 0.02 | 1.00x |" in older
