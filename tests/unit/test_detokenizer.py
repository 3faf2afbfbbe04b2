from tandem.services.gateway.detokenizer import TextStream


def stream_all(tokenizer, ids, stop=()):
    text = TextStream(tokenizer, stop)
    deltas = [text.push([t]) for t in ids]
    deltas.append(text.finish())
    return deltas, text


def test_deltas_concatenate_to_full_decode_and_never_split_a_character(tokenizer):
    for s in ("Hello, world! Ça va? 北京是中国的首都。🙂 done", "emoji 🎉🎉 and 日本語"):
        ids = tokenizer(s, add_special_tokens=False).input_ids
        deltas, _ = stream_all(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids)
        assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_leaks(tokenizer):
    ids = tokenizer("The answer is 42. END of story, more text", add_special_tokens=False).input_ids
    deltas, text = stream_all(tokenizer, ids, stop=("END",))
    assert "".join(deltas) == "The answer is 42. "
    assert text.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer("alpha beta gamma delta", add_special_tokens=False).input_ids
    deltas, _ = stream_all(tokenizer, ids, stop=("delta", "beta"))
    assert "".join(deltas) == "alpha "
