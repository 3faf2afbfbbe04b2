"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's NgramProposer): propose the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, n from prompt_lookup_max down to
prompt_lookup_min. Costs no model call: it pays on outputs that copy from the prompt or repeat themselves
(code edits, extraction, summaries quoting the text)."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, "
                             f"{prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens draft token ids to follow token_ids (prompt + output so far); [] without a match.

        The longest n wins; among its matches, the latest (the nearest context). A match never overlaps the
        suffix itself, so the proposal is what followed an earlier occurrence."""
        total = len(token_ids)
        if num_tokens <= 0 or total <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [total - n, n]: earlier n-grams
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start : start + num_tokens].tolist()
        return []
