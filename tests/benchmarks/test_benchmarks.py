"""The benchmark scripts' own logic: size presets and the profile's grouping of HLO."""
import jax
import jax.numpy as jnp
import pytest

from benchmarks.paper_table import sizes
from benchmarks.profile_step import hlo_groups


def test_sizes_presets_and_overrides():
    big = sizes("llama", True, "llama2-7b")
    assert (big["layers"], big["hidden"], big["intermediate"], big["heads"], big["vocab"]) == \
        (32, 4096, 11008, 32, 32000)
    assert sizes("llama", False, "layers=2,seq=32")["layers"] == 2
    assert sizes("mobilenetv2", False, "width=0.75")["width"] == 0.75
    with pytest.raises(SystemExit, match="key=value with keys"):
        sizes("llama", True, "depth=3")


def test_profile_groups_convolutions_by_kind():
    def loss(w, dw, x):
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)
        y = jax.lax.conv_general_dilated(jax.nn.relu(y), dw, (1, 1), "SAME", dimension_numbers=dn,
                                         feature_group_count=8)
        return jnp.mean(y @ jnp.ones((8, 4)))

    args = (jnp.ones((1, 1, 4, 8)), jnp.ones((3, 3, 1, 8)), jnp.ones((2, 8, 8, 4)))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    groups = hlo_groups(compiled.as_text())
    kinds = set(groups.values())
    assert {"depthwise conv", "conv", "matmul"} <= kinds, groups


def test_torch_profile_groups_every_operator_of_a_step():
    """PyTorch's step under torch.profiler: operators land in the XLA tables' groups, the
    matmuls and the fused AdamW among them, and their own times add up to no more than
    the steps' wall time."""
    from benchmarks.profile_step import profile_torch, torch_group
    from benchmarks.real_size import PRESETS

    assert torch_group("aten::addmm") == torch_group("aten::mm") == "matmul"
    assert torch_group("aten::add_") == "elementwise/reduce"
    assert torch_group("aten::_log_softmax_backward_data") == "elementwise/reduce"
    assert torch_group("aten::_fused_adamw_") == "optimizer update"
    assert torch_group("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == \
        "attention kernel (SDPA)"
    assert torch_group("aten::copy_") == "copy/transpose"
    assert torch_group("aten::embedding_dense_backward") == "other"
    got = profile_torch(PRESETS["smoke"], steps=2, warmup=1)
    groups = {torch_group(k) for k in got["ops"]}
    assert {"matmul", "optimizer update", "elementwise/reduce"} <= groups, sorted(got["ops"])
    assert 0 < sum(got["ops"].values()) <= got["wall"] * 1e3 * 1.05


def test_malloc_env_sets_the_modes_and_keeps_the_users_own_tunables(monkeypatch):
    from benchmarks.common import malloc_env

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0")
    monkeypatch.setenv("POCKJAX_MALLOC", "system")
    env, text = malloc_env("hugepages")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert "POCKJAX_MALLOC" not in env
    assert text.startswith("pockjax's reuse of each step's memory (the default), "
                           "`GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1`")
    env, text = malloc_env("pockjax")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"   # the user's own kept
    monkeypatch.delenv("GLIBC_TUNABLES")
    env, text = malloc_env("system")
    assert "GLIBC_TUNABLES" not in env and env["POCKJAX_MALLOC"] == "system"
    assert text.startswith("`POCKJAX_MALLOC=system` (JAX's and glibc's own settings), "
                           "transparent huge pages `")
    with pytest.raises(ValueError, match="malloc mode 'default': one of pockjax, hugepages"):
        malloc_env("default")


def test_remat_table_reports_each_sequence_with_and_without_remat(tmp_path):
    from benchmarks.remat_table import main

    out = tmp_path / "remat.md"
    main(["--llama", "smoke", "--seqs", "16,64", "--out", str(out)])
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| 16 ") or line.startswith("| 64 ")]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == \
        [("16", "none"), ("16", '`"blocks"`'), ("64", "none"), ("64", '`"blocks"`')]
    units = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10}
    mib = lambda cell: float(cell.split()[0].replace(",", "")) * units[cell.split()[1]]
    # Checkpointed blocks keep less for the backward pass and cost more FLOPs.
    for plain, remat in (rows[0:2], rows[2:4]):
        assert mib(remat[3]) < mib(plain[3])
        assert float(remat[5].replace(",", "")) > float(plain[5].replace(",", ""))


