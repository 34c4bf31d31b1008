"""pagedllm's GGUF header reader against the `gguf` package's GGUFReader: the same metadata
values (arrays of strings by length), the same tensor directory, and tensor data views equal
in shape, dtype and bytes; on a file written here with every metadata type, plain and block
tensor types and a custom alignment, and on the real SmolLM2 file."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.config import default_model_path
from pagedllm.model_executor.loader.gguf_header import GGUFHeader, StringArray

gguf = pytest.importorskip("gguf")


def assert_same_as_gguf_reader(path: str) -> None:
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(path)
    expected = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, field in expected.items():
        value = ours.fields[key]
        if isinstance(value, StringArray):
            assert len(value) == len(field.data) > 0, key
        elif isinstance(value, np.ndarray):
            assert value.tolist() == list(field.contents()), key
        else:
            assert value == field.contents(), key
            assert type(value) is type(field.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_every_metadata_type_and_tensor_layout(tmp_path):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 7)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ünïcode", "x" * 300])
    w.add_array("t.bools", [True, False, True])
    w.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain.f16", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("plain.i32", rng.integers(-9, 9, (7,), dtype=np.int32))
    for name in ("Q8_0", "Q4_0", "Q5_1"):
        qtype = gguf.GGMLQuantizationType[name]
        blocks = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), qtype)
        w.add_tensor(f"block.{name}", blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_as_gguf_reader(path)
    header = GGUFHeader(path)
    assert header.fields["t.strs"] == StringArray(4) and header.fields["t.str"] == "héllo ✓"
    q8 = next(t for t in header.tensors if t.name == "block.Q8_0")
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (2, 64)


def test_the_real_smollm2_file():
    try:
        path = default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    assert_same_as_gguf_reader(path)
    assert len(GGUFHeader(path).fields["tokenizer.ggml.tokens"]) == 49152


def test_not_gguf_and_big_endian_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFHeader(str(bad))
    swapped = tmp_path / "be.gguf"
    swapped.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFHeader(str(swapped))
