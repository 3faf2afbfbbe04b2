"""shared/quant/gguf_file.py against the gguf package's own GGUFReader on files its GGUFWriter wrote: the same
metadata values (arrays as their type and length), tensor names, shapes, types and bytes; and the files it
refuses, by what is wrong."""
import numpy as np
import pytest

from tandem.shared.quant.gguf_file import Array, GGUFFile

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def write_file(path, alignment: int | None = None) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.data_alignment = alignment
    writer.add_head_count(4)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_token_list([f"tok{i}" for i in range(300)] + ["ü", ""])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(302)])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((5, 32)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        weight = rng.standard_normal((6, 64)).astype(np.float32)
        writer.add_tensor(f"q.{qtype.name}", gguf.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_metadata_and_tensors_equal_gguf_readers(tmp_path, alignment):
    write_file(tmp_path / "m.gguf", alignment)
    mine, theirs = GGUFFile(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "m.gguf")
    expected = {}
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            expected[key] = ("array", field.types[1], len(field.data))
        elif kind == gguf.GGUFValueType.STRING:
            expected[key] = bytes(field.parts[-1]).decode()
        else:
            expected[key] = field.parts[-1][0].item()
    expected["test.nested"] = ("array", gguf.GGUFValueType.ARRAY, 2)  # (GGUFReader's data counts the inner values)
    got = {k: ("array", v.element_type, v.length) if isinstance(v, Array) else v for k, v in mine.fields.items()}
    assert got == expected
    assert got["general.name"] == "tiny ünïcode" and got["tokenizer.ggml.tokens"][2] == 302
    assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(mine.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
        assert not a.data.flags.writeable


def test_broken_files_are_refused_by_what_is_wrong(tmp_path):
    write_file(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    cases = {"cut.gguf": (data[:-40], r"tensor q\.Q8_0's data ends at byte \d+, past the file's end"),
             "header.gguf": (data[:200], "inside its header"),
             "magic.gguf": (b"GGML" + data[4:], "not a GGUF file"),
             "version.gguf": (data[:4] + (1).to_bytes(4, "little") + data[8:], "GGUF version 1"),
             "junk.gguf": (b"GGUF" + bytes(96), "GGUF version 0")}
    for name, (content, match) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=match):
            GGUFFile(tmp_path / name)
