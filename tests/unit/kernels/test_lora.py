"""The batched LoRA delta (kernels/lora.py add_lora) against add_lora_ref: the C++ kernel (kernels/cpu/lora.cpp, fp32
and bf16, on one and two kernel threads), the Triton kernels (kernels/lora_sgmv.py; interpreted on CPU, or compiled
with TANDEM_KERNEL_DEVICE=cuda), the reference fallback (fp16, strided x), the dispatch, and bad arguments.

Layouts sweep what an engine step holds: no segments, only empty ones (every row a base-model row), base and adapter
rows mixed (segments out of row order), 32 one-row decode segments (a BGMV), one 300-row prefill segment, 16 slots;
shapes the default model's linears (K 576 / 1536, N 576 / 960 / 3072) and sizes that are no multiple of any vector
width; ranks 1, 8, 16, 64; and a T whose row offsets pass 2^31 elements (index overflow).
"""
import pytest
import torch

from tandem.kernels import cpu_ext, cpu_lora
from tandem.kernels import lora as lora_mod
from tandem.kernels.lora import add_lora, add_lora_ref
from tandem.kernels.lora_sgmv import sgmv_expand, sgmv_expand_ref, sgmv_shrink, sgmv_shrink_ref

needs_cpu_kernel = pytest.mark.skipif(not cpu_ext.available(), reason="the CPU kernel needs AVX2 and a C++ compiler")
RANKS = [1, 8, 16, 64]


def _layout(name: str) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(T, L, [(start, len, slot)]) of a named layout."""
    if name == "none":
        return 8, 2, []
    if name == "empty":  # segments of no rows: every row is a base-model row
        return 8, 2, [(0, 0, 1), (5, 0, 0)]
    if name == "mixed":  # base rows between, segments out of row order, two adjacent ones of different slots
        return 40, 3, [(30, 9, 2), (3, 5, 1), (10, 1, 0), (11, 7, 1)]
    if name == "decode32":  # 32 one-row segments, every 9th row a base row
        return 36, 4, [(i, 1, i % 4) for i in range(36) if i % 9 != 8]
    if name == "prefill300":
        return 310, 2, [(4, 300, 1)]
    if name == "slots16":
        return 64, 16, [(4 * i, 1 + i % 4, (7 * i) % 16) for i in range(16)]
    raise AssertionError(name)


def _tensors(T, K, N, R, L, segments, dtype, seed=0):
    """x, y, lora_a, lora_b (delta of size ~1 per output: a ~ 1/sqrt(K), b ~ 1/sqrt(R)) and the segment tensors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    y = torch.randn(T, N, generator=g).to(dtype)
    lora_a = (torch.randn(L, R, K, generator=g) / K**0.5).to(dtype)
    lora_b = (torch.randn(L, N, R, generator=g) / R**0.5).to(dtype)
    segs = tuple(torch.tensor([s[i] for s in segments], dtype=torch.int64) for i in range(3))
    return x, y, lora_a, lora_b, segs


def _assert_matches_ref(out, y, x, lora_a, lora_b, segs):
    """out (add_lora's y) against add_lora_ref's. fp32: sums in another order (atol = rtol = 1e-5). bf16 / fp16:
    the delta's rounding and the sum's may each land one step of the type (2^-7 / 2^-10 relative, at most) away from
    the reference's, so |out - ref| <= step * (|delta| + |ref|); and that happens only where the fp32 delta lies
    within its rounding error of a tie, so at most 1% of the outputs differ at all (a rounding that truncates makes
    about half of them differ)."""
    ref = y.clone()
    add_lora_ref(ref, x, lora_a, lora_b, *segs)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    delta = ref.double() - y.double()
    step = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[out.dtype]
    err, bound = (out.double() - ref.double()).abs(), step * (delta.abs() + ref.double().abs()) + 1e-12
    assert (err <= bound).all(), f"{int((err > bound).sum())} outputs off, worst {float((err - bound).max()):.3g}"
    assert (err > 0).double().mean() <= 0.01, f"{int((err > 0).sum())} of {err.numel()} outputs differ"



