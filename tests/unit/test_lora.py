"""LoRA pieces one at a time (docs/lora.md): reading a PEFT adapter into the fused layout (stacked A, block-diagonal B,
scaling folded in) and refusing what is not served by name; the manager's slots (LRU), memory (re-reads from disk,
a changed file refused) and unloading with requests in flight; the segments a forward gets; the wrapper over float
and quantized linears; the scheduler's adapters per step (FCFS, no starvation); block hashes per adapter; the flags.
Adapters are written in the test by PEFT on a tiny checkpoint (tests/tiny_adapters.py)."""
from __future__ import annotations

import argparse
import json
import math
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tandem.services.flags import add_engine_service_args, apply_env, engine_argv
from tandem.shared.block_hash import HashContract, hash_request_blocks
from tandem.shared.config import LoRAConfig, ModelConfig
from tandem.shared.engine_args import EngineArgs
from tandem.shared.errors import InvalidRequestError, UnknownLoRAError
from tandem.shared.lora.layers import LoRALinear, LoRAMetadata
from tandem.shared.lora.manager import LoRAManager
from tandem.shared.lora.peft import read_lora_adapter
from tandem.shared.lora.request import LoRARequest
from tandem.shared.lora.targets import lora_targets
from tandem.shared.quant.layers import WeightOnlyInt8Linear
from tests.tiny_adapters import save_adapter, save_adapters
from tests.tiny_models import save_tiny
from tests.unit.factories import make_request, make_scheduler

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, its ModelConfig, {name: adapter dir} of tests/tiny_adapters.py, and "qvg": q, v, gate of
    rank 4 with a rank pattern (gate: 2) and an alpha pattern (layer 1's q: 3))."""
    root = tmp_path_factory.mktemp("lora-unit")
    path = save_tiny("llama3", root / "base")
    adapters = save_adapters(path, root)
    adapters["qvg"] = save_adapter(path, root / "qvg", 7, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                            "gate_proj"],
                                   rank_pattern={"gate_proj": 2}, alpha_pattern={"layers.1.self_attn.q_proj": 3})
    return path, ModelConfig.from_dir(path), adapters


def read(tiny, name: str, path=None, max_rank: int = 16):
    _, config, adapters = tiny
    return read_lora_adapter(LoRARequest(name, str(path or adapters[name])), lora_targets(config), max_rank,
                             torch.float32)


