"""Prompts the fidelity tests share: chat and raw, English and Chinese, one longer than 300 tokens."""

LONG_TEXT = (
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were used to print "
    "cloth and paper in East Asia for centuries, and movable type made of baked clay appeared in China in the "
    "eleventh century. In Korea, metal movable type was used to print Buddhist texts more than seventy years "
    "before the famous Bible was produced in Mainz. What changed in fifteenth-century Europe was the "
    "combination of several technologies at once: an adjustable hand mould that made uniform metal type "
    "quickly, an oil-based ink that stuck to metal, and a screw press adapted from the ones used to make wine "
    "and olive oil. Together these made printing fast and cheap enough that books spread across the continent "
    "within a few decades. Printers set up shops in Venice, Paris, Basel and London, and by 1500 millions of "
    "copies had been made. Scholars could now compare identical texts, errors could be corrected in later "
    "editions, and ideas travelled faster than ever before. Governments and churches tried to control what was "
    "printed, but pamphlets and broadsheets kept appearing. Literacy slowly rose as books became affordable, "
    "and vernacular languages gained standard spellings because printers needed consistent forms. Some "
    "historians argue that the scientific revolution and the reformation both depended on this new way of "
    "copying words. Others point out that manuscript culture continued for a long time and that printing "
    "changed society gradually rather than all at once. Either way, the press is one of the clearest examples "
    "of a technology whose effects reached far beyond its original purpose."
)

# (name, kind, text): kind "chat" uses the chat template, "raw" sends the text as is.
PROMPTS = [
    ("capital", "chat", "What is the capital of France?"),
    ("haiku", "chat", "Write a haiku about the sea."),
    ("chinese_chat", "chat", "请用中文介绍一下长城。"),
    ("raw_story", "raw", "Once upon a time, in a small village by the mountains,"),
    ("raw_chinese", "raw", "北京是中国的首都，它有很多"),
    ("long_summary", "chat", "Summarize the following text in two sentences.\n\n" + LONG_TEXT),
]


def prompt_token_ids(tokenizer, kind: str, text: str) -> list[int]:
    """Token ids exactly as the gateway builds them."""
    if kind == "chat":
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  return_dict=False))  # fmt: skip
    return tokenizer(text, add_special_tokens=False).input_ids
