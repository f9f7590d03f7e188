"""Vulkan artifacts on this machine's Vulkan device (Mesa's lavapipe in CI).

These tests need a Vulkan driver: CI installs mesa-vulkan-drivers, and without one they
fail (the runtime raises), they are not skipped.
"""
import pytest

from pockjax import runtime
from pockjax.export import ExportError, vulkan
from tests.export.models import MODELS, make, run_vulkan_against_jax

STEPS = 3

LAVAPIPE = """name: llvmpipe (LLVM 15.0.6, 256 bits)
api: 1.3.230
features: bufferDeviceAddress=yes storageBuffer8BitAccess=yes storageBuffer16BitAccess=yes shaderInt8=yes shaderFloat16=yes shaderIntegerDotProduct=yes subgroupSizeControl=yes
subgroup: size=8 operations=0x000000bf quadOperationsInAllStages=no minSubgroupSize=8 maxSubgroupSize=8 requiredSubgroupSizeStages=0x00000030
"""


@pytest.fixture(scope="module", params=[(m, t) for t in ("host-vulkan", "android-vulkan")
                                        for m in MODELS], ids=lambda p: f"{p[1]}-{p[0]}")
def exported(request, tmp_path_factory):
    name, target = request.param
    trainer, params, batch = make(name)
    out = tmp_path_factory.mktemp(name) / target
    art = trainer.export(trainer.init(params), batch, target=target, out_dir=out)
    return trainer, params, batch, art


def test_vulkan_artifact_matches_the_jax_trainer(exported):
    trainer, params, batch, art = exported
    run_vulkan_against_jax(art.path, trainer, params, batch, STEPS)


def test_manifest_records_the_compiled_for_gpu(exported):
    *_, art = exported
    t = art.manifest["target"]
    target = vulkan.parse_target(t["gpu_target"])
    if t["name"] == "host-vulkan":
        caps = vulkan.device_caps()
        assert t["device"]["name"] == caps.name
        assert target.subgroup_size_choices == (caps.subgroup_size,)
        assert vulkan.problems(target, caps) == []
    else:
        assert t["gpu"] == "vp_android_baseline_2022" and target.arch == "vp_android_baseline_2022"
        assert not target.subgroup_ops


def test_an_artifact_for_another_subgroup_size_is_refused(tmp_path, capsys):
    caps = vulkan.device_caps()
    # valhall is compiled for subgroups of 16 and adreno for 64; lavapipe runs 8.
    gpu, size = next((g, s) for g, s in (("valhall", 16), ("adreno", 64))
                     if s not in caps.subgroup_sizes())
    trainer, params, batch = make("mlp")
    art = trainer.export(trainer.init(params), batch, target="android-vulkan", gpu=gpu,
                         out_dir=tmp_path / gpu)
    with pytest.raises(runtime.IncompatibleDevice) as e:
        runtime.load(art.path, device="vulkan")
    msg = str(e.value)
    assert f"compiled for [{size}], the device runs {caps.subgroup_size}" in msg
    assert caps.name in msg and "host-vulkan" in msg
    from pockjax.cli import main as cli
    assert cli(["run", art.path, "--device", "vulkan"]) == 2
    assert cli(["inspect", art.path]) == 0
    assert f"sizes [{size}]" in capsys.readouterr().out


