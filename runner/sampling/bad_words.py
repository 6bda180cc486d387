"""Words a request must not generate (vLLM's `bad_words`), as token sequences: a sequence's last token is banned
wherever the output so far ends with the rest of it, so the whole sequence never appears in the output.

A word is tokenized as it would start the text and as it would follow a space (" word", a different token in most
vocabularies), as vLLM does; vLLM keeps the second form only when it has as many tokens as the first, here every
distinct form is banned. Only the generated tokens count, not the prompt's (vLLM's rule too)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class BadWords:
    def __init__(self, words: list[str], encode: Callable[[str], list[int]]) -> None:
        """`encode`: text -> token ids without special tokens."""
        sequences = set()
        for word in words:
            for form in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(encode(form))
                if ids:
                    sequences.add(ids)
        self.sequences = sorted(sequences)

    def banned(self, output_token_ids: list[int]) -> list[int]:
        """Tokens that would complete a bad word after `output_token_ids`."""
        banned = []
        for sequence in self.sequences:
            prefix = len(sequence) - 1
            if prefix > len(output_token_ids):
                continue
            if prefix == 0 or tuple(output_token_ids[-prefix:]) == sequence[:-1]:
                banned.append(sequence[-1])
        return banned

    def allowed(self, output_token_ids: list[int], vocab_size: int) -> np.ndarray:
        """[vocab_size] bool: every token but those `banned` after `output_token_ids`."""
        allowed = np.ones(vocab_size, bool)
        allowed[self.banned(output_token_ids)] = False
        return allowed

    def draft_prefix(self, output_token_ids: list[int], tokens: list[int]) -> list[int]:
        """The longest prefix of a draft that completes no bad word after `output_token_ids`."""
        taken: list[int] = []
        for token in tokens:
            if token in self.banned(output_token_ids + taken):
                break
            taken.append(int(token))
        return taken

    def tree_masks(
        self, output_token_ids: list[int], tokens: list[int], parents: list[int], vocab_size: int
    ) -> np.ndarray:
        """[nodes, vocab_size] bool: the tokens allowed after each node of a draft tree whose root is the last
        output token."""
        paths: list[list[int]] = [[]]  # each node's tokens after the root
        for node in range(1, len(tokens)):
            paths.append(paths[parents[node]] + [int(tokens[node])])
        return np.stack([self.allowed(output_token_ids + path, vocab_size) for path in paths])
