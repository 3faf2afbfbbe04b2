"""GrammarMatcher and the bitmask (shared/structured_output.py) with the real llguidance and the default model's
tokenizer: masks per draft row, rollback, the grammar's end, and apply_bitmask against a direct mask."""
import pytest
import torch

from tandem.shared.errors import InvalidRequestError
from tandem.shared.request import StructuredOutputParams
from tandem.shared.structured_output import StructuredOutputManager, apply_bitmask


@pytest.fixture(scope="module")
def manager(model_config):
    return StructuredOutputManager(model_config.path, model_config.vocab_size, model_config.eos_token_ids)


def allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def full_bitmask(rows: int, vocab: int) -> torch.Tensor:
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def test_bitmask_rows_follow_the_drafts_and_leave_the_state(manager, tokenizer, model_config):
    vocab = model_config.vocab_size
    grammar = manager.matcher(StructuredOutputParams(choice=("yes please", "no thanks")))
    yes, please = tokenizer.encode("yes")[0], tokenizer.encode(" please")[0]
    bitmask = full_bitmask(3, vocab)
    grammar.fill_bitmask(bitmask, [yes, please])
    first, second, third = (allowed(bitmask[i], vocab) for i in range(3))
    assert yes in first and please not in first
    assert please in second and yes not in second
    assert third == set(model_config.eos_token_ids)  # complete: only EOS may follow
    assert grammar.num_valid([yes, please]) == 2  # rolled back: the state is the initial one
    eos = model_config.eos_token_ids[0]
    past_eos = full_bitmask(5, vocab)
    grammar.fill_bitmask(past_eos, [yes, please, eos, yes])  # (an EOS consumed would not roll back cleanly)
    assert allowed(past_eos[2], vocab) == third and bool((past_eos[3:] == -1).all())
    assert grammar.num_valid([yes, please, eos]) == 3
    refused = full_bitmask(3, vocab)
    grammar.fill_bitmask(refused, [please, yes])  # a refused first draft: later rows stay unmasked
    assert allowed(refused[0], vocab) == first and bool((refused[1:] == -1).all())
    assert not grammar.accept(yes) and grammar.accept(please)  # complete after "yes please"
    with pytest.raises(ValueError, match="violates the grammar"):
        grammar.accept(yes)


def test_apply_bitmask_masks_refused_tokens_and_the_grammar_wins_over_min_tokens():
    vocab = 70
    bitmask = full_bitmask(2, vocab)
    bitmask[0, 0] = 0b101  # row 0: tokens 0 and 2 of the first word, then all of the rest
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 3  # row 1: token 67 only
    raw = torch.randn(2, vocab)
    processed = raw.clone()
    processed[1, 67] = float("-inf")  # (min_tokens masked the one token the grammar allows)
    apply_bitmask(processed, bitmask, raw)
    expected0 = raw[0].clone()
    expected0[[t for t in range(32) if t not in (0, 2)]] = float("-inf")
    assert torch.equal(processed[0], expected0)
    assert torch.isinf(processed[1]).sum() == vocab - 1 and processed[1, 67] == raw[1, 67]


def test_bad_constraints_raise_invalid_request(manager):
    for params in (StructuredOutputParams(regex="(unclosed"), StructuredOutputParams(json='{"type": "foo"}'),
                   StructuredOutputParams(grammar="start: nothing_here")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="structured_output"):
            manager.matcher(params)
    # a constraint no text satisfies is refused up front (not answered as an empty STOP)
    for regex in ("a[^\\x00-\\U0010FFFF]b", "[^\\x00-\\U0010FFFF]"):
        with pytest.raises(InvalidRequestError, match="matches no text"):
            manager.matcher(StructuredOutputParams(regex=regex))
    assert manager.matcher(StructuredOutputParams(regex="")).matcher.is_accepting()  # (the empty text is one)


def test_choices_are_literal_and_not_limited_to_2000(manager, tokenizer):
    """Choice text is never regex syntax, and 5,000 choices work (a Lark alternation stops at 2,000 rows)."""
    choices = ("a.b", "x|y", "(1+2)*3?", "[ok]", "c:\\path", "^$", "#t & ~t-d", "日本 😀") + tuple(
        f"option {i}" for i in range(5000))
    for text, allowed in (("x|y", True), ("(1+2)*3?", True), ("a+b", False), ("x", True), ("option 4999", True),
                          ("option 5000", False)):  # fmt: skip
        ids = tokenizer(text, add_special_tokens=False).input_ids
        grammar = manager.matcher(StructuredOutputParams(choice=choices))
        assert (grammar.num_valid(ids) == len(ids)) == allowed, text
    for kwargs in ({}, {"regex": "a", "choice": ("b",)}, {"json": "[1]"}, {"json": "{"}, {"choice": ()}):
        with pytest.raises(InvalidRequestError, match="structured_output"):
            StructuredOutputParams(**kwargs)