def test_device_info_is_parsed_and_checked():
    caps = vulkan.caps_from_info(LAVAPIPE)
    assert (caps.subgroup_size, caps.subgroup_sizes(), caps.api) == (8, [8], (1, 3))
    assert caps.fp16 and caps.int8 and caps.storage8 and caps.dot_product
    valhall = vulkan.parse_target(
        '#iree_gpu.target<arch = "valhall1", features = "spirv:v1.6,cap:Shader", wgp = <'
        "compute = fp32|fp16|int32|int16|int8, storage = b64|b32|b16|b8, subgroup = "
        "shuffle|arithmetic, dot = dp4xi8toi32, subgroup_size_choices = [16], "
        "max_workgroup_sizes = [512, 512, 512]>>")
    assert vulkan.problems(valhall, caps) == [
        "subgroup size: compiled for [16], the device runs 8"]
    # A device without size control, fp16 or 8-bit storage.
    bare = LAVAPIPE.replace("shaderFloat16=yes", "shaderFloat16=no").replace(
        "storageBuffer8BitAccess=yes", "storageBuffer8BitAccess=no").replace(
        "subgroupSizeControl=yes", "subgroupSizeControl=no").replace("size=8", "size=16")
    problems = vulkan.problems(valhall, vulkan.caps_from_info(bare))
    assert problems == ["fp16 arithmetic: the device lacks shaderFloat16",
                        "b8 storage: the device lacks storageBuffer8BitAccess"]
    # The target built for a device fits it.
    local = vulkan.parse_target(vulkan.local_target_attr(caps))
    assert local.subgroup_size_choices == (8,) and vulkan.problems(local, caps) == []


def test_a_machine_without_vulkan_is_told_what_to_install(monkeypatch):
    import iree.runtime as ir

    def no_driver(name):
        raise ValueError(f"Could not create driver '{name}' (not registered)")

    monkeypatch.setattr(ir, "get_driver", no_driver)
    with pytest.raises(ExportError, match="no Vulkan driver here.*install mesa-vulkan-drivers"):
        vulkan.device_caps()