def copy_adapter(src, dst, config_changes: dict | None = None):
    """src's adapter files in dst, its adapter_config.json changed by config_changes."""
    dst.mkdir()
    config = (src / "adapter_config.json").read_text()
    if config_changes:
        config = json.dumps(json.loads(config) | config_changes)
    (dst / "adapter_config.json").write_text(config)
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_q_v_and_gate_adapters_become_stacked_a_and_block_diagonal_b_with_the_scaling(tiny):
    _, config, adapters = tiny
    adapter = read(tiny, "qvg")
    raw = load_file(adapters["qvg"] / "adapter_model.safetensors")
    q, kv, inter = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, \
        config.intermediate_size
    for layer, q_scale in ((0, 8 / 4), (1, 3 / 4)):  # (alpha_pattern: layer 1's q_proj has alpha 3)
        a, b = adapter.weights[f"model.layers.{layer}.self_attn.qkv_proj"]
        t = {name: raw[f"{PREFIX}.{layer}.self_attn.{name}"] for name in
             ("q_proj.lora_A.weight", "q_proj.lora_B.weight", "v_proj.lora_A.weight", "v_proj.lora_B.weight")}
        assert torch.equal(a, torch.cat([t["q_proj.lora_A.weight"], t["v_proj.lora_A.weight"]]))  # [8, K]
        assert b.shape == (q + 2 * kv, 8)
        torch.testing.assert_close(b[:q, :4], t["q_proj.lora_B.weight"] * q_scale, rtol=0, atol=0)
        assert not b[:q, 4:].any() and not b[q : q + kv].any()  # (k_proj is not adapted)
        torch.testing.assert_close(b[q + kv :, 4:], t["v_proj.lora_B.weight"] * 2.0, rtol=0, atol=0)
        assert not b[q + kv :, :4].any()
        a, b = adapter.weights[f"model.layers.{layer}.mlp.gate_up_proj"]  # (rank_pattern: gate has rank 2)
        assert torch.equal(a, raw[f"{PREFIX}.{layer}.mlp.gate_proj.lora_A.weight"]) and b.shape == (2 * inter, 2)
        torch.testing.assert_close(b[:inter], raw[f"{PREFIX}.{layer}.mlp.gate_proj.lora_B.weight"] * 4.0, rtol=0,
                                   atol=0)
        assert not b[inter:].any()
    assert set(adapter.weights) == {f"model.layers.{i}.{m}" for i in (0, 1)
                                    for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")}  # fmt: skip
    assert adapter.rank == 4 and adapter.key == f"qvg:{adapter.digest}" and len(adapter.digest) == 16


def test_rslora_scales_by_the_square_root_and_the_digest_follows_the_files(tiny, tmp_path):
    _, _, adapters = tiny
    plain = read(tiny, "qvg")
    rs = read(tiny, "qvg", copy_adapter(adapters["qvg"], tmp_path / "rs", {"use_rslora": True}))
    name = "model.layers.0.self_attn.qkv_proj"
    torch.testing.assert_close(rs.weights[name][1], plain.weights[name][1] * (8 / math.sqrt(4)) / (8 / 4))
    assert rs.digest != plain.digest
    assert read(tiny, "qvg", copy_adapter(adapters["qvg"], tmp_path / "same")).digest == plain.digest  # (bytes)


@pytest.mark.parametrize("changes, error", [
    ({"use_dora": True}, "use_dora \\(DoRA\\) is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias 'all'"),
    ({"lora_bias": True}, "lora_bias"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules names lm_head"),
    ({"target_modules": ".*embed_tokens"}, "target_modules names embed_tokens"),
    ({"peft_type": "LOHA"}, "peft_type 'LOHA'"),
    ({"r": 8, "rank_pattern": {}}, "has rank \\d, but its config says 8"),
    ({"init_lora_weights": "mica"}, "MiCA"),
])  # fmt: skip
def test_what_is_not_served_is_refused_by_name(tiny, tmp_path, changes, error):
    _, _, adapters = tiny
    with pytest.raises(InvalidRequestError, match=f"adapter 'bad' .*{error}"):
        read(tiny, "bad", copy_adapter(adapters["qvg"], tmp_path / "bad", changes))


# a pattern that backtracks exponentially on a module name: Python's re would hold the GIL on it for good
BACKTRACKS = r"([^x]|[^y])*\d"


@pytest.mark.parametrize("changes, error", [
    ({"rank_pattern": {BACKTRACKS: 2}}, "rank_pattern: matching its patterns .* took over 0.2 s"),
    ({"alpha_pattern": {"gate_proj": 2, BACKTRACKS: 3}}, "alpha_pattern: matching its patterns .* took over 0.2 s"),
    ({"target_modules": r"(.*?.*?.*?)*\d|.*lm_head"}, "target_modules: matching its patterns .* took over 0.2 s"),
    ({"rank_pattern": {"q" * 1001: 2}}, "rank_pattern: a pattern must be a string of 1-1000 characters"),
    ({"rank_pattern": {"((q{10}){10}){10}": 2}}, "rank_pattern: the counted repeats of .* multiply to more than 100"),
    ({"target_modules": 123}, "target_modules must be a regex or a list of module names, got 123"),
    ({"target_modules": ["q_proj", 7]}, "target_modules must be a regex or a list of module names"),
    ({"target_modules": "(["}, "target_modules: '\\(\\[' is not a valid regular expression"),
    ({"rank_pattern": {"([": 4}}, "rank_pattern: '\\(\\[' is not a valid regular expression"),
    ({"rank_pattern": {"a)(b": 4}}, "rank_pattern: 'a\\)\\(b' is not a valid regular expression"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object of at most 4096 module patterns"),
    ({"rank_pattern": {"q_proj": "8"}}, "rank_pattern: the value for 'q_proj' must be a positive integer, got '8'"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern: the value for 'q_proj' must be a positive integer, got 0"),
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern: the value for 'q_proj' must be a finite number, got 'x'"),
    ({"alpha_pattern": {"q_proj": math.nan}}, "alpha_pattern: the value for 'q_proj' must be a finite number"),
    ({"lora_alpha": math.inf}, "lora_alpha must be a finite number, got inf"),
    ({"lora_alpha": -math.inf}, "lora_alpha must be a finite number, got -inf"),
    ({"lora_alpha": math.nan}, "lora_alpha must be a finite number, got nan"),
    ({"lora_alpha": 10**400}, "lora_alpha must be a finite number"),
    ({"lora_alpha": "16"}, "lora_alpha must be a finite number, got '16'"),
    ({"r": "4"}, "r must be a positive integer, got '4'"),
    ({"r": True}, "r must be a positive integer, got True"),
    ({"use_rslora": "yes"}, "use_rslora must be true or false, got 'yes'"),
])  # fmt: skip
def test_malformed_configs_are_refused_naming_the_field_and_no_pattern_hangs(tiny, tmp_path, monkeypatch, changes,
                                                                           error):
    """Each is an InvalidRequestError (a ValueError: a 400, or a one-line start-up error), never a TypeError or
    re.error; a pattern that backtracks without end is cut off by the read's budget (0.2 s here)."""
    monkeypatch.setattr("tandem.shared.lora.peft_config.PATTERN_BUDGET_S", 0.2)
    _, _, adapters = tiny
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match=f"adapter 'bad' .*{error}"):
        read(tiny, "bad", copy_adapter(adapters["qvg"], tmp_path / "bad", changes))
    assert time.monotonic() - started < 10


def test_nan_or_infinite_weights_and_scalings_that_overflow_are_refused(tiny, tmp_path):
    _, _, adapters = tiny
    weights = load_file(adapters["qvg"] / "adapter_model.safetensors")
    key = f"{PREFIX}.1.mlp.gate_proj.lora_B.weight"
    for value in (math.nan, math.inf):
        bad = copy_adapter(adapters["qvg"], tmp_path / f"bad-{value}")
        save_file(weights | {key: weights[key].index_fill(0, torch.tensor([3]), value)},
                  bad / "adapter_model.safetensors")
        with pytest.raises(InvalidRequestError, match="model.layers.1.mlp.gate_proj: its lora_A or lora_B holds NaN"):
            read(tiny, "qvg", bad)
    huge = copy_adapter(adapters["qvg"], tmp_path / "huge", {"lora_alpha": 1e300})
    with pytest.raises(InvalidRequestError, match="scaled by lora_alpha / r are not finite in torch.float32"):
        read(tiny, "qvg", huge)


def header_only_adapter(tmp_path, config, rank: int):
    """An adapter of layer 0's q_proj at rank whose safetensors file holds its header only (the tensor data is
    missing, as if truncated): readable only as far as the header goes."""
    q = config.num_attention_heads * config.head_dim
    shapes = {"lora_A": [rank, config.hidden_size], "lora_B": [q, rank]}
    header, offset = {}, 0
    for kind, shape in shapes.items():
        header[f"{PREFIX}.0.self_attn.q_proj.{kind}.weight"] = {"dtype": "F32", "shape": shape,
                                                               "data_offsets": [offset, offset + 4 * math.prod(shape)]}
        offset += 4 * math.prod(shape)
    path = tmp_path / f"rank{rank}"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          "target_modules": ["q_proj"]}))
    text = json.dumps(header).encode()
    (path / "adapter_model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text)
    return path


def test_an_adapter_above_max_lora_rank_is_refused_from_its_header_without_reading_weights(tiny, tmp_path):
    """Rank 4096 (the header declares 100 MB of weights that the file does not even hold): refused by its rank,
    so no weight was read; the same file within the rank is refused as truncated, when the weights would be read."""
    _, config, _ = tiny
    with pytest.raises(InvalidRequestError, match="q_proj has rank 4096, above --max-lora-rank 16"):
        read(tiny, "big", header_only_adapter(tmp_path, config, 4096))
    with pytest.raises(InvalidRequestError, match="is \\d+ bytes, but its header declares \\d+: truncated"):
        read(tiny, "cut", header_only_adapter(tmp_path, config, 8))


@pytest.mark.parametrize("name", ["", "x" * 257, "has space", "tab\t", "nul\x00", "bell\x07", "zero\u200bwidth",
                                  "joiner\u200d", "bom\ufeff", "rtl\u202e", "lone\ud800", "line\u2028"])
def test_adapter_names_without_controls_format_characters_or_lone_surrogates(name):
    with pytest.raises(InvalidRequestError, match="must be 1-256 characters without whitespace, control or format"):
        LoRARequest(name, "/adapters/x")
    assert LoRARequest("é-日本_sql.v2", "/a").lora_name == "é-日本_sql.v2" and LoRARequest("x" * 256, "/a")


def test_a_relative_lora_path_is_refused_naming_lora_path(tiny, monkeypatch):
    """Each engine would resolve it against its own working directory (here: where the adapter is)."""
    _, _, adapters = tiny
    monkeypatch.chdir(adapters["qvg"].parent)
    for path in ("qvg", "./qvg", "qvg/../qvg"):
        with pytest.raises(InvalidRequestError, match="lora_path must be an absolute path"):
            read(tiny, "rel", path)
    with pytest.raises(InvalidRequestError, match="'/x\\\\x00y'\\): lora_path must be an absolute path of printable"):
        read(tiny, "nul", "/x\x00y")


def test_ranks_shapes_weights_and_files_that_do_not_fit_are_refused(tiny, tmp_path):
    path, _, adapters = tiny
    with pytest.raises(InvalidRequestError, match="rank 16, above --max-lora-rank 8"):
        read(tiny, "mlp", max_rank=8)
    weights = load_file(adapters["attn"] / "adapter_model.safetensors")
    for name, extra, error in (
            ("embed", {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 512)},
             "not a lora_A / lora_B weight"),
            ("head", {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 256)}, "it adapts lm_head"),
            ("narrow", {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 128)}, "do not fit the model"),
            ("half", {f"{PREFIX}.0.self_attn.k_proj.lora_A.weight": torch.zeros(8, 256)}, "not both lora_A and")):
        bad = copy_adapter(adapters["attn"], tmp_path / name)
        save_file(weights | extra, bad / "adapter_model.safetensors")
        with pytest.raises(InvalidRequestError, match=f"adapter '{name}' .*{error}"):
            read(tiny, name, bad)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_config.json").write_text("{}")
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(InvalidRequestError, match="adapter_model.bin is a pickle, never read"):
        read(tiny, "bin", tmp_path / "bin")
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        read(tiny, "none", tmp_path)
    with pytest.raises(InvalidRequestError, match="--lora-modules takes NAME=PATH"):
        LoRARequest.parse("just-a-name")