# (layout, K, N): the default model's linears on the decode and prefill layouts; sizes no multiple of 8 or 16 on
# the mixed one (K and N of 1 too: every loop is its tail)
CPU_CASES = [("none", 576, 960), ("empty", 576, 960), ("mixed", 100, 77), ("mixed", 1, 1), ("mixed", 576, 1536),
             ("decode32", 576, 3072), ("prefill300", 1536, 576), ("slots16", 33, 1539)]


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("layout, K, N", CPU_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CPU_CASES])
def test_cpu_kernel_matches_reference(layout, K, N, rank, dtype, kernel_threads, monkeypatch):
    T, L, segments = _layout(layout)
    x, y, lora_a, lora_b, segs = _tensors(T, K, N, rank, L, segments, dtype)
    assert cpu_lora.supports(y, x)
    monkeypatch.setattr(lora_mod, "add_lora_ref", None)  # (the reference path would fail: the kernel must run)
    out = y.clone()
    add_lora(out, x, lora_a, lora_b, *segs)
    monkeypatch.undo()
    _assert_matches_ref(out, y, x, lora_a, lora_b, segs)
    covered = torch.zeros(T, dtype=torch.bool)
    for start, length, _ in segments:
        covered[start:start + length] = True
    assert torch.equal(out[~covered], y[~covered])  # base rows: bit for bit untouched


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_kernel_writes_into_a_column_slice(dtype):
    """y a column slice of a fused output (row stride > N): the kernel writes those columns, the others untouched."""
    T, L, segments = _layout("mixed")
    x, fused, lora_a, lora_b, segs = _tensors(T, 64, 3 * 40, 8, L, segments, dtype)
    lora_b = lora_b[:, :40].contiguous()
    y = fused[:, 40:80]
    assert cpu_lora.supports(y, x)
    out = fused.clone()
    add_lora(out[:, 40:80], x, lora_a, lora_b, *segs)
    _assert_matches_ref(out[:, 40:80], y, x, lora_a, lora_b, segs)
    assert torch.equal(out[:, :40], fused[:, :40]) and torch.equal(out[:, 80:], fused[:, 80:])


@pytest.mark.parametrize("case", ["fp16", "strided-x"])
def test_what_the_cpu_kernel_does_not_take_runs_the_reference(case):
    T, L, segments = _layout("mixed")
    dtype = torch.float16 if case == "fp16" else torch.float32
    x, y, lora_a, lora_b, segs = _tensors(T, 2 * 48, 40, 8, L, segments, dtype)
    if case == "strided-x":
        x = x[:, ::2]  # [T, 48], column stride 2
        lora_a = lora_a[:, :, :48].contiguous()
    assert not cpu_lora.supports(y, x)
    out, ref = y.clone(), y.clone()
    add_lora(out, x, lora_a, lora_b, *segs)
    add_lora_ref(ref, x, lora_a, lora_b, *segs)
    assert torch.equal(out, ref)


def _large_t_case(device, dtype):
    """x [T, 128] and y [T, 128] with T * 128 > 2^31 (row offsets past int32), allocated but not written (virtual
    memory on CPU; on CUDA 8 GiB, freed at the end) but for the rows of segments near the end and at the start and
    two base rows; the reference runs on copies of those rows, re-based to row 0."""
    T, K, N, R, L = 2**24 + 64, 128, 128, 16, 3
    segments = [(T - 40, 30, 2), (T - 5, 1, 0), (0, 3, 1)]
    x = torch.empty(T, K, dtype=dtype, device=device)
    y = torch.empty(T, N, dtype=dtype, device=device)
    rows = torch.cat([torch.arange(s, s + n) for s, n, _ in segments] + [torch.tensor([T - 41, T - 1])])  # + 2 base
    sx, sy, lora_a, lora_b, _ = _tensors(len(rows), K, N, R, L, [], dtype)
    x[rows.to(device)], y[rows.to(device)] = sx.to(device), sy.to(device)
    local, offset = [], 0
    for _, n, slot in segments:
        local.append((offset, n, slot))
        offset += n
    local_segs = tuple(torch.tensor([s[i] for s in local]) for i in range(3))
    segs = tuple(torch.tensor([s[i] for s in segments]) for i in range(3))
    return x, y, rows, sx, sy, lora_a.to(device), lora_b.to(device), segs, local_segs


