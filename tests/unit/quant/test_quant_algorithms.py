"""GPTQ and AWQ on synthetic problems and a tiny random Llama: exact invariants, not just 'it runs'."""
import pytest
import torch

from tandem.kernels.int4_format import unpack_int4
from tandem.shared.quant import apply_quantized_state
from tandem.tools.quant import quantize_model
from tandem.tools.quant.awq import search_scales
from tandem.tools.quant.gptq import gptq_quantize_weight
from tandem.shared.quant.layers import WeightOnlyInt4Linear, WeightOnlyInt8Linear
from tandem.shared.quant.rtn import fake_quantize


def make_problem(n=32, k=192, tokens=400, seed=0):
    """Weight [n, k] and correlated inputs [tokens, k] with a few large channels, as in LLM activations."""
    torch.manual_seed(seed)
    x = torch.randn(tokens, k) @ (torch.eye(k) + 0.3 * torch.randn(k, k) / k**0.5)
    x[:, :4] *= 8
    return torch.randn(n, k), x


def output_error(w, wq, x):
    return ((x @ (wq - w).T) ** 2).mean().item()


@pytest.mark.parametrize("bits,group_size,act_order",
                         [(4, 32, False), (4, 64, True), (4, 128, False), (8, None, False)])
def test_gptq_beats_rtn_on_layer_output(bits, group_size, act_order):
    w, x = make_problem(k=200)  # 200 is not a multiple of 64 or 128: partial last group
    H = 2 * x.T @ x / x.shape[0]
    tensors, deq = gptq_quantize_weight(w, H, bits, group_size, act_order=act_order)
    assert output_error(w, deq, x) < 0.8 * output_error(w, fake_quantize(w, bits, group_size), x)
    # the returned dequantized weight is exactly what the packed layer computes
    if bits == 8:
        layer = WeightOnlyInt8Linear(200, 32).load_quantized(tensors["qweight"], tensors["scales"])
    else:
        layer = WeightOnlyInt4Linear(200, 32, group_size).load_quantized(
            tensors["qweight"], tensors["scales"], tensors["zeros"])
        assert int(unpack_int4(tensors["qweight"]).max()) <= 15
    assert torch.allclose(layer.dequantize(), deq, atol=1e-6)


def test_gptq_lazy_batch_blocksize_does_not_change_result():
    w, x = make_problem(k=128)
    H = 2 * x.T @ x / x.shape[0]
    a = gptq_quantize_weight(w, H, 4, 32, blocksize=32)[1]
    b = gptq_quantize_weight(w, H, 4, 32, blocksize=128)[1]
    assert torch.allclose(a, b, atol=1e-4)


def test_gptq_with_identity_hessian_is_rtn():
    """With H = I no column carries information about another: GPTQ must reduce to round-to-nearest."""
    w, _ = make_problem(k=128)
    deq = gptq_quantize_weight(w, torch.eye(128), 4, 64, percdamp=0.0)[1]
    assert torch.allclose(deq, fake_quantize(w, 4, 64), atol=1e-5)


def test_awq_search_never_loses_to_rtn_on_its_loss():
    w, x = make_problem(k=128)
    s = search_scales(x, [w], 4, 32, n_grid=10)
    wq = fake_quantize(w * s, 4, 32) / s
    assert output_error(w, wq, x) <= output_error(w, fake_quantize(w, 4, 32), x) + 1e-9


@pytest.mark.parametrize("method,bits,group_size", [("rtn", 8, None), ("rtn", 4, 32), ("gptq", 4, 32),
                                                    ("awq", 4, 32), ("gptq", 8, None), ("awq", 8, None)])
def test_quantize_model_swaps_every_linear(make_tiny_llama, method, bits, group_size):
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (96,))
    state = quantize_model(model, method, bits, group_size, ids, seq_len=32)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    apply_quantized_state(model, state)
    kind = WeightOnlyInt8Linear if bits == 8 else WeightOnlyInt4Linear
    assert sum(isinstance(m, kind) for m in model.modules()) == 2 * 7
    assert not any(type(m) is torch.nn.Linear and m is not model.lm_head for m in model.modules())
    assert torch.isfinite(model(ids[None, :32]).logits).all()


def test_quantize_model_rejects_bad_arguments(make_tiny_llama):
    model = make_tiny_llama()
    with pytest.raises(ValueError):
        quantize_model(model, "gptq", 4, 128)  # no calibration tokens
    with pytest.raises(ValueError):
        quantize_model(model, "rtn", 4, 100)
    with pytest.raises(ValueError):
        quantize_model(model, "rtn", 8, 128)
    with pytest.raises(ValueError):
        quantize_model(model, "smoothquant", 8, None)