def test_slots_are_reused_least_recently_used_first_and_memory_rereads_adapters(tiny, tmp_path):
    """Two slots, two adapters in memory, three adapters: the step's adapters keep their slots, a new one takes the
    least recently used slot; an adapter dropped from memory is read again, unless its files changed (refused,
    unloaded)."""
    from tandem.shared.model import load_model

    _, config, adapters = tiny
    moved = copy_adapter(adapters["attn"], tmp_path / "attn")
    manager = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=16), config, load_model(config), "cpu")
    loaded = {name: manager.read(LoRARequest(name, str(path)))
              for name, path in (("attn", moved), ("all", adapters["all"]), ("mlp", adapters["mlp"]))}  # fmt: skip
    assert all(manager.add(a) for a in loaded.values())
    a, b, c = (loaded[n].key for n in ("attn", "all", "mlp"))
    assert [info.resident for info in manager.list()] == [True, False, True]  # (all, attn, mlp: attn dropped)
    assert manager.activate([a, b, a]) == ({a: 0, b: 1}, {})
    layer = manager.layers["model.layers.1.mlp.gate_up_proj"]
    want_a, want_b = loaded["all"].weights["model.layers.1.mlp.gate_up_proj"]
    assert torch.equal(layer.lora_a[1, : want_a.shape[0]], want_a) and not layer.lora_a[1, want_a.shape[0]:].any()
    assert torch.equal(layer.lora_b[1, :, : want_b.shape[1]], want_b)
    assert not manager.layers["model.layers.0.mlp.down_proj"].lora_a[0].any()  # ("attn" leaves it alone)
    assert manager.activate([b]) == ({b: 1}, {})
    assert manager.activate([c, b]) == ({b: 1, c: 0}, {})  # (slot 0 was the least recently used)
    assert torch.equal(layer.lora_a[0, :32], loaded["mlp"].weights["model.layers.1.mlp.gate_up_proj"][0])
    config_file = moved / "adapter_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"lora_alpha": 99}))
    slots, failed = manager.activate([a])
    assert slots == {} and "'attn': its files in" in failed[a] and "changed since it was loaded" in failed[a]
    assert [info.name for info in manager.list()] == ["all", "mlp"]  # (unloaded: no new request takes it)


