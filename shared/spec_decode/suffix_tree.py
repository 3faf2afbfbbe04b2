"""A suffix tree of bounded depth with counts over token sequences, the index of suffix decoding (Oliveira et al.
2024, "SuffixDecoding", arXiv 2411.04975; ArcticInference's suffix tree is the reference design).

Every suffix of every indexed sequence, cut at max_depth tokens, is a path from the root, and each node counts
the suffixes that pass through it: the occurrences of its string in the indexed text. speculate() matches the
longest suffix of a context that occurred with a continuation, then follows the most frequent children while
the path's empirical probability stays at or above a threshold.

Memory: a path that only one suffix follows is not built node by node. Its first node is a leaf that refers to
that suffix (its `owner`): the suffix's own tokens continue it. A second suffix that reaches such a leaf builds
one node of it ("bursts" it) and moves the owner down to a new leaf. So nodes exist for strings that occur at
least twice, plus one leaf per suffix: O(tokens) nodes for text that does not repeat, at most O(tokens x
max_depth) for text that does. Appending a token grows each of the sequence's suffixes that is still shorter than
max_depth, and growing a suffix that owns its leaf costs nothing: O(max_depth) per token, amortized.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass


class _Node:
    __slots__ = ("token", "count", "children", "owner")

    def __init__(self, token: int | None, count: int = 0, owner: _Suffix | None = None):
        self.token = token  # the last token of its path
        self.count = count  # suffixes passing through (occurrences of the path's string)
        # None, the only child (most nodes: no dict for them), or {token: child} for several
        self.children: _Node | dict[int, _Node] | None = None
        self.owner = owner  # a leaf with count 1: the rest of owner's tokens continue its path

    def child(self, token: int) -> _Node | None:
        children = self.children
        if type(children) is _Node:
            return children if children.token == token else None
        return children.get(token) if children else None

    def add_child(self, child: _Node) -> None:
        children = self.children
        if children is None:
            self.children = child
        elif type(children) is _Node:
            self.children = {children.token: children, child.token: child}
        else:
            children[child.token] = child

    def remove_child(self, token: int) -> None:
        children = self.children
        if type(children) is _Node:
            self.children = None
        else:
            del children[token]
            if len(children) == 1:
                self.children = next(iter(children.values()))


class _Suffix:
    """The suffix of tokens from start, indexed up to min(start + max_depth, len(tokens)) tokens; depth: the
    tokens from the root to where its indexed part ends, or to the leaf it owns (the rest follows from its
    tokens); node: that node while the suffix can still grow, then None.

    NOTE: a growing suffix and its leaf refer to each other; node goes to None once it stops (it reached
    max_depth, or close()), so that no cycle outlives it and a dropped tree is freed at once, without waiting
    for the garbage collector (whose full passes then cost milliseconds per step in a big process)."""

    __slots__ = ("tokens", "start", "node", "depth")

    def __init__(self, tokens: list[int], start: int, node: _Node):
        self.tokens, self.start, self.node, self.depth = tokens, start, node, 0


class _Sequence:
    __slots__ = ("tokens", "growing")

    def __init__(self):
        self.tokens: list[int] = []
        self.growing: deque[_Suffix] = deque()  # its suffixes still shorter than max_depth, by start


@dataclass(frozen=True, slots=True)
class Draft:
    """A proposal: token_ids; match_len: the context's tokens matched; score: the sum of the drafts' path
    probabilities (the tokens expected to be accepted, by the indexed text's counts)."""

    token_ids: list[int]
    match_len: int
    score: float


NO_DRAFT = Draft([], 0, 0.0)


class SuffixTree:
    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be at least 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(None)
        self.sequences: dict[Hashable, _Sequence] = {}
        self.num_nodes = 1  # the root included
        self.num_tokens = 0  # indexed, over every sequence

    def tokens(self, seq_id: Hashable) -> list[int]:
        """The tokens indexed for seq_id (the tree's own list: do not change it)."""
        return self.sequences[seq_id].tokens

    def extend(self, seq_id: Hashable, token_ids: list[int]) -> None:
        """Append token_ids to sequence seq_id (a new one if unknown) and index them. O(len(token_ids) *
        max_depth) at most; O(len(token_ids)) when they repeat nothing indexed."""
        seq = self.sequences.get(seq_id)
        if seq is None:
            seq = self.sequences[seq_id] = _Sequence()
        tokens = seq.tokens
        old = len(tokens)
        tokens.extend(token_ids)
        self.num_tokens += len(tokens) - old
        for suffix in seq.growing:
            self._grow(suffix)
        for start in range(old, len(tokens)):
            suffix = _Suffix(tokens, start, self.root)
            self._grow(suffix)
            seq.growing.append(suffix)
        while seq.growing and seq.growing[0].start + self.max_depth <= len(tokens):
            seq.growing.popleft().node = None  # (its leaf, if any, keeps it)

    def close(self, seq_id: Hashable) -> None:
        """seq_id gets no more tokens (it stays indexed)."""
        growing = self.sequences[seq_id].growing
        for suffix in growing:
            suffix.node = None
        growing.clear()

    def _grow(self, suffix: _Suffix) -> None:
        """Index suffix up to min(start + max_depth, len(tokens)), from where its indexed part ends now."""
        node = suffix.node
        if node.owner is suffix:
            return  # its own leaf: the new tokens continue it
        tokens, start = suffix.tokens, suffix.start
        end = min(start + self.max_depth, len(tokens))
        pos = start + suffix.depth
        while pos < end:
            child = node.child(tokens[pos])
            if child is None:
                child = _Node(tokens[pos], 1, suffix)
                node.add_child(child)
                self.num_nodes += 1
                suffix.node, suffix.depth = child, pos + 1 - start
                return
            if child.owner is not None:
                self._burst(child)
            child.count += 1
            node = child
            pos += 1
        suffix.node, suffix.depth = node, pos - start

    def _burst(self, leaf: _Node) -> None:
        """A second suffix reaches leaf: build its owner's next node (a new leaf of the owner) if the owner goes
        on past it."""
        owner = leaf.owner
        leaf.owner = None
        pos = owner.start + owner.depth
        if pos < min(owner.start + self.max_depth, len(owner.tokens)):
            leaf.children = _Node(owner.tokens[pos], 1, owner)
            self.num_nodes += 1
            owner.depth += 1
            if owner.node is not None:  # (still growing)
                owner.node = leaf.children
        # else the owner's indexed part ends at leaf, now a plain node: it grows from there if its tokens do

    def remove(self, seq_id: Hashable) -> None:
        """Forget a sequence: every suffix's counts come off its path, and nodes left with none go."""
        self.close(seq_id)
        tokens = self.sequences.pop(seq_id).tokens
        n = len(tokens)
        self.num_tokens -= n
        for start in range(n):
            node, end = self.root, min(start + self.max_depth, n)
            for pos in range(start, end):
                child = node.child(tokens[pos])
                if child.owner is not None or child.count == 1:  # this suffix's alone from here down
                    node.remove_child(tokens[pos])
                    self.num_nodes -= self._path_size(child, tokens, pos + 1, end)
                    break
                child.count -= 1
                node = child

    @staticmethod
    def _path_size(node: _Node, tokens: list[int], pos: int, end: int) -> int:
        """Nodes from node down the path of tokens[pos:end] (a subtree that one suffix alone passes through)."""
        size = 1
        while node.owner is None and node.children and pos < end:
            node = node.child(tokens[pos])
            pos += 1
            size += 1
        return size

    # -- speculation -------------------------------------------------------------------------------------------
    def _walk(self, context: list[int], start: int) -> tuple[_Node, int] | None:
        """Where context[start:] leads from the root: (the last node, the tokens matched past it in its owner's
        tokens when it is a leaf), or None when the text never has it."""
        node, pos, end = self.root, start, len(context)
        while pos < end:
            owner = node.owner
            if owner is not None:
                at = owner.start + owner.depth
                if owner.tokens[at : at + end - pos] != context[pos:end]:
                    return None
                return node, end - pos
            child = node.child(context[pos])
            if child is None:
                return None
            node, pos = child, pos + 1
        return node, 0

    def count(self, pattern: list[int]) -> int:
        """Occurrences of pattern (1 to max_depth tokens) in the indexed text."""
        if not 1 <= len(pattern) <= self.max_depth:
            raise ValueError(f"count takes 1 to {self.max_depth} tokens, got {len(pattern)}")
        at = self._walk(pattern, 0)
        return 0 if at is None else at[0].count

    @staticmethod
    def _has_next(node: _Node, extra: int) -> bool:
        owner = node.owner
        if owner is not None:
            return owner.start + owner.depth + extra < len(owner.tokens)
        return bool(node.children)

    def match(self, context: list[int], max_len: int) -> tuple[int, tuple[_Node, int] | None]:
        """The longest suffix of context, at most max_len tokens, that occurs in the text with a token after it:
        (its length, where it ends), (0, None) without one. A binary search: a string that occurs with a
        continuation has every suffix of it occur so too."""
        lo, hi, found = 0, min(max_len, len(context), self.max_depth - 1), None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            at = self._walk(context, len(context) - mid)
            if at is not None and self._has_next(*at):
                lo, found = mid, at
            else:
                hi = mid - 1
        return lo, found

    def speculate(self, context: list[int], max_spec_tokens: int, max_pattern_len: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """Draft tokens to follow context (SuffixDecoding's path speculation): match the longest suffix of
        context (at most max_pattern_len tokens) that occurs with a continuation, then take the most frequent
        child (the latest-added among equals) while the product of the steps' empirical probabilities (a child's
        count over its siblings' total) stays at least min_token_prob; at most min(max_spec_tokens,
        int(max_spec_factor * match length)) tokens. Past a leaf the path continues its one occurrence's tokens
        (probability 1 each), also beyond max_depth."""
        match_len, at = self.match(context, max_pattern_len)
        num_tokens = min(max_spec_tokens, int(max_spec_factor * match_len))
        if at is None or num_tokens <= 0:
            return Draft([], match_len, 0.0)
        node, extra = at
        token_ids: list[int] = []
        prob, score = 1.0, 0.0
        while len(token_ids) < num_tokens:
            owner = node.owner
            if owner is not None:
                at_pos = owner.start + owner.depth + extra
                rest = owner.tokens[at_pos : at_pos + num_tokens - len(token_ids)]
                token_ids += rest
                score += prob * len(rest)
                break
            children = node.children
            if children is None:
                break
            if type(children) is _Node:
                best, total = children, children.count
            else:
                best, total = None, 0
                for child in children.values():
                    total += child.count
                    if best is None or child.count >= best.count:
                        best = child
            prob *= best.count / total
            if prob < min_token_prob:
                break
            token_ids.append(best.token)
            score += prob
            node = best
        return Draft(token_ids, match_len, score)