@needs_cpu_kernel
def test_cpu_kernel_large_token_count(kernel_threads):
    x, y, rows, sx, sy, lora_a, lora_b, segs, local_segs = _large_t_case("cpu", torch.bfloat16)
    add_lora(y, x, lora_a, lora_b, *segs)
    _assert_matches_ref(y[rows], sy, sx, lora_a, lora_b, local_segs)



@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", [5, 16, 64])
def test_cpu_kernel_is_batch_invariant(rank, dtype):
    """One row's output, bit for bit, whatever the batch around it: alone, or among 7, 8, 9 or 32 rows of its adapter
    (as one-row decode segments between rows of another adapter, or as one prefill segment, the row at another
    place each time), on one kernel thread or two. Each output element is summed in one order: the kernel's paths
    for few and for many rows of one adapter, and its splits over threads, all keep it."""
    K, N, L = 100, 300, 2  # (tails of every vector width; N past one block of columns)
    x, y, lora_a, lora_b, _ = _tensors(2 * 32 + 1, K, N, rank, L, [], dtype)
    before = cpu_ext.num_threads()
    outputs = []
    try:
        for threads in (1, 2):
            cpu_ext.set_num_threads(threads)
            for rows in (1, 7, 8, 9, 32):
                place = (5 * rows) // 7  # the row's place among its adapter's rows
                order = list(range(1, rows))  # the adapter's other rows
                order.insert(place, 0)  # x[0] / y[0]: the row watched
                # decode: one-row segments of slot 1, each followed by a row of slot 0
                picked = torch.tensor([j for i in order for j in (i, 33 + i)])
                segments = [(2 * p + q, 1, 1 - q) for p in range(rows) for q in (0, 1)]
                segs = tuple(torch.tensor([s[i] for s in segments]) for i in range(3))
                out = y[picked].clone()
                cpu_lora.add_lora(out, x[picked], lora_a, lora_b, *segs)
                outputs.append((threads, rows, "decode", out[2 * order.index(0)]))
                # prefill: one segment of slot 1
                out = y[order].clone()
                segs = tuple(torch.tensor([v]) for v in (0, rows, 1))
                cpu_lora.add_lora(out, x[order], lora_a, lora_b, *segs)
                outputs.append((threads, rows, "prefill", out[order.index(0)]))
    finally:
        cpu_ext.set_num_threads(before)
    first = outputs[0][3]
    _assert_matches_ref(first[None], y[:1], x[:1], lora_a, lora_b, tuple(torch.tensor([v]) for v in (0, 1, 1)))
    differ = [(t, m, layout, float((out.double() - first.double()).abs().max())) for t, m, layout, out in outputs
              if not torch.equal(out, first)]
    assert not differ, f"(threads, rows, layout, max |difference|) differ from the row alone: {differ}"