def test_removing_an_adapter_in_use_keeps_it_for_its_requests(tiny):
    from tandem.shared.model import load_model

    _, config, adapters = tiny
    manager = LoRAManager(LoRAConfig(max_loras=1), config, load_model(config), "cpu")
    manager.add(manager.read(LoRARequest("attn", str(adapters["attn"]))))
    key = manager.acquire("attn")
    manager.remove("attn")
    with pytest.raises(UnknownLoRAError, match="adapter 'attn' is not loaded"):
        manager.acquire("attn")
    assert manager.list() == [] and manager.activate([key])[0] == {key: 0}  # (its request still runs with it)
    manager.release(key)
    assert manager.records == {} and manager.slots == [None]
    with pytest.raises(InvalidRequestError, match="'x' is already loaded, from other files"):
        manager.add(manager.read(LoRARequest("x", str(adapters["attn"]))))
        manager.add(manager.read(LoRARequest("x", str(adapters["all"]))))


def test_segments_merge_neighbours_of_one_slot_and_skip_the_base_model():
    meta = LoRAMetadata.build([0, 3, 5, 9, 10, 12], [1, 1, None, 0, 0])
    assert [t.tolist() for t in (meta.seg_starts, meta.seg_lens, meta.seg_slots)] == [[0, 9], [5, 3], [1, 0]]
    assert LoRAMetadata.build([0, 4, 6], [None, None]) is None


