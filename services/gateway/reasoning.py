"""Reasoning content: the `<think> ... </think>` part of an answer (Qwen3, QwQ, DeepSeek-R1 and their
distillations) split from the rest, whole (split_reasoning) or as it streams (ReasoningStream), as vLLM's
--reasoning-parser does. The gateway's --reasoning-parser picks the rule:

- qwen3: reasoning only inside an explicit `<think> ... </think>` at the start of the answer (Qwen3 with
  enable_thinking false writes none, or an empty one, and all of its answer is content);
- deepseek_r1: the template opens `<think>` in the prompt, so the answer starts inside the reasoning, up to
  `</think>` (an opening tag the model writes anyway is dropped); an answer that never closes it is all reasoning.

Tool calls are parsed from the content only (tool_calls.py).
"""
from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    """Characters at the end of text that may begin tag (held back while streaming)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


def split_prefix(parser: str, text: str, final: bool) -> tuple[str, str, bool]:
    """(reasoning, content, decided) of text, an answer or its prefix so far; not decided: text may still become
    part of a tag (its tail is in neither while streaming; final: nothing is held back)."""
    start = len(text) - len(text.lstrip())
    if text.startswith(OPEN, start):
        start += len(OPEN)
    elif parser == "qwen3":
        opening = OPEN.startswith(text[start:]) and not final and start < len(text)
        return ("", "", False) if opening or not text.strip() and not final else ("", text, True)
    elif OPEN.startswith(text[start:]) and not final and start < len(text):
        return "", "", False
    else:
        start = 0
    end = text.find(CLOSE, start)
    if end == -1:
        hold = 0 if final else _held(text, CLOSE)
        return text[start : len(text) - hold], "", True
    return text[start:end], text[end + len(CLOSE) :].lstrip("\n"), True


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole answer -> (reasoning content or None when there is none, content)."""
    reasoning, content, _ = split_prefix(parser, text, final=True)
    return (reasoning.strip("\n") or None), content


class ReasoningStream:
    """An answer's text deltas in -> (reasoning delta, content delta) out; what it sends adds up to
    split_prefix's parts of the whole text (reasoning not stripped)."""

    def __init__(self, parser: str):
        self.parser, self.text = parser, ""
        self.reasoning_sent = self.content_sent = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content, _ = split_prefix(self.parser, self.text, final)
        out = (reasoning[self.reasoning_sent :], content[self.content_sent :])
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(content))
        return out
