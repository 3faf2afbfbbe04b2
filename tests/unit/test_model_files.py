import torch
from safetensors.torch import save_file

from tandem.shared.model_files import fingerprint


def make_checkpoint(path, value: float):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.full((4, 4), value)}, str(path / "model.safetensors"))
    return path


def test_fingerprint_follows_weight_values_not_just_headers(tmp_path):
    a = fingerprint(make_checkpoint(tmp_path / "a", 1.0))
    same = fingerprint(make_checkpoint(tmp_path / "same", 1.0))
    other = fingerprint(make_checkpoint(tmp_path / "other", 2.0))  # identical header, other bytes
    assert a == same and a != other


def test_fingerprint_of_a_single_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    g = tmp_path / "n.gguf"
    g.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert fingerprint(f) != fingerprint(g)
