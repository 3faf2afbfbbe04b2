"""Mixed precision and outlier-aware INT8 on tiny random models: the layer map's validation and naming, the
checkpoint round trip, fusion of mixed and outlier layers, every forward path of an outlier layer against its
dequantized weight, and the selection rule."""
import json

import pytest
import torch
from torch import nn

from tandem.kernels import cpu_qgemm
from tandem.shared.quant import QuantConfig, apply_quantization, apply_quantized_state, save_quantized, weight_bytes
from tandem.tools.quant import quantize_model
from tandem.shared.quant.layers import ConcatLinear, WeightOnlyInt4Linear, WeightOnlyInt8Linear, concat_linears
from tandem.shared.quant.modules import quantizable_linears
from tandem.tools.quant.outliers import outlier_channels, outlier_int8_tensors
from tandem.tools.quant.sensitivity import (LinearSensitivity, calibration_windows, choose_layer_formats, format_bytes,
                                      rank_correlation)

MIXED = {"model.layers.0.self_attn.k_proj": "float", "model.layers.0.mlp.down_proj": "int8",
         "model.layers.1.self_attn.q_proj": "int4-g32"}


def outlier_layer(n=24, k=64, idx=(3, 40), bias=False, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n, k)
    w[:, list(idx)] *= 30  # the columns a large activation would meet
    layer = WeightOnlyInt8Linear(k, n, bias=bias)
    tensors = outlier_int8_tensors(w, torch.tensor(idx))
    layer.load_quantized(tensors["qweight"], tensors["scales"], torch.randn(n) if bias else None,
                         tensors["outlier_idx"], tensors["outlier_weight"])
    return layer, w


def test_outlier_columns_are_exact_and_scales_ignore_them():
    layer, w = outlier_layer()
    deq = layer.dequantize()
    assert torch.equal(deq[:, [3, 40]], w[:, [3, 40]])
    inliers = torch.ones(64, dtype=torch.bool)
    inliers[[3, 40]] = False
    assert torch.all(layer.qweight[:, ~inliers] == 0)
    step = w[:, inliers].abs().amax(1) / 127  # the scale comes from the other columns only
    assert torch.allclose(layer.scales, step)
    assert torch.all((deq[:, inliers] - w[:, inliers]).abs() <= step[:, None] / 2 + 1e-6)


@pytest.mark.parametrize("rows", [1, 7, 300])  # the CPU kernel rows, and past CPU_KERNEL_MAX_M (fallback)
@pytest.mark.parametrize("bias", [False, True])
def test_outlier_layer_forward_matches_its_dequantized_weight(rows, bias):
    layer, _ = outlier_layer(bias=bias)
    x = torch.randn(rows, 64)
    expected = x.double() @ layer.dequantize().double().T + (0 if layer.bias is None else layer.bias.double())
    # The VNNI path (when the CPU has it) quantizes activations to int16: its tolerance is wider.
    tol = 2e-2 if cpu_qgemm.has_vnni() else 1e-4
    assert torch.allclose(layer(x).double(), expected, atol=tol, rtol=tol)


def test_outlier_tensors_are_validated():
    layer = WeightOnlyInt8Linear(64, 8)
    q, s = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match="come together"):
        layer.load_quantized(q, s, None, torch.tensor([1]), None)
    with pytest.raises(ValueError, match="sorted distinct"):
        layer.load_quantized(q, s, None, torch.tensor([5, 2]), torch.zeros(8, 2))
    with pytest.raises(ValueError, match="sorted distinct"):
        layer.load_quantized(q, s, None, torch.tensor([64]), torch.zeros(8, 1))
    with pytest.raises(ValueError, match="outlier_weight: expected shape"):
        layer.load_quantized(q, s, None, torch.tensor([1, 2]), torch.zeros(8, 3))


def test_outlier_channels_threshold_and_cap():
    absmax = torch.tensor([0.5, 7.0, 2.0, 9.0, 6.0, 1.0, 0.1, 0.2, 0.3, 0.4])
    assert outlier_channels(absmax, 6.0, 1.0).tolist() == [1, 3, 4]
    assert outlier_channels(absmax, 6.0, 0.2).tolist() == [1, 3]  # the two largest, sorted
    assert outlier_channels(absmax, 100.0, 1.0).tolist() == []
    with pytest.raises(ValueError, match="threshold"):
        outlier_channels(absmax, 0.0)


def test_fusion_stacks_equal_outliers_and_concatenates_mixed_formats():
    a, _ = outlier_layer(n=16, seed=1)
    b, _ = outlier_layer(n=8, seed=2)
    x = torch.randn(5, 64)
    fused = concat_linears([a, b])
    assert type(fused) is WeightOnlyInt8Linear and torch.equal(fused.outlier_idx, a.outlier_idx)
    assert torch.allclose(fused(x), torch.cat([a(x), b(x)], -1), atol=1e-5)
    other, _ = outlier_layer(n=8, idx=(5,), seed=3)
    float_linear = nn.Linear(64, 8, bias=False)
    int4 = WeightOnlyInt4Linear.from_float(nn.Linear(64, 8, bias=False), 32)
    for layers in ([a, other], [a, float_linear, int4]):
        mixed = concat_linears(layers)
        assert type(mixed) is ConcatLinear and mixed.out_features == sum(m.out_features for m in layers)
        assert torch.equal(mixed(x), torch.cat([m(x) for m in layers], -1))


