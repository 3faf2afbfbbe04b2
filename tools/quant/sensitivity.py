"""Layer sensitivity to quantization, and the mixed-precision layer map it chooses.

Sensitivity of one linear = KL(fp32 || model with only that linear quantized) of next-token distributions,
averaged over calibration positions: the per-layer "quantize one, measure the output" analysis that
mixed-precision tools run before choosing formats (as in HAWQ's motivation, Dong et al. 2019, with the measured
KL instead of a Hessian trace). The float inputs of every decoder layer are computed once, so quantizing a linear
in layer i reruns only layers i.. and the head. Quantization inside the analysis is RTN (fake-quantized weights,
rtn.fake_quantize): the format's own error, before any GPTQ compensation.

Selection (choose_layer_formats) promotes linears from the low format to a higher one (INT8 or float) in
order of KL removed per extra byte, the greedy answer to the knapsack "most KL removed within a byte budget",
or until the measured KL of the mixed model meets a KL budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.kernels.int4_format import padded_in_features
from tandem.tools.quant.calibration import LayerInputs, capture_first_layer_inputs, decoder_layers, run_layer
from tandem.shared.quant.config import parse_linear_format
from tandem.shared.quant.modules import quantizable_linears
from tandem.shared.quant.rtn import fake_quantize

FLOAT_BYTES = 4  # checkpoints store float tensors in fp32


@dataclass(frozen=True)
class LinearSensitivity:
    """One linear's sensitivity: name "model.layers.{i}.<kind>", kind "mlp.down_proj", layer i; kl in nats per
    position and top1 (agreement with fp32's argmax) with only this linear in the analysed format; num_bytes
    of the linear in that format and [N, K] its weight's shape."""

    name: str
    kind: str
    layer: int
    kl: float
    top1: float
    num_bytes: int
    shape: tuple[int, int]


def format_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes a [N, K] linear takes in fmt ("float", "int8", "int4-gG"): codes + fp32 scales (+ zeros)."""
    bits, group_size = parse_linear_format(fmt)
    if bits is None:
        return n * k * FLOAT_BYTES
    if bits == 8:
        return n * k + n * FLOAT_BYTES
    k_pad = padded_in_features(k, group_size)
    return n * k_pad // 2 + 2 * n * (k_pad // group_size) * FLOAT_BYTES


def calibration_windows(token_ids: torch.Tensor, seq_len: int, num_windows: int, seed: int) -> torch.Tensor:
    """num_windows windows [num_windows, seq_len] int64 of token_ids at distinct random offsets drawn with
    seed: two seeds give two calibration samples of the same text. ValueError if the text is too short."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    num_starts = token_ids.numel() - seq_len + 1
    if seq_len < 1 or num_windows < 1 or num_starts < num_windows:
        raise ValueError(f"{num_windows} windows of {seq_len} tokens need more than {token_ids.numel()} "
                         "calibration tokens")
    starts = torch.randperm(num_starts, generator=torch.Generator().manual_seed(seed))[:num_windows]
    return torch.stack([token_ids[s : s + seq_len] for s in starts.tolist()])


def rank_correlation(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long score lists (Pearson correlation of their ranks)."""
    ranks = [torch.as_tensor(x, dtype=torch.float64).argsort().argsort().double() for x in (a, b)]
    ra, rb = (r - r.mean() for r in ranks)
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


class SensitivityProbe:
    """KL of a model with some linears fake-quantized, against the same model in float, on fixed windows.

    Args:
        model: HF LlamaForCausalLM in float (model.model.norm, model.lm_head); its weights are changed while a
            measurement runs and restored after.
        windows: [B, T] int64 calibration token ids.
    """

    @torch.no_grad()
    def __init__(self, model: nn.Module, windows: torch.Tensor):
        self.model, self.layers = model, decoder_layers(model)
        self.linears = {name: m for name, m in quantizable_linears(model).items() if isinstance(m, nn.Linear)}
        if len(self.linears) != len(quantizable_linears(model)):
            raise ValueError("the sensitivity analysis needs a float model")
        self.first = capture_first_layer_inputs(model, windows)  # (and each layer's mask and RoPE arguments)
        self.hidden_in = [self.first.hidden]  # [B, T, hidden] entering each layer, then leaving the last one
        for layer in self.layers:
            self.hidden_in.append(run_layer(layer, self._inputs(self.hidden_in[-1])))
        self.reference = self._logprobs(self.hidden_in[-1])  # [B, T, vocab]

    def _inputs(self, hidden: torch.Tensor) -> LayerInputs:
        return LayerInputs(hidden, self.first.args, self.first.kwargs, self.first.per_layer)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model.lm_head(self.model.model.norm(hidden)).float(), dim=-1)

    @torch.no_grad()
    def kl_with(self, formats: dict[str, str]) -> tuple[float, float]:
        """(KL(float || model with each named linear in its format) in nats per position, top-1 agreement)."""
        originals = {name: self.linears[name].weight.detach().clone() for name in formats}
        try:
            for name, fmt in formats.items():
                bits, group_size = parse_linear_format(fmt)
                if bits is not None:
                    self.linears[name].weight.copy_(fake_quantize(originals[name], bits, group_size))
            start = min((int(name.split(".")[2]) for name in formats), default=len(self.layers))
            kl, agree, count = 0.0, 0, 0
            for b, ref in enumerate(self.reference):  # one window at a time bounds the [T, vocab] tensors
                h = self.hidden_in[start][b : b + 1]
                for layer in self.layers[start:]:
                    h = run_layer(layer, self._inputs(h))
                logq = self._logprobs(h)[0]
                kl += (ref.exp() * (ref - logq)).sum().item()
                agree += (ref.argmax(-1) == logq.argmax(-1)).sum().item()
                count += ref.shape[0]
        finally:
            for name, weight in originals.items():
                self.linears[name].weight.copy_(weight)
        return kl / count, agree / count

    def analyze(self, fmt: str, names: list[str] | None = None, progress=None) -> list[LinearSensitivity]:
        """Each linear's sensitivity to fmt ("int8", "int4-gG"), most sensitive first: every linear, or those of
        names (canonical). progress: an optional callable(done, total) after each linear."""
        names = list(self.linears) if names is None else names
        results = []
        for name in names:
            linear = self.linears[name]
            kl, top1 = self.kl_with({name: fmt})
            n, k = linear.weight.shape
            _, _, index, kind = name.split(".", 3)
            results.append(LinearSensitivity(name, kind, int(index), kl, top1, format_bytes(fmt, n, k), (n, k)))
            if progress is not None:
                progress(len(results), len(names))
        return sorted(results, key=lambda s: -s.kl)


def choose_layer_formats(sensitivities: list[LinearSensitivity], low: str, high: str, base_bytes: int,
                         budget_bytes: int | None = None, max_kl: float | None = None,
                         measure_kl=None) -> dict[str, str]:
    """The linears to keep at `high` ("float" or "int8") while the rest take `low` ("int4-gG").

    Linears are promoted in order of sensitivity KL per extra byte. With budget_bytes, each one that still fits
    is promoted (total weight bytes = base_bytes, the model with every linear at low, plus the extra bytes).
    With max_kl, the shortest prefix of that order (within the budget, if one is given) whose measured KL
    (measure_kl(layer_formats) -> nats per position) is at most max_kl, found by bisection (KL falls as layers
    are promoted).

    Returns:
        canonical name -> high, for the promoted linears.
    Raises:
        ValueError: neither budget given, a budget below base_bytes, or a max_kl no prefix meets (the message
            gives the KL with every allowed linear promoted).
    """
    if budget_bytes is None and max_kl is None:
        raise ValueError("give a byte budget (--budget-bytes) or a KL budget (--max-kl)")
    if budget_bytes is not None and budget_bytes < base_bytes:
        raise ValueError(f"--budget-bytes {budget_bytes} is below {base_bytes}, the size with every linear at {low}")

    def extra(s: LinearSensitivity) -> int:
        return max(format_bytes(high, *s.shape) - s.num_bytes, 1)

    order = sorted(sensitivities, key=lambda s: -s.kl / extra(s))
    if budget_bytes is not None:
        room, chosen = budget_bytes - base_bytes, []
        for s in order:
            if extra(s) <= room:
                chosen.append(s)
                room -= extra(s)
        order = chosen
    if max_kl is None:
        return {s.name: high for s in order}

    def prefix(count: int) -> dict[str, str]:
        return {s.name: high for s in order[:count]}

    lo, hi = 0, len(order)
    best = measure_kl(prefix(hi))
    if best > max_kl:
        raise ValueError(f"--max-kl {max_kl} is out of reach: with all {hi} allowed linears at {high} the "
                         f"calibration KL is {best:.6f}")
    while lo < hi:  # invariant: prefix(hi) meets max_kl
        mid = (lo + hi) // 2
        if measure_kl(prefix(mid)) <= max_kl:
            hi = mid
        else:
            lo = mid + 1
    return prefix(hi)


def summarize_by_kind(sensitivities: list[LinearSensitivity]) -> list[dict]:
    """Per layer type ("self_attn.q_proj", ...): mean and max KL over its linears, most sensitive first."""
    kinds = {}
    for s in sensitivities:
        kinds.setdefault(s.kind, []).append(s.kl)
    rows = [{"kind": kind, "mean_kl": sum(kls) / len(kls), "max_kl": max(kls), "count": len(kls)}
            for kind, kls in kinds.items()]
    return sorted(rows, key=lambda r: -r["mean_kl"])