def test_sharded_memory_falls_with_the_device_count(tmp_path):
    """The sharded-memory benchmark's rows (its own process, forced host devices): each
    device's arguments halve as the devices double, and the total falls; its table
    names the fewest devices that fit."""
    import json

    from benchmarks.sharded_memory import main

    out = tmp_path / "sharded.md"
    main(["--llama", "smoke", "--devices", "1,2,4", "--batch", "4", "--seq", "32",
          "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["devices"] for r in rows] == [1, 2, 4], rows
    for a, b in zip(rows, rows[1:]):
        assert b["args_gib"] < 0.55 * a["args_gib"], rows
        assert b["total_gib"] < a["total_gib"], rows
    assert "- smoke, 24 GiB: 1" in out.read_text()


def test_gpu_check_compares_an_artifact_with_the_jax_trainer(tmp_path):
    """benchmarks/gpu.py's halves on this CPU: an artifact exported for host-cpu, run by
    the runtime on local-task against the JAX trainer's recorded steps, within the export
    tests' tolerance; a parameter changed by 1e-3 is reported far outside it; the report
    names the model."""
    import json
    import pickle

    from benchmarks import gpu

    gpu.main(["prepare", "--dir", str(tmp_path), "--target", "host-cpu", "--models", "mlp"])
    out = tmp_path / "cuda.json"
    gpu.main(["cuda", "--dir", str(tmp_path), "--device", "local-task", "--json", str(out)])
    row = json.loads(out.read_text())["models"]["mlp"]
    assert "error" not in row, row
    assert row["step_count"] == 3 and len(row["metrics_tol"]) == 3
    assert max(row["metrics_tol"]) <= 1 and row["params_tol"] <= 1, row

    ref_file = tmp_path / "artifacts" / "mlp" / "reference.pkl"
    ref = pickle.loads(ref_file.read_bytes())
    leaf = sorted(ref["params"])[0]
    ref["params"][leaf] = ref["params"][leaf] + 1e-3
    ref_file.write_bytes(pickle.dumps(ref))
    gpu.main(["cuda", "--dir", str(tmp_path), "--device", "local-task", "--json", str(out)])
    bad = json.loads(out.read_text())["models"]["mlp"]
    assert bad["params_tol"] > 5 and bad["worst_leaf"] == leaf, bad

    md = tmp_path / "gpu.md"
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"cuda.json": json.loads(out.read_text())}))
    gpu.main(["report", str(results), "--out", str(md)])
    assert "| mlp |" in md.read_text()


def test_moments_benchmark_reports_each_format_against_float32():
    """`benchmarks/moments.py`: the code task's three splits hold short ASCII lines; a
    two-step row per moment format trains from the shipped checkpoint, and the summary
    compares it with float32."""
    import argparse

    from benchmarks import moments

    lines = moments.code_lines()
    assert min(len(v) for v in lines.values()) > 1000
    assert all(8 <= len(x.strip()) and len(x) < 80 and x.isascii() for x in lines["test"])
    rows = [moments.row(argparse.Namespace(task="code", scheme="paper", moments=m, steps=2,
                                           seeds="0"))
            for m in ("float32", "int8")]
    f32, int8 = (r["runs"][0] for r in rows)
    assert f32["state_bytes"] > 3.5 * int8["state_bytes"]
    assert f32["trained_params"] == int8["trained_params"] > 0
    assert abs(int8["test_loss"] / f32["test_loss"] - 1) < 0.05
    table = moments.summary(rows)
    assert table[-1].startswith("| code | paper | int8 |") and "%" in table[-1]


def test_frozen_formats_benchmark_compares_each_format_with_bfloat16():
    """`benchmarks/frozen_formats.py`: a two-step row per frozen format trains the shipped
    checkpoint's paper scheme; int4 stores the frozen weights in about a quarter of
    bfloat16's bytes, the test losses stay close, and the summary pairs them by seed."""
    import argparse

    from benchmarks import frozen_formats

    rows = [frozen_formats.row(argparse.Namespace(task="code", scheme="paper", format=f,
                                                  steps=2, seeds="0"))
            for f in ("bfloat16", "int4")]
    bf16, int4 = (r["runs"][0] for r in rows)
    assert bf16["trained_params"] == int4["trained_params"] > 0
    assert 3.0 * int4["frozen_bytes"] < bf16["frozen_bytes"] < 4.5 * int4["frozen_bytes"]
    assert abs(int4["test_loss"] / bf16["test_loss"] - 1) < 0.05
    table = frozen_formats.summary(rows)
    assert table[-1].startswith("| code | paper | int4 |") and table[-1].count("%") == 2