@pytest.mark.parametrize("quantized", [False, True])
def test_the_wrapper_adds_each_segments_delta_to_the_base_output(quantized):
    from tandem.shared.lora.targets import LoRATarget

    torch.manual_seed(0)
    base = nn.Linear(64, 32)
    if quantized:
        base = WeightOnlyInt8Linear.from_float(base)
    layer = LoRALinear(base, LoRATarget("x", 64, (("o_proj", 32),)), max_loras=2, max_lora_rank=8,
                       dtype=torch.float32, device="cpu")
    weights = [(torch.randn(r, 64), torch.randn(32, r)) for r in (8, 3)]
    for slot, w in enumerate(weights):
        layer.set_slot(slot, w)
    x = torch.randn(7, 64)
    meta = LoRAMetadata.build([0, 2, 3, 7], [1, None, 0])
    got = layer(x, meta)
    want = base(x)
    want[:2] += x[:2] @ weights[1][0].T @ weights[1][1].T
    want[3:] += x[3:] @ weights[0][0].T @ weights[0][1].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x), base(x))  # (no segments: the base layer alone)


def lora_request(request_id: str, key: str | None, prompt: int = 4):
    r = make_request(request_id, num_prompt_tokens=prompt)
    r.lora_key = key
    return r


def test_a_step_runs_at_most_max_loras_adapters_first_come_first_served():
    """Two slots: "c" is one adapter too many, so it waits, and no later adapter request overtakes it (the fourth,
    of "a", which is in the step); a base-model request passes. Once "a" and "b" end, "c" and the "a" behind it
    run."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    scheduler.max_loras = 2
    requests = [lora_request(f"r{i}", key) for i, key in enumerate(["a", "b", "c", "a", None])]
    for r in requests:
        scheduler.add_request(r)
    assert [r.request_id for r in scheduler.schedule().scheduled_requests] == ["r0", "r1", "r4"]
    for r in requests[:2]:
        scheduler.remove_request(r)
        scheduler.kv_cache_manager.free(r)
    out = scheduler.schedule()
    assert [r.request_id for r in out.scheduled_requests] == ["r4", "r2", "r3"]


def test_running_requests_of_one_adapter_too_many_sit_steps_out():
    """The decode tier: requests joining with their KV (running at once) of three adapters over two slots; the third
    adapter's runs once a slot frees."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    scheduler.max_loras = 2
    requests = [lora_request(f"r{i}", key) for i, key in enumerate(["a", "b", "c"])]
    for r in requests:
        assert scheduler.kv_cache_manager.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(5)
        scheduler.add_request(r)
    assert [r.request_id for r in scheduler.schedule().scheduled_requests] == ["r0", "r1"]
    scheduler.remove_request(requests[0])
    assert [r.request_id for r in scheduler.schedule().scheduled_requests] == ["r1", "r2"]


