import torch

from tandem.shared.sampler import apply_top_k_top_p, sample
from tests.unit.factories import make_request


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    reqs = [make_request("a", temperature=0.0), make_request("b", temperature=0.0)]
    assert sample(logits, reqs) == [1, 0]


def test_top_k_keeps_k_largest():
    out = apply_top_k_top_p(torch.tensor([1.0, 4.0, 3.0, 2.0]), top_k=2, top_p=1.0)
    assert torch.isinf(out).tolist() == [True, False, False, True]


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    out = apply_top_k_top_p(logits, top_k=0, top_p=0.7)
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    out = apply_top_k_top_p(logits, top_k=0, top_p=0.4)  # the top token alone already reaches 0.4
    assert torch.isfinite(out).tolist() == [True, False, False, False]


def test_seed_makes_sampling_reproducible_and_seeds_differ():
    logits = torch.randn(1, 1000)
    draws = {seed: [sample(logits, [make_request(temperature=1.0, seed=seed)])[0] for _ in range(3)] for seed in (1, 2)}
    assert len(set(draws[1])) == 1 and len(set(draws[2])) == 1
    many = {sample(logits, [make_request(num_prompt_tokens=n, temperature=1.0, seed=1)])[0] for n in range(1, 30)}
    assert len(many) > 5, "different positions must draw differently"


def test_sampling_follows_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().unsqueeze(0)
    counts = torch.zeros(3)
    for n in range(2000):
        counts[sample(logits, [make_request(num_prompt_tokens=1 + n % 50, temperature=1.0, seed=n)])[0]] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04)


def test_seeds_differing_in_the_high_bits_draw_differently():
    logits = torch.zeros(1, 1000)
    low, high = 5, 5 + 2**32
    draws = {s: [sample(logits, [make_request(num_prompt_tokens=n, temperature=1.0, seed=s)])[0] for n in range(1, 9)]
             for s in (low, high)}
    assert draws[low] != draws[high]