def masked_model():
    """Attention-like scores under a constant boolean mask (a numpy array in the trace)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import pockjax as pj

    mask = np.tril(np.ones((80, 80), bool))

    def loss(p, x):
        scores = jnp.where(mask, x @ p["w"], -1e9)
        return jnp.mean(jax.nn.softmax(scores, axis=-1) ** 2)

    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-2))
    return trainer, {"w": jax.random.normal(jax.random.key(0), (80, 80))}, \
        jax.random.normal(jax.random.key(1), (4, 80, 80))


def test_narrow_tensors_in_memory_are_refused_without_8bit_storage(tmp_path):
    """IREE emulates 8-bit storage on vp_android_baseline_2022 and gets a stored boolean
    mask wrong; export refuses it. host-vulkan (lavapipe has 8-bit storage) is right."""
    trainer, params, batch = masked_model()
    with pytest.raises(ExportError, match=r"keeps i8 arrays in memory.*no 8-bit storage "
                                          r"\(storage = b32\).*jnp.arange"):
        trainer.export(trainer.init(params), batch, target="android-vulkan",
                       out_dir=tmp_path / "baseline")
    assert not (tmp_path / "baseline").exists()
    art = trainer.export(trainer.init(params), batch, target="host-vulkan", out_dir=tmp_path / "host")
    run_vulkan_against_jax(art.path, trainer, params, batch, STEPS)


def test_narrow_batch_inputs_are_refused_without_8bit_storage(tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import pockjax as pj

    trainer = pj.sparse_train(lambda p, b: jnp.mean((b["x"] * p["w"]) ** 2 * b["flag"]),
                              optimizer=optax.sgd(0.1))
    params = {"w": jnp.ones(8)}
    batch = {"x": jax.random.normal(jax.random.key(0), (4, 8)), "flag": np.int8(1)}
    with pytest.raises(ExportError, match=r"int8 \('flag'\)"):
        trainer.export(trainer.init(params), batch, target="android-vulkan", out_dir=tmp_path / "a")


# What IREE 3.13 raised in CI when lavapipe had lost the device in a step.
LOST = ("Error invoking function: c/runtime/src/iree/hal/drivers/vulkan/queue.c:2867: "
        "DATA_LOSS; [vkSignalSemaphore] VK_ERROR_DEVICE_LOST; while invoking native function "
        "hal.fence.await; while calling variadic import;")
# The same loss as a later `make test` run saw it while loading: a fence that waited on
# the lost submission, and IREE's queue race uploading the parameters.
LOST_AT_FENCE = ("Error creating vm context with modules: DATA_LOSS; while invoking native "
                 "function hal.fence.await; while calling variadic import;")
LOST_UPLOAD = ("Error creating vm context with modules: c/runtime/src/iree/hal/drivers/vulkan/"
               "buffer.c:303: FAILED_PRECONDITION; transient buffer has no staged Vulkan "
               "backing; ensure the buffer was returned from queue_alloca before submitting "
               "dependent work; while invoking native function io_parameters.load; while "
               "calling import;")


def _raise(message):
    def call(*args, **kwargs):
        raise RuntimeError(message)
    return call


def test_a_lost_device_is_reported_and_replaced(tmp_path):
    trainer, params, batch = make("mlp")
    art = trainer.export(trainer.init(params), batch, target="host-vulkan", out_dir=tmp_path / "a")
    sess = runtime.load(art.path, device="vulkan")
    lost = sess.device

    # Another runtime error passes through as it is, and the device stays.
    sess._fn["train_step"] = _raise("Error invoking function: INVALID_ARGUMENT; shape")
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT") as e:
        sess.step(batch)
    assert type(e.value) is RuntimeError
    assert runtime.load(art.path, device="vulkan").device is lost
    # DATA_LOSS not from a fence (IREE also says it of a damaged file) and the upload race
    # outside loading are not losses either.
    for message in ("Error invoking function: DATA_LOSS; truncated", LOST_UPLOAD):
        sess._fn["train_step"] = _raise(message)
        with pytest.raises(RuntimeError) as e:
            sess.step(batch)
        assert type(e.value) is RuntimeError
    assert runtime.load(art.path, device="vulkan").device is lost

    # Each call that touches the device: the loss is named, and the device replaced.
    def step(s):
        s._fn["train_step"] = _raise(LOST)
        s.step(batch)

    def evaluate(s):
        s._fn["eval"] = _raise(LOST)
        s.evaluate(batch)

    def params_(s):
        s._host = _raise(LOST)
        s.params()

    for call, what in [(step, "a training step"), (evaluate, "an evaluation"),
                       (params_, "reading the state")]:
        sess = runtime.load(art.path, device="vulkan")
        with pytest.raises(runtime.DeviceLost, match=rf"'vulkan' device was lost during {what} "
                                                     r"of artifact '.*/a' \(.*VK_ERROR_DEVICE_"
                                                     r"LOST.*import\)\. .*Load the artifact again"):
            call(sess)
        assert runtime.load(art.path, device="vulkan").device is not sess.device
    again = runtime.load(art.path, device="vulkan")
    assert runtime.load(art.path, device="vulkan").device is again.device
    run_vulkan_against_jax(art.path, trainer, params, batch, STEPS)


@pytest.mark.parametrize("where,message,shown", [
    ("context", LOST, "VK_ERROR_DEVICE_LOST"), ("state", LOST, "VK_ERROR_DEVICE_LOST"),
    ("context", LOST_AT_FENCE, "DATA_LOSS"), ("context", LOST_UPLOAD, "transient buffer")])
def test_a_load_that_loses_the_device_is_repeated_once(tmp_path, monkeypatch, where, message,
                                                       shown):
    """A loss while IREE loads the module (its initialisers run) or while the state is
    uploaded: the load is repeated once on a new device; a second loss is raised."""
    import iree.runtime as ir

    trainer, params, batch = make("mlp")
    art = trainer.export(trainer.init(params), batch, target="host-vulkan", out_dir=tmp_path / "a")
    losses = []
    if where == "context":
        real, name, owner = ir.VmContext, "VmContext", ir
    else:
        real, name, owner = runtime.Session._initial_state, "_initial_state", runtime.Session

    def flaky(*args, **kwargs):
        if len(losses) < limit:
            losses.append(runtime._devices.get("vulkan"))
            raise RuntimeError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)
    limit = 1
    with pytest.warns(RuntimeWarning, match=r"'vulkan' device was lost while loading '.*/a' "
                                             rf"\(.*{shown}.*import\); loading it "
                                             r"again on a new device"):
        sess = runtime.load(art.path, device="vulkan")
    assert losses[0] is not None and sess.device is not losses[0]
    assert sess.step_count == 0
    limit, losses[:] = 2, []
    with pytest.warns(RuntimeWarning), pytest.raises(runtime.DeviceLost, match="during loading"):
        runtime.load(art.path, device="vulkan")
    assert losses[0] is not losses[1]


def test_the_first_call_on_a_cpu_vulkan_device_says_it_compiles(tmp_path):
    caps = vulkan.device_caps()
    assert caps.on_cpu == (caps.device_type == "cpu")
    assert vulkan.caps_from_info(LAVAPIPE.replace("api:", "type: cpu\napi:")).on_cpu
    assert not vulkan.caps_from_info(LAVAPIPE.replace("api:", "type: discrete-gpu\napi:")).on_cpu
    trainer, params, batch = make("mlp")
    art = trainer.export(trainer.init(params), batch, target="android-vulkan", out_dir=tmp_path / "a")
    import warnings
    for attempt in range(3):  # lavapipe loses its device at random; not what is tested here
        try:
            sess = runtime.load(art.path, device="vulkan")
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                sess.step(batch)
                sess.step(batch)
                sess.evaluate(batch)
                sess.evaluate(batch)
            break
        except runtime.DeviceLost:
            if attempt == 2:
                raise
    said = [str(w.message) for w in seen if w.category is runtime.CompilingPipelines]
    if not caps.on_cpu:
        assert said == []
        return
    assert len(said) == 2, said
    assert said[0].startswith(f"the first training step of '{art.path}' compiles its pipelines: "
                              f"Vulkan device '{caps.name}' runs on the CPU")
    assert "later calls reuse them. For speed on this machine export for host-cpu" in said[0]
    assert said[1].startswith(f"the first evaluation of '{art.path}' compiles its pipelines")


@pytest.mark.parametrize("target,formats", [
    ("host-vulkan", "int"), ("android-vulkan", "int"), ("android-vulkan", "bfloat16")])
def test_low_bit_frozen_weights_train_on_vulkan_as_in_jax(tmp_path, target, formats):
    """Frozen weights in int8 and int4 (bfloat16 scales, one with zero points), or in
    bfloat16, one weight with float32 trained channels: the artifact stores them as
    32-bit words with float32 scales (`lowbit.in_words`; the Android baseline profile
    has only 32-bit storage, and IREE's SPIR-V code loads no bfloat16) and trains as the
    JAX trainer does on the same state."""
    import jax
    import numpy as np

    import pockjax as pj
    from pockjax import lowbit
    from tests.export.models import assert_metrics_match
    from tests.lowbit.test_lowbit import exportable_trainer

    if formats == "int":
        chosen = {"l0/**": lowbit.Int4(group=32, zero_point=True), "l1/**": "int4", "**": "int8"}
    else:  # bfloat16 as two values a word, one layer with float32 trained channels
        chosen = {"**": "bfloat16"}
    trainer, params, batch = exportable_trainer(
        chosen, {"l1/kernel": pj.Channels(count=16, last=True)})  # a float32 master
    art = trainer.export(trainer.init(params), batch, target=target, out_dir=tmp_path / "a")
    stored = {p["name"]: p["dtype"] for p in art.manifest["parameters"]}
    assert stored["params/l0/kernel/@data"] == "int32", stored
    if formats == "int":
        assert stored["params/l1/kernel/@scale"] == "float32", stored
    state = lowbit.in_words(trainer.init(params))
    for attempt in range(3):  # lavapipe's random device loss: see run_vulkan_against_jax
        try:
            sess = runtime.load(art.path, device="vulkan")
            for _ in range(STEPS):
                got = sess.step(batch)
                state, want = jax.block_until_ready(trainer(state, batch))
                assert_metrics_match(got, want)
            break
        except runtime.DeviceLost:
            if attempt == 2:
                raise
            state = lowbit.in_words(trainer.init(params))
    got = dict(pj.scheme.leaves_with_paths(sess.params())[0])
    want = dict(pj.scheme.leaves_with_paths(jax.device_get(state.params))[0])
    assert sorted(got) == sorted(want) and {"l0/kernel/@data", "l1/kernel/@master"} <= set(got)
    for path, value in want.items():  # the frozen words as stored, the trained weights
        np.testing.assert_allclose(got[path], value, rtol=1e-4, atol=1e-6, err_msg=path)
