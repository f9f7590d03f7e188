"""The ready-made schemes select exactly the parameters they promise, on the real models."""
import jax
import pytest
from flax import nnx

import pockjax as pj
from pockjax.models.llama import Llama, LlamaConfig
from pockjax.models.lora import apply_lora
from pockjax.models.mobilenetv2 import MobileNetV2, blocks_with_expansion


def abstract(build):
    return nnx.eval_shape(build)


@pytest.fixture(scope="module")
def llama():
    return abstract(lambda: Llama(LlamaConfig.tiny(num_layers=4), rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def mobilenet():
    return abstract(lambda: MobileNetV2(10, width_mult=0.35, input_size=32, rngs=nnx.Rngs(0)))


def selected(scheme, model) -> dict[str, pj.scheme.Decision]:
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    resolved = pj.scheme.leaves_with_paths(scheme.resolve(params))[0]
    return {p: d for p, d in resolved if not isinstance(d, pj.Frozen)}


def test_transformer_scheme_trains_attention_and_gate_up_not_down(llama):
    got = selected(pj.schemes.transformer(llama, last=2), llama)
    want = {f"layers/{i}/{m}/{p}/kernel" for i in (2, 3)
            for m, ps in (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                          ("mlp", ("gate_proj", "up_proj"))) for p in ps}
    assert set(got) == want and all(d == pj.Full() for d in got.values())

    everything = selected(pj.schemes.transformer(llama), llama)
    assert {p.split("/")[1] for p in everything} == {"0", "1", "2", "3"}
    assert not any("down_proj" in p or "norm" in p or "embed" in p for p in everything)

    got = selected(pj.schemes.transformer(llama, last=1, ratio=0.25, norms=True,
                                          extra=["lm_head/**"]), llama)
    assert got["layers/3/mlp/gate_proj/kernel"] == pj.Channels(count=43, axis=1)  # ceil(172 / 4)
    assert got["layers/3/attn_norm/scale"] == pj.Full() and got["lm_head/kernel"] == pj.Full()
    assert "layers/2/attn/q_proj/kernel" not in got and "norm/scale" not in got


def test_mobilenetv2_scheme_trains_the_first_pointwise_conv(mobilenet):
    expanding = blocks_with_expansion()
    got = selected(pj.schemes.mobilenetv2(mobilenet, last=3), mobilenet)
    want = {f"blocks/{i}/expand/conv/kernel" for i in expanding[-3:]}
    assert set(got) == want | {"classifier/kernel", "classifier/bias"}

    got = selected(pj.schemes.mobilenetv2(mobilenet, ratio=0.5, axis="in", norms=True,
                                          classifier=False), mobilenet)
    kernels = {p for p in got if p.endswith("conv/kernel")}
    assert kernels == {f"blocks/{i}/expand/conv/kernel" for i in expanding}
    assert all(got[k] == pj.Channels(count=got[k].count, axis=2) for k in kernels)
    assert "blocks/5/depthwise/bn/scale" in got and "blocks/0/depthwise/bn/scale" not in got
    assert not any("depthwise/conv" in p or "project/conv" in p or "classifier" in p for p in got)


def test_bias_only_and_last_blocks_on_any_model(llama, mobilenet):
    got = selected(pj.schemes.bias_only(mobilenet), mobilenet)
    assert set(got) == {p for p in pj.nnx.param_paths(mobilenet) if p.endswith("/bias")}
    assert "classifier/bias" in got and "stem/bn/bias" in got
    with pytest.raises(pj.SchemeError, match=r"no parameter matches bias names \['bias'\]"):
        pj.schemes.bias_only(llama)
    got = selected(pj.schemes.bias_only(llama, names=("scale",)), llama)
    assert set(got) == {p for p in pj.nnx.param_paths(llama) if p.endswith("/scale")}

    got = selected(pj.schemes.last_blocks(llama, 1, extra=["norm/**", "lm_head/**"]), llama)
    assert set(got) == {p for p in pj.nnx.param_paths(llama)
                        if p.startswith("layers/3/")} | {"norm/scale", "lm_head/kernel"}
    got = selected(pj.schemes.last_blocks(mobilenet, 2, extra=["classifier/**"]), mobilenet)
    n = len(mobilenet.blocks)
    assert {p.split("/")[1] for p in got if p.startswith("blocks/")} == {str(n - 2), str(n - 1)}
    assert pj.schemes.blocks(mobilenet) == [f"blocks/{i}" for i in range(n)]

    with pytest.raises(pj.SchemeError, match="last=9 but the model has 4 blocks"):
        pj.schemes.last_blocks(llama, 9)
    with pytest.raises(pj.SchemeError, match="no blocks named 'stages'"):
        pj.schemes.last_blocks(llama, 1, block_name="stages")
    with pytest.raises(pj.SchemeError, match="the parameter paths of pockjax.models.MobileNetV2"):
        pj.schemes.mobilenetv2(llama)


def test_lora_scheme_selects_the_adapters_only():
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    apply_lora(model, rank=2, targets=["q_proj", "v_proj"], rngs=nnx.Rngs(1))
    got = selected(pj.schemes.lora(), model)
    assert set(got) == {f"layers/{i}/attn/{p}/lora_{ab}" for i in range(2)
                        for p in ("q_proj", "v_proj") for ab in "ab"}
    assert set(got) == set(pj.nnx.param_paths(model, nnx.LoRAParam))
    assert jax.tree_util.tree_leaves(pj.nnx.scheme(model, nnx.LoRAParam).resolve(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)))) == jax.tree_util.tree_leaves(
        pj.schemes.lora().resolve(nnx.to_pure_dict(nnx.state(model, nnx.Param))))


def test_models_reach_the_helpers_through_a_registered_converter():
    """Without pockjax.nnx loaded a Flax module is refused with the fix; importing it
    registers the converter; any other model type can register its own."""
    import subprocess
    import sys

    code = ("import sys, pytest\n"
            "from flax import nnx\n"
            "import pockjax.schemes as schemes, pockjax.scheme_search as search\n"
            "assert 'pockjax.nnx' not in sys.modules\n"
            "model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))\n"
            "with pytest.raises(TypeError, match='import pockjax.nnx'):\n"
            "    schemes.bias_only(model)\n"
            "import pockjax.nnx\n"
            "assert schemes.bias_only(model).rules == (('**/bias', pockjax.Full()),)\n"
            "assert [c.name for c in search.find_candidates(model, ratios=())] == "
            "['kernel full', 'bias full']\n"
            "class Box:\n"
            "    def __init__(self, tree): self.tree = tree\n"
            "schemes.register_params_of(Box, lambda box: box.tree)\n"
            "assert schemes.blocks(Box({'h': [{'w': 0.0}] * 2})) == ['h/0', 'h/1']\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    # Through the top level, with Flax loaded, the converter comes with `pj.schemes`.
    code = ("from flax import nnx\n"
            "import pockjax as pj\n"
            "model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))\n"
            "assert pj.schemes.bias_only(model).rules == (('**/bias', pj.Full()),)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
