"""save/load: round trip, metadata, atomic writes, and clear failures."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax.checkpoint import read_metadata
from tests.helpers import assert_trees_close

SCHEME = pj.Scheme({"a": pj.Channels(ratio=0.5, axis="out"), "c": pj.Frozen()}, default=pj.Full())


def _loss(p, batch):
    return jnp.sum((batch @ p["a"]) ** 2) + jnp.sum(p["b"].astype(jnp.float32) ** 2) + jnp.sum(p["c"])


@pytest.fixture
def state():
    params = {"a": jnp.arange(12.0).reshape(3, 4) / 10, "b": jnp.ones(2, jnp.bfloat16),
              "c": jnp.zeros(5)}
    trainer = pj.sparse_train(_loss, optimizer=optax.adam(1e-2), scheme=SCHEME)
    state = trainer.init(params)
    state, _ = trainer(state, jnp.ones((2, 3)))
    return state


def test_round_trip_keeps_values_dtypes_step_and_scheme(state, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    pj.save(path, state, metadata={"note": "hello"})
    meta = read_metadata(path)
    assert meta["step"] == "1" and meta["note"] == "hello"
    assert pj.Scheme.from_json(meta["scheme"]) == SCHEME
    loaded = pj.load(path, like=state)
    assert isinstance(loaded, pj.TrainState) and loaded.scheme == SCHEME
    assert loaded.params["b"].dtype == jnp.bfloat16
    assert_trees_close(loaded, state, rtol=0, atol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]  # no temp file left


def test_mismatched_paths_and_shapes_are_listed(state, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    pj.save(path, state)
    other = state.replace(params={**state.params, "a": jnp.zeros((3, 6)), "d": jnp.zeros(1)})
    with pytest.raises(pj.CheckpointError) as e:
        pj.load(path, like=other)
    msg = str(e.value)
    assert "'params/a': file has float32[3, 4], state has float32[3, 6]" in msg
    assert "missing in file: 'params/d'" in msg


def test_a_different_scheme_is_refused(state, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    pj.save(path, state)
    with pytest.raises(pj.CheckpointError, match="scheme differs"):
        pj.load(path, like=state.replace(scheme=pj.Scheme(default=pj.Full())))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_files_fail_clearly(state, tmp_path, damage):
    path = tmp_path / "ckpt.safetensors"
    pj.save(path, state)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) - 20], "garbage": b"\x00" * 64 + data[64:],
                      "empty": b""}[damage])
    with pytest.raises(pj.CheckpointError, match="ckpt.safetensors"):
        pj.load(path, like=state)


def test_missing_file_and_foreign_file(state, tmp_path):
    with pytest.raises(pj.CheckpointError, match="does not exist"):
        pj.load(tmp_path / "nope.safetensors", like=state)
    from safetensors.numpy import save_file
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(pj.CheckpointError, match="not a pockjax checkpoint"):
        pj.load(tmp_path / "foreign.safetensors", like=state)


def test_a_failed_write_keeps_the_old_checkpoint(state, tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    pj.save(path, state)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        pj.save(path, state.replace(step=state.step + 1))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]


def test_resumed_training_continues_identically(state, tmp_path):
    trainer = pj.sparse_train(_loss, optimizer=optax.adam(1e-2), scheme=SCHEME)
    path = tmp_path / "ckpt.safetensors"
    pj.save(path, state)
    resumed = pj.load(path, like=state)
    a, _ = trainer(jax.tree_util.tree_map(jnp.copy, state), jnp.ones((2, 3)))
    b, _ = trainer(resumed, jnp.ones((2, 3)))
    assert_trees_close(a, b, rtol=0, atol=0)


def test_reserved_metadata_and_other_versions(state, tmp_path):
    with pytest.raises(pj.CheckpointError, match="'step' is reserved"):
        pj.save(tmp_path / "a.safetensors", state, metadata={"step": "9"})
    from safetensors.numpy import save_file
    save_file({"step": np.zeros((), np.int32)}, str(tmp_path / "v9.safetensors"),
              metadata={"format": "pockjax.checkpoint", "version": "9"})
    with pytest.raises(pj.CheckpointError, match="version '9'; this pockjax reads versions 1, 2"):
        pj.load(tmp_path / "v9.safetensors", like=state)


def _data_offsets(path):
    """Where each tensor's bytes lie in a safetensors file: name -> (start, end)."""
    import json
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("where", ["step", "params/a", "opt_state/0/mu/a"])
@pytest.mark.parametrize("damage", ["zeros", "one bit"])
def test_damaged_data_bytes_fail_on_load(state, tmp_path, where, damage):
    # Damage that leaves the header intact: the tensors still parse, only their bytes
    # changed (zeroed bytes had come back as step 0 without a checksum).
    path = tmp_path / "ckpt.safetensors"
    pj.save(path, state)
    start, end = _data_offsets(path)[next(k for k in _data_offsets(path) if k.startswith(where))]
    raw = bytearray(path.read_bytes())
    if damage == "zeros":
        raw[start:end] = bytes(end - start)
    else:
        raw[start] ^= 0x01
    assert bytes(raw) != path.read_bytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(pj.CheckpointError, match="ckpt.safetensors' is damaged"):
        pj.load(path, like=state)


def test_version_1_files_without_checksum_still_load(state, tmp_path):
    from safetensors.numpy import save as st_save

    from pockjax.checkpoint import _named
    path = tmp_path / "v1.safetensors"
    named, _ = _named(state)
    path.write_bytes(st_save({k: np.asarray(v) for k, v in named.items()},
                             metadata={"format": "pockjax.checkpoint", "version": "1",
                                       "step": "1", "scheme": SCHEME.to_json()}))
    assert_trees_close(pj.load(path, like=state), state, rtol=0, atol=0)


def test_write_safetensors_streams_tensors_that_safetensors_reads_back(tmp_path):
    """`write_safetensors`: the safetensors library reads back every tensor (scalars,
    bfloat16, empty, int8) and the metadata; each getter is called once, in the order
    given; a getter that returns another shape fails and leaves no file behind."""
    import ml_dtypes
    from safetensors import safe_open

    from pockjax.checkpoint import write_safetensors

    arrays = {"scalar": np.asarray(np.float32(3.5)),
              "bf16": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
              "empty": np.zeros((0, 4), np.float32),
              "codes": np.array([[-128, 127], [0, 5]], np.int8),
              "big": np.linspace(-1, 1, 1001, dtype=np.float32)}
    calls = []

    def getter(name):
        def get():
            calls.append(name)
            return arrays[name]
        return get

    path = tmp_path / "t.safetensors"
    write_safetensors(path, [(n, a.shape, a.dtype, getter(n)) for n, a in arrays.items()],
                      {"format": "pt", "note": "x"})
    assert calls == list(arrays)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
        assert sorted(f.keys()) == sorted(arrays)
        for name, a in arrays.items():
            got = f.get_tensor(name)
            assert got.shape == a.shape and got.dtype == a.dtype, name
            np.testing.assert_array_equal(got, a)
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(ValueError, match="'codes': declared int8\\[3, 2\\], got int8\\[2, 2\\]"):
        write_safetensors(bad, [("codes", (3, 2), np.int8, lambda: arrays["codes"])])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]