# Triton (layout, K, N, rank): the interpreter runs each program in numpy, so the shapes stay small (sizes no
# multiple of the tiles) and each layout takes one or two ranks (1 and 8: a rank tile mostly masked; 16, 64)
TRITON_CASES = [("mixed", 72, 130, 1), ("mixed", 72, 130, 16), ("decode32", 40, 24, 64), ("prefill300", 24, 70, 8),
                ("slots16", 33, 17, 64), ("empty", 16, 16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout, K, N, rank", TRITON_CASES, ids=["-".join(map(str, c)) for c in TRITON_CASES])
def test_triton_matches_reference(layout, K, N, rank, dtype, device):
    T, L, segments = _layout(layout)
    x, y, lora_a, lora_b, segs = _tensors(T, K, N, rank, L, segments, dtype)
    out = y.clone().to(device)
    add_lora(out, x.to(device), lora_a.to(device), lora_b.to(device), *segs, use_triton=True)
    _assert_matches_ref(out.cpu(), y, x, lora_a, lora_b, segs)


def test_triton_shrink_and_expand_match_their_references(device):
    T, L, segments = _layout("mixed")
    x, y, lora_a, lora_b, segs = _tensors(T, 40, 24, 8, L, segments, torch.bfloat16)
    h = sgmv_shrink(x.to(device), lora_a.to(device), *segs)
    torch.testing.assert_close(h.cpu(), sgmv_shrink_ref(x, lora_a, *segs), atol=1e-5, rtol=1e-5)
    h_ref = sgmv_shrink_ref(x, lora_a, *segs)
    out, ref = y.clone().to(device), y.clone()
    sgmv_expand(out, h_ref.to(device), lora_b.to(device), *segs)
    sgmv_expand_ref(ref, h_ref, lora_b, *segs)
    assert (out.cpu().double() - ref.double()).abs().max() <= 2**-7 * ref.double().abs().max()


def test_triton_large_token_count(device):
    x, y, rows, sx, sy, lora_a, lora_b, segs, local_segs = _large_t_case(device, torch.bfloat16)
    add_lora(y, x, lora_a, lora_b, *segs, use_triton=True)
    _assert_matches_ref(y[rows.to(device)].cpu(), sy, sx, lora_a.cpu(), lora_b.cpu(), local_segs)


def test_dispatch(monkeypatch):
    """fp32 / bf16 CPU tensors -> the C++ kernel (where built), fp16 -> the reference, use_triton -> Triton."""
    import tandem.kernels.lora_sgmv as sgmv

    calls = []
    monkeypatch.setattr(cpu_lora, "add_lora", lambda *a: calls.append("cpu"))
    monkeypatch.setattr(lora_mod, "add_lora_ref", lambda *a: calls.append("ref"))
    monkeypatch.setattr(sgmv, "add_lora_sgmv", lambda *a: calls.append("triton"))
    T, L, segments = _layout("mixed")
    for dtype, use_triton in [(torch.float32, None), (torch.bfloat16, False), (torch.float16, None),
                              (torch.float32, True)]:
        x, y, lora_a, lora_b, segs = _tensors(T, 16, 16, 4, L, segments, dtype)
        add_lora(y, x, lora_a, lora_b, *segs, use_triton=use_triton)
    cpu = "cpu" if cpu_ext.available() else "ref"
    assert calls == [cpu, cpu, "ref", "triton"]


BAD_SEGMENTS = {  # (starts, lens, slots) for T = 40, L = 3
    "past the end": ([35], [6], [0]),
    "negative start": ([-1], [2], [0]),
    "negative length": ([3], [-1], [0]),
    "slot = L": ([0], [4], [3]),
    "negative slot": ([0], [4], [-1]),
    "overlapping": ([10, 3], [2, 8], [0, 1]),
}


@pytest.mark.parametrize("path", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("bad", sorted(BAD_SEGMENTS))
def test_bad_segments_raise_before_writing(bad, path):
    if path == "cpu" and not cpu_ext.available():
        pytest.skip("the CPU kernel needs AVX2 and a C++ compiler")
    dtype = torch.float16 if path == "reference" else torch.float32
    x, y, lora_a, lora_b, _ = _tensors(40, 16, 8, 4, 3, [], dtype)
    segs = tuple(torch.tensor(v, dtype=torch.int64) for v in BAD_SEGMENTS[bad])
    out = y.clone()
    with pytest.raises(ValueError, match="segment"):
        add_lora(out, x, lora_a, lora_b, *segs, use_triton=path == "triton")
    assert torch.equal(out, y)


def _bad_args():
    x, y, a, b, segs = _tensors(8, 16, 12, 4, 2, [(0, 2, 1)], torch.float32)
    int32 = tuple(s.int() for s in segs)
    return {
        "x 1-D": (y, x[0], a, b, segs),
        "T differs": (y[:7], x, a, b, segs),
        "dtypes differ": (y.bfloat16(), x, a, b, segs),
        "int dtype": (y.int(), x.int(), a.int(), b.int(), segs),
        "lora_a 2-D": (y, x, a[0], b, segs),
        "lora_a K differs": (y, x, a[:, :, :15], b, segs),
        "lora_b rank differs": (y, x, a, b[:, :, :3], segs),
        "lora_b N differs": (y, x, a, b[:, :11], segs),
        "lora_b L differs": (y, x, a, b[:1], segs),
        "int32 segments": (y, x, a, b, int32),
        "segment lengths differ": (y, x, a, b, (segs[0], segs[1], torch.tensor([1, 0]))),
    }


@pytest.mark.parametrize("use_triton", [False, True], ids=["cpu", "triton"])
@pytest.mark.parametrize("case", sorted(_bad_args()))
def test_bad_arguments_raise_value_error(case, use_triton):
    y, x, a, b, segs = _bad_args()[case]
    with pytest.raises(ValueError):
        add_lora(y, x, a, b, *segs, use_triton=use_triton)
