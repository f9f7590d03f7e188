"""A runtime session keeps one copy of the parameters: the frozen weights stay mapped from
`params.irpa`, the trained state lives in the device buffers `init()` returns, and the
archive is never written (a second session starts from the original values)."""
import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax import runtime
from pockjax.export.manifest import PARAMS, VMFB

STEPS = 3
WIDTH = 512  # 1 MiB per matrix: many pages, so resident-page counts mean something
LAYERS = 4
NAMES = [f"l{i}" for i in range(LAYERS)]


def _model():
    k = jax.random.PRNGKey(0)
    params = {f"l{i}": {"w": jax.random.normal(jax.random.fold_in(k, i), (WIDTH, WIDTH)) * 0.05,
                        "b": jnp.zeros(WIDTH)} for i in range(LAYERS)}

    def loss(p, batch):
        h = batch["x"]
        for i in range(LAYERS):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - batch["y"]) ** 2)

    # l0 frozen (mapped from the archive); the others trained with momentum (2 copies
    # each). SGD, not Adam, so rounding differences stay small enough to compare.
    scheme = pj.Scheme({"l0/**": pj.Frozen()}, default=pj.Full())
    trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1, momentum=0.9), scheme=scheme)
    batch = {"x": np.asarray(jax.random.normal(jax.random.fold_in(k, 10), (8, WIDTH))),
             "y": np.asarray(jax.random.normal(jax.random.fold_in(k, 11), (8, WIDTH))) * 0.5}
    return trainer, params, batch


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    trainer, params, batch = _model()
    out = tmp_path_factory.mktemp("memory") / "artifact"
    art = pj.export(trainer, trainer.init(params), batch, target="host-cpu", out_dir=out)
    return trainer, params, batch, art


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_steps_leave_the_archive_unchanged(exported):
    trainer, params, batch, art = exported
    archive = os.path.join(art.path, PARAMS)
    before = _sha256(archive)
    assert before == art.manifest["files"][PARAMS]["sha256"]
    sess = runtime.load(art.path)
    first = [float(sess.step(batch)["loss"]) for _ in range(STEPS)]
    assert first[-1] < first[0]  # it trained: the state buffers were written
    assert _sha256(archive) == before

    # A second session from the same directory starts from the original values (while
    # the first one is still alive and holds its trained state).
    again = runtime.load(art.path)
    assert again.step_count == 0 and sess.step_count == STEPS
    got = again.params()
    for name in NAMES:
        np.testing.assert_array_equal(got[name]["w"], np.asarray(params[name]["w"]))
        np.testing.assert_array_equal(got[name]["b"], np.asarray(params[name]["b"]))
    assert [float(again.step(batch)["loss"]) for _ in range(STEPS)] == first
    assert _sha256(archive) == before