def test_lowbit_load_benchmark_stores_the_same_bytes_either_way(tmp_path):
    """`benchmarks/lowbit_load.py` at the smoke shape: the folder it writes loads, and
    both rows (stored while read; read whole, then quantized) store the same bytes."""
    import argparse

    from benchmarks import lowbit_load

    folder = lowbit_load.write_folder("smoke", tmp_path / "smoke")
    results = {name: lowbit_load.row(argparse.Namespace(row=name, folder=str(folder),
                                                        frozen_dtype="int4", scheme="paper:2"))
               for name in lowbit_load.ROWS}
    first, second = results.values()
    assert first["digest"] == second["digest"]
    assert first["stored_bytes"] == second["stored_bytes"] > 0


def test_paper_table_rounds_take_the_median_of_the_rounds_medians():
    from benchmarks.paper_table import merge_rounds
    from benchmarks.paper_table_report import spread_ms, step_ms

    rounds = [{"times": [0.010, 0.030, 0.020], "losses": [2.0, 1.0], "rss_peak_mib": 100},
              {"times": [0.050, 0.040, 0.060], "losses": [2.0, 1.0], "rss_peak_mib": 120},
              {"times": [0.030, 0.030, 0.031], "losses": [2.0, 1.0], "rss_peak_mib": 110}]
    merged = merge_rounds(rounds)
    assert merged["round_ms"] == pytest.approx([20.0, 50.0, 30.0])
    assert step_ms(merged) == pytest.approx(30.0)
    assert spread_ms(merged) == pytest.approx((20.0, 50.0))
    assert merged["rss_peak_mib"] == 120 and merged["losses"] == [2.0, 1.0]
    single = merge_rounds(rounds[:1])
    assert step_ms(single) == pytest.approx(20.0) and spread_ms(single) == pytest.approx((10.0, 30.0))
    assert merge_rounds([rounds[0], {"error": "timed out"}]) == {"error": "timed out"}


def test_edge_speed_rows_start_alike_and_count_page_faults(tmp_path):
    """`edge_speed` at a tiny size: every row starts from the same weights and batch (the
    first losses agree across PyTorch and pockjax), each counts its page faults per step,
    and the page names the allocator its rows ran with."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "edge.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "edge_speed", "--size",
         "layers=2,hidden=32,intermediate=64,heads=2,vocab=64,seq=16,batch=2", "--rounds", "1",
         "--steps", "2", "--rows", "torch full,pockjax full,pockjax last:1", "--malloc",
         "system", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=900,
        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    rows = data["rows"]
    first = rows["torch full"]["losses"][0]
    for row in rows.values():
        assert row["losses"][0] == pytest.approx(first, rel=1e-5)
        assert row["faults_per_step"] >= 0 and len(row["medians"]) == 1
    assert rows["pockjax full"]["trained_params"] == rows["torch full"]["trained_params"]
    assert rows["pockjax last:1"]["trained_params"] < rows["pockjax full"]["trained_params"]
    assert data["meta"]["malloc"].startswith("`POCKJAX_MALLOC=system`")
    assert "GLIBC_TUNABLES" not in data["meta"]["malloc"] and len(data["meta"]["peaks_gflops"]) == 1
    assert "faults/step" in out.read_text()


def test_tf_peer_freezes_the_schemes_layers_and_reports_each_row():
    import argparse

    import pockjax.keras  # noqa: F401  (Keras on its JAX backend)
    import keras
    from benchmarks import tf_peer

    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                           classes=4, classifier_activation=None)
    frozen = tf_peer.frozen_layers(model)
    assert {"Conv1", "bn_Conv1", "block_1_depthwise", "block_1_project", "Conv_1"} <= set(frozen)
    assert not {"block_1_expand", "block_1_project_BN", "predictions"} & set(frozen)
    row = {"losses": [2.0, 1.5], "times": [0.2, 0.4, 0.3], "trainable": 10, "rss_peak_mib": 900}
    results = {name: [dict(row)] for name in tf_peer.ROWS}
    results["pockjax full"] = [dict(row, losses=[2.0, 1.5004], times=[0.1, 0.1, 0.1])]
    results["tensorflow full XLA"] = [{"error": "exit 1: no XLA"}]
    page = tf_peer.report(results, tf_peer.sizes(True), argparse.Namespace(
        quick=True, steps=3, warmup=1, rounds=1))
    assert "| pockjax full | 10 | 0.100 | 3.00x | 900 | 2.00000 | 1.50040 |" in page
    assert "| tensorflow full XLA | | exit 1: no XLA |" in page
    assert ("- tensorflow full, tensorflow full XLA, pockjax full, pockjax full, XLA's "
            "convolutions: 4.00e-04") in page