def test_layer_map_is_validated_and_named():
    base = QuantConfig(bits=4, group_size=128, method="rtn")
    mixed = QuantConfig(bits=4, group_size=128, method="rtn", layer_formats=tuple(sorted(MIXED.items())))
    assert mixed.weight_format.startswith("int4-g128-rtn-mix") and len(mixed.weight_format) == len(
        "int4-g128-rtn-mix") + 8
    other = QuantConfig(bits=4, group_size=128, method="rtn", layer_formats=(("model.layers.0.mlp.up_proj", "int8"),))
    assert other.weight_format != mixed.weight_format != base.weight_format
    assert QuantConfig.from_json(json.loads(json.dumps(mixed.to_json()))) == mixed
    assert mixed.linear_format("model.layers.0.mlp.down_proj") == "int8"
    assert mixed.linear_format("model.layers.0.mlp.up_proj") == "int4-g128"
    assert QuantConfig(bits=8, method="llmint8").weight_format == "int8-llmint8"
    for bad, match in [(dict(layer_formats=(("a", "int3"),)), "float, int8 or int4-gG"),
                       (dict(layer_formats=(("a", "int4-g100"),)), "group_size"),
                       (dict(layer_formats=(("b", "int8"), ("a", "int8"))), "sorted"),
                       (dict(method="awq", layer_formats=(("a", "int8"),)), "rtn or gptq")]:
        with pytest.raises(ValueError, match=match):
            QuantConfig(**({"bits": 4, "group_size": 128, "method": "rtn"} | bad))
    with pytest.raises(ValueError, match="llmint8"):
        QuantConfig(bits=4, group_size=128, method="llmint8")


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_mixed_checkpoint_round_trip(tmp_path, make_tiny_llama, method):
    model = make_tiny_llama()
    calib = torch.randint(0, 128, (256,))
    config = QuantConfig(bits=4, group_size=64, method=method, layer_formats=tuple(sorted(MIXED.items())))
    state = quantize_model(model, method, 4, 64, calib, layer_formats=MIXED, seq_len=64)
    assert "model.layers.0.self_attn.k_proj.weight" in state
    save_quantized(tmp_path / "q", state, config, _source_dir(tmp_path, model))
    expected = apply_quantized_state(make_tiny_llama(), state)
    loaded = make_tiny_llama(seed=5)
    assert apply_quantization(loaded, tmp_path / "q") == config
    kinds = {name: type(m) for name, m in quantizable_linears(loaded).items()}
    assert kinds["model.layers.0.self_attn.k_proj"] is nn.Linear
    assert kinds["model.layers.0.mlp.down_proj"] is WeightOnlyInt8Linear
    assert quantizable_linears(loaded)["model.layers.1.self_attn.q_proj"].group_size == 32
    assert kinds["model.layers.1.mlp.up_proj"] is WeightOnlyInt4Linear
    ids = torch.randint(0, 128, (1, 20))
    assert torch.equal(loaded(ids).logits, expected(ids).logits)


def test_a_checkpoint_whose_tensors_disagree_with_its_layer_map_is_refused(tmp_path, make_tiny_llama):
    model = make_tiny_llama()
    state = quantize_model(model, "rtn", 4, 64, layer_formats=MIXED)
    config = QuantConfig(bits=4, group_size=64, method="rtn", layer_formats=tuple(sorted(MIXED.items())))
    path = save_quantized(tmp_path / "q", state, config, _source_dir(tmp_path, model))
    data = json.loads((path / "config.json").read_text())
    data["quantization_config"]["layer_formats"]["model.layers.0.mlp.down_proj"] = "float"
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="down_proj is float, but it holds int8"):
        apply_quantization(make_tiny_llama(), path)
    data["quantization_config"]["layer_formats"] = {"model.layers.9.mlp.up_proj": "int8"}
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj, which the model does not have"):
        apply_quantization(make_tiny_llama(), path)
    with pytest.raises(ValueError, match="linears the model lacks"):
        quantize_model(make_tiny_llama(), "rtn", 4, 64, layer_formats={"model.layers.9.mlp.up_proj": "int8"})


def test_format_bytes_match_the_built_layers(make_tiny_llama):
    model = make_tiny_llama()
    float_bytes = weight_bytes(model)
    apply_quantized_state(model, quantize_model(model, "rtn", 4, 64, layer_formats=MIXED))
    for name, layer in quantizable_linears(model).items():
        built = sum(t.numel() * t.element_size() for t in list(layer.parameters()) + list(layer.buffers()))
        fmt = MIXED.get(name, "int4-g64")
        n, k = layer.out_features, layer.in_features
        assert built == format_bytes(fmt, n, k), name
    assert weight_bytes(model) < float_bytes


