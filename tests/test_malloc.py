"""Each CPU training step's scratch memory reused from the last step
(`pockjax/_src/malloc.py`): JAX's dispatch turned off at `import pockjax` where it is
still ours to choose, glibc's heap keeping large blocks from the first step on, the
user's opt-out, and the one warning where a step still runs on JAX's threads. Every case
runs in a fresh process: the settings belong to the process."""
import json
import os
import statistics
import subprocess
import sys

import pytest

from pockjax._src import malloc

ON_GLIBC = malloc._glibc()


def _run(code: str, **env) -> dict:
    """Run `code` in a fresh Python; it prints one JSON line last."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("POCKJAX_MALLOC", "GLIBC_TUNABLES")}
    environ.update(env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


_DISPATCH = """
import json{first}
import pockjax
import jax{after}
print(json.dumps({{"async": bool(jax.config.read("jax_cpu_enable_async_dispatch"))}}))
"""


@pytest.mark.skipif(not ON_GLIBC, reason="the settings exist on Linux's glibc only")
@pytest.mark.parametrize("first, after, env, expected", [
    ("", "", {}, False),  # pockjax before JAX: set as JAX loads
    ("\nimport jax", "", {}, False),  # JAX loaded, its backends not started: jax.config
    ("\nimport jax; jax.numpy.ones(2)", "", {}, True),  # the backends run: left alone
    ("", "", {"POCKJAX_MALLOC": "system"}, True),  # the user's opt-out
    ("", "; jax.config.update('jax_cpu_enable_async_dispatch', True)", {}, True),  # or own
])
def test_dispatch_is_turned_off_only_where_it_is_ours_to_choose(first, after, env, expected):
    assert _run(_DISPATCH.format(first=first, after=after), **env)["async"] is expected


def test_the_choice_and_its_error():
    assert malloc.choice({}) == malloc.choice({"POCKJAX_MALLOC": " Reuse "}) == "reuse"
    assert malloc.choice({"POCKJAX_MALLOC": " System "}) == "system"
    with pytest.raises(ValueError, match="POCKJAX_MALLOC='sytem': set it to 'system'"):
        malloc.choice({"POCKJAX_MALLOC": "sytem"})
    # The error comes with the first step (and the command's start), not with the import.
    assert malloc.prepare_dispatch({"POCKJAX_MALLOC": "sytem"}) is None


# A step whose scratch memory (~100 MiB in one block) is far above glibc's mmap
# threshold: its minor page faults per step say whether the memory was reused.
_STEPS = """
import json, resource{first}
import pockjax as pj
import jax, jax.numpy as jnp, numpy as np, optax

def loss(p, b):
    h = b["x"]
    for w in p["w"]:
        h = jnp.tanh(h @ w)
    return jnp.mean(h ** 2)

rng = np.random.default_rng(0)
params = {{"w": [jnp.asarray(rng.standard_normal((512, 512), np.float32) / 23) for _ in range(6)]}}
batch = {{"x": jnp.asarray(rng.standard_normal((4096, 512), np.float32))}}
trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-3), scheme=pj.Scheme(default=pj.Full()))
state = trainer.init(params)
faults, losses = [], []
for i in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    state, m = trainer(state, batch)
    losses.append(float(m["loss"]))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"faults": faults, "losses": losses,
                  "w0": np.asarray(state.params["w"][0]).tobytes().hex()[:4000]}}))
"""


@pytest.mark.skipif(not ON_GLIBC, reason="the settings exist on Linux's glibc only")
def test_steps_reuse_their_memory_with_the_same_results():
    reused = _run(_STEPS.format(first=""))
    system = _run(_STEPS.format(first=""), POCKJAX_MALLOC="system")
    # The scratch block is ~25,000 pages: faulted in on every step with glibc's own
    # settings, on the first step with pockjax's (medians of the steps after it: the
    # kernel may reclaim idle pages now and then).
    assert statistics.median(system["faults"][1:]) > 10_000, system["faults"]
    assert statistics.median(reused["faults"][1:]) < 1_000, reused["faults"]
    assert reused["losses"] == system["losses"] and reused["w0"] == system["w0"]
    assert "RuntimeWarning" not in reused["stderr"] + system["stderr"]


@pytest.mark.skipif(not ON_GLIBC, reason="the settings exist on Linux's glibc only")
def test_a_step_on_jaxs_threads_says_so_once_with_the_way_out():
    late = _run(_STEPS.format(first="\nimport jax; jax.numpy.ones(2)"))
    assert late["stderr"].count("RuntimeWarning") == 1, late["stderr"]
    assert "JAX's CPU backend started before pockjax was imported (or " in late["stderr"]
    assert "Import pockjax before running anything with JAX" in late["stderr"]
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in late["stderr"]
    # With the tunable the user already has the way out: nothing to say.
    tuned = _run(_STEPS.format(first="\nimport jax; jax.numpy.ones(2)"),
                 GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    assert "RuntimeWarning" not in tuned["stderr"]
    assert tuned["losses"] == late["losses"]


@pytest.mark.skipif(not ON_GLIBC, reason="the settings exist on Linux's glibc only")
def test_a_step_over_several_devices_names_its_own_way_out():
    code = ("import json, warnings\nimport pockjax\nfrom pockjax._src import malloc\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    said = [malloc.reuse_step_memory(4), malloc.reuse_step_memory(4),\n"
            "            malloc.reuse_step_memory(1)]\n"
            "print(json.dumps({'said': said, 'w': [str(x.message) for x in w]}))")
    out = _run(code)
    # Said once; a later single-device step still gets its memory reused.
    assert out["said"] == ["warned", None, "reuse"] and len(out["w"]) == 1
    assert out["w"][0].startswith("pockjax: the step runs on 4 devices, which JAX runs on "
                                  "its own threads")
    assert "Start Python with GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in out["w"][0]
    assert "Import pockjax" not in out["w"][0]


def test_a_mistyped_choice_stops_the_first_step_and_the_command():
    env = {**os.environ, "POCKJAX_MALLOC": "sytem"}
    proc = subprocess.run([sys.executable, "-c", _STEPS.format(first="")], capture_output=True,
                          text=True, timeout=300, check=False, env=env)
    assert proc.returncode == 1
    assert "ValueError: POCKJAX_MALLOC='sytem': set it to 'system'" in proc.stderr
    proc = subprocess.run([sys.executable, "-c", "from pockjax.cli import main; main()", "targets"],
                          capture_output=True,
                          text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "pockjax: POCKJAX_MALLOC='sytem': set it to 'system' to keep JAX's and glibc's own "
        "memory settings, or 'reuse' (the same as leaving it unset) to reuse each training "
        "step's memory")


def test_thp_mode_is_read_from_the_kernels_line(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert malloc.thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert malloc.thp_mode(str(path)) == "always"
    assert malloc.thp_mode(str(tmp_path / "missing")) is None
