"""inference/gguf_file.py against the gguf library's reader: the same fields (values and
types) and the same tensors, on the default model's file and on one holding every value
type; bad files get clear errors."""

import gguf
import numpy as np
import pytest

from inference.errors import ModelError
from inference.model.gguf_file import GGUFFormatError, read_gguf
from inference.model.model_import import DEFAULT_GGUF_MEMBER, import_gguf, models_dir


def _same_as_the_library(path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        want = field.contents()
        assert ours.fields[key] == want and type(ours.fields[key]) is type(want), key
        if isinstance(want, list) and want:
            assert type(ours.fields[key][0]) is type(want[0]), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == int(b.tensor_type) and a.shape == tuple(map(int, b.shape))
        assert a.data.dtype == np.uint8 and bytes(a.data) == np.asarray(b.data).tobytes(), a.name


def test_the_default_models_file_reads_as_the_library_reads_it(default_model_dir):
    path = models_dir() / "gguf" / DEFAULT_GGUF_MEMBER.split("/")[-1]
    _same_as_the_library(path)
    g = read_gguf(path)
    assert g.get("general.architecture") == "llama" and g.get("no.such.key", 7) == 7
    assert len(g.get("tokenizer.ggml.tokens")) == 49152


@pytest.mark.parametrize(
    "pad, alignment",
    # the header ending anywhere modulo the default alignment (32), and an alignment of 64
    [(0, None), (8, None), (16, None), (24, None), (0, 64)],
)
def test_every_value_type_reads_as_the_library_reads_it(tmp_path, pad, alignment):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_string("t.pad", "x" * pad)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcode <|im_end|>")
    w.add_array("t.strs", ["a", "", "ßß"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.empty", [])
    w.add_tensor("a.weight", np.arange(96, dtype=np.float32).reshape(3, 32))
    w.add_tensor("b.weight", np.ones((2, 16), dtype=np.float16))
    q = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), 8)
    w.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_the_library(path)
    g = read_gguf(path)
    assert g.get("t.u64") == 2**63 + 5 and g.get("t.strs") == ["a", "", "ßß"]
    c = g.tensors[2]
    assert c.shape == (64, 2) and c.data.size == 2 * 2 * 34  # two Q8_0 blocks a row


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_clear_error(tmp_path, default_model_dir):
    src = models_dir() / "gguf" / DEFAULT_GGUF_MEMBER.split("/")[-1]
    head = src.read_bytes()[:4096]
    cases = {
        "foreign.gguf": (b"PK\x03\x04" + head[4:], "no GGUF magic"),
        "short.gguf": (head, "runs past the file|ends early"),
        "v9.gguf": (head[:4] + (9).to_bytes(4, "little") + head[8:], "version 9"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(GGUFFormatError, match=message):
            read_gguf(path)
        # the importer says which file and why, and leaves nothing behind
        out = tmp_path / "model" / name
        with pytest.raises(ModelError, match=f"{name} is not a readable GGUF file"):
            import_gguf(path, out)
        assert not out.exists() and not out.with_name(out.name + ".importing").exists()