def test_the_adapter_identity_changes_every_block_hash_and_is_stable():
    contract = HashContract(4, "m:1:fp32", "float32")
    ids = list(range(16))
    base = hash_request_blocks(ids, contract)
    a = hash_request_blocks(ids, contract, lora_key="a:0123")
    assert hash_request_blocks(ids, contract, lora_key=None) == base
    assert a == hash_request_blocks(ids, contract, lora_key="a:0123")  # (alike on every instance)
    assert not set(a) & set(base) and not set(a) & set(hash_request_blocks(ids, contract, lora_key="a:4567"))


def test_lora_flags_make_the_lora_config(monkeypatch):
    parser = argparse.ArgumentParser()
    add_engine_service_args(parser, "decode")
    apply_env(parser, [])
    args = parser.parse_args(["--lora-modules", "a=/x", "b=/y", "--max-loras", "2"])
    engine_args = EngineArgs.from_namespace(args)
    assert engine_args.create_lora_config() == LoRAConfig(2, 2, 16, (("a", "/x"), ("b", "/y")))
    assert "--lora-modules a=/x b=/y" in " ".join(engine_argv(engine_args))
    assert EngineArgs().create_lora_config() is None
    assert EngineArgs(enable_lora=True).create_lora_config() == LoRAConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])
    with pytest.raises(ValueError, match="--max-cpu-loras \\(2\\) must be at least --max-loras \\(4\\)"):
        LoRAConfig(max_cpu_loras=2)
    monkeypatch.setenv("TANDEM_LORA_MODULES", "c=/z d=/w")
    parser = argparse.ArgumentParser()
    add_engine_service_args(parser, "prefill")
    apply_env(parser, [])
    assert parser.parse_args([]).lora_modules == ["c=/z", "d=/w"]