def test_session_continues_the_jax_trainer(exported):
    """The state buffers `init()` returns train exactly as the JAX trainer does, and the
    frozen weights read back from the mapped archive are the original ones."""
    trainer, params, batch, art = exported
    sess = runtime.load(art.path)
    state = trainer.init(params)
    for _ in range(STEPS):
        got = sess.step(batch)
        state, want = trainer(state, batch)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    got = sess.params()
    for name in NAMES:
        np.testing.assert_allclose(got[name]["w"], np.asarray(state.params[name]["w"]),
                                   rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(got["l0"]["w"], np.asarray(params["l0"]["w"]))
    got["l0"]["w"][0, 0] = 1.0  # a copy the caller owns, not the mapped archive
    np.testing.assert_array_equal(sess.params()["l0"]["w"], np.asarray(params["l0"]["w"]))


def _mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                inside = len(fields) >= 6 and os.path.realpath(fields[-1]) == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_initial_state_pages_are_released(exported):
    """Loading reads the initial state out of the mapped archive into device buffers and
    then hands those pages back: what stays resident of the mapping is at most the frozen
    weights (plus pages shared with them at entry boundaries), not the trained state and
    its optimizer moments."""
    trainer, params, batch, art = exported
    archive = os.path.realpath(os.path.join(art.path, PARAMS))
    sess = runtime.load(art.path)
    frozen = sum(np.asarray(params["l0"][n]).nbytes for n in ("w", "b")) // 1024
    mutable = os.path.getsize(archive) // 1024 - frozen
    entries = len(art.manifest["parameters"])
    page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
    # Reading a page of a file mapping also maps neighbours already in the page cache
    # (the kernel's fault-around, 64 KiB by default, more with large folios), so pages
    # around the frozen weights may count too: allow as much again as the frozen bytes.
    # If the trained state were still resident the count would exceed the bound by most
    # of `mutable`.
    bound = 2 * frozen + 2 * entries * page_kib
    if mutable <= 2 * bound:  # large pages: the check below would mean little
        pytest.skip(f"pages of {page_kib} KiB leave no room between the bound ({bound} KiB) "
                    f"and the trained state ({mutable} KiB); this test needs 4 KiB pages")
    assert _mapped_kib(archive) <= bound
    sess.step(batch)  # the step reads the frozen weights from the mapping
    assert _mapped_kib(archive) <= bound


def test_unreadable_archive_names_the_file_and_the_fix(exported, tmp_path):
    """An archive IREE cannot parse (here one whose manifest hash was updated to match,
    so the hash check lets it through) is an ExportError naming the file."""
    import json

    trainer, params, batch, art = exported
    broken = tmp_path / "broken"
    os.makedirs(broken)
    for name in os.listdir(art.path):
        (broken / name).write_bytes(open(os.path.join(art.path, name), "rb").read())
    (broken / PARAMS).write_bytes(b"not a parameter archive" * 10)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"][PARAMS] = {"sha256": _sha256(broken / PARAMS),
                                 "bytes": os.path.getsize(broken / PARAMS)}
    (broken / "manifest.json").write_text(json.dumps(manifest))
    message = r"parameter archive '.*broken/params\.irpa'.*export the artifact again"
    with pytest.raises(pj.export.ExportError, match=message):
        runtime.load(str(broken))


def test_a_damaged_archive_is_reported_as_damaged(exported, tmp_path):
    """The hashes are checked while IREE loads; when the damage also makes IREE fail, the
    error still names the damaged file and the hash, not IREE's parse error."""
    trainer, params, batch, art = exported
    broken = tmp_path / "damaged"
    os.makedirs(broken)
    for name in os.listdir(art.path):
        (broken / name).write_bytes(open(os.path.join(art.path, name), "rb").read())
    size = os.path.getsize(broken / PARAMS)
    (broken / PARAMS).write_bytes((b"not a parameter archive" * (size // 23 + 1))[:size])
    message = r"damaged/params\.irpa' does not match the manifest's hash"
    with pytest.raises(pj.export.ExportError, match=message):
        runtime.load(str(broken))


@pytest.mark.parametrize("name", [PARAMS, VMFB])
def test_damaged_files_are_refused_by_both_sessions(exported, tmp_path, name):
    """A changed byte in the archive or the compiled module: `runtime.load` (the module
    hashed before IREE loads it) and `ToolSession` (hashed before anything runs) both
    refuse the artifact, naming the file."""
    trainer, params, batch, art = exported
    broken = tmp_path / "changed"
    os.makedirs(broken)
    for entry in os.listdir(art.path):
        (broken / entry).write_bytes(open(os.path.join(art.path, entry), "rb").read())
    with open(broken / name, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    message = rf"changed/{name.replace('.', '[.]')}' does not match the manifest's hash"
    with pytest.raises(pj.export.ExportError, match=message):
        runtime.load(str(broken))
    with pytest.raises(pj.export.ExportError, match=message):
        runtime.ToolSession(str(broken), ["/no/such/tool"])