def sens(name, kl, shape=(64, 64), fmt="int4-g64"):
    return LinearSensitivity(name, "mlp.up_proj", 0, kl, 1.0, format_bytes(fmt, *shape), shape)


def test_selection_by_byte_budget_follows_kl_per_byte():
    small, big = (64, 64), (256, 64)
    items = [sens("a", 0.04, big), sens("b", 0.02, small), sens("c", 0.001, small), sens("d", 0.03, small)]
    extra_small = format_bytes("int8", *small) - format_bytes("int4-g64", *small)
    # d and b remove the most KL per byte; a (4x the bytes) does not fit beside them
    chosen = choose_layer_formats(items, "int4-g64", "int8", 1000, budget_bytes=1000 + 2 * extra_small + 10)
    assert chosen == {"d": "int8", "b": "int8"}
    assert choose_layer_formats(items, "int4-g64", "int8", 1000, budget_bytes=1000) == {}
    with pytest.raises(ValueError, match="below"):
        choose_layer_formats(items, "int4-g64", "int8", 1000, budget_bytes=999)
    with pytest.raises(ValueError, match="--max-kl"):
        choose_layer_formats(items, "int4-g64", "int8", 1000)


def test_selection_by_kl_budget_bisects_on_the_measured_kl():
    items = [sens(name, kl) for name, kl in zip("abcdef", [0.06, 0.05, 0.04, 0.03, 0.02, 0.01])]
    calls = []

    def measure(promoted):  # a stand-in for the model: the KL of the linears left at the low format
        calls.append(len(promoted))
        return sum(s.kl for s in items if s.name not in promoted)

    assert choose_layer_formats(items, "int4-g64", "int8", 0, max_kl=0.035, measure_kl=measure) == {
        "a": "int8", "b": "int8", "c": "int8", "d": "int8"}  # 0.02 + 0.01 left; 0.06 with three promoted
    assert len(calls) <= 5
    with pytest.raises(ValueError, match="out of reach"):
        choose_layer_formats(items, "int4-g64", "int8", 0, max_kl=-1.0, measure_kl=measure)


def test_calibration_windows_and_rank_correlation():
    ids = torch.arange(1000)
    a, b = calibration_windows(ids, 64, 4, seed=0), calibration_windows(ids, 64, 4, seed=1)
    assert a.shape == (4, 64) and not torch.equal(a, b)
    assert torch.equal(a, calibration_windows(ids, 64, 4, seed=0))
    assert all(torch.equal(w, torch.arange(w[0], w[0] + 64)) for w in a)
    with pytest.raises(ValueError, match="need more than"):
        calibration_windows(ids[:100], 64, 40, seed=0)
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def _source_dir(tmp_path, model):
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text(model.config.to_json_string())
    return source


def test_tampered_outlier_and_mixed_tensors_are_refused(tmp_path, make_tiny_llama):
    """The breaker's cases: every one loaded before (or crashed with a ZeroDivisionError)."""
    layer = WeightOnlyInt8Linear(64, 8)
    q, s = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        layer.load_quantized(q, s, None, torch.tensor([1.0, 2.0]), torch.zeros(8, 2))
    with pytest.raises(ValueError, match="outlier_weight must be float"):
        layer.load_quantized(q, s, None, torch.tensor([1, 2]), torch.zeros(8, 2, dtype=torch.int32))
    q[:, 2] = 5
    with pytest.raises(ValueError, match="zero codes in the outlier columns"):
        layer.load_quantized(q, s, None, torch.tensor([1, 2]), torch.zeros(8, 2))
    model = make_tiny_llama()
    calib = torch.randint(0, 128, (256,))
    llmint8 = quantize_model(model, "llmint8", 8, None, calib, threshold=0.5, seq_len=64)
    source = _source_dir(tmp_path, model)
    cases = {
        "scales wider than K": ({"model.layers.0.mlp.up_proj.scales": torch.ones(96, 200)}, "llmint8",
                                "int8 scales must be"),
        "outliers dropped": ({}, "llmint8", "lacks the outlier columns"),
        "outliers under rtn": ({}, "rtn", "has outlier columns, which method rtn never writes"),
    }
    for name, (change, method, error) in cases.items():
        state = dict(llmint8) | change
        if name == "outliers dropped":
            state = {k: v for k, v in state.items() if ".outlier_" not in k}
        path = save_quantized(tmp_path / name.replace(" ", "-"), state, QuantConfig(bits=8, method=method), source)
        with pytest.raises(ValueError, match=error):
            apply_quantization(make_tiny_llama(), path)
    mixed = quantize_model(make_tiny_llama(), "rtn", 4, 64, layer_formats=MIXED)
    mixed["model.layers.0.self_attn.k_proj.weight"] = mixed["model.layers.0.self_attn.k_proj.weight"].int()
    with pytest.raises(ValueError, match="needs a float weight"):
        apply_quantized_state(make_tiny_llama(), mixed)
