"""Lexical guards against a paraphrase cache answering a different question (pure functions).

Sentence embeddings place "Is coffee bad for you?" and "Is coffee not bad for you?" closer together
(cosine 0.98 with all-MiniLM-L6-v2) than many true paraphrases, and "12 times 7" near "12 times 8"
(GPTCache issue #694 is this failure in production). A semantic hit is therefore only allowed when both
texts carry the same numbers and the same number of negations; similarity decides only among texts
that pass. Antonyms ("good" / "bad") are not caught here: the threshold has to.
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*")
_NEGATIONS = frozenset(
    {"not", "no", "never", "none", "nobody", "nothing", "nowhere", "neither", "nor", "without", "cannot", "nope"}
)
_SMALL_NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
_NUMBER_WORDS = {word: value for value, word in enumerate(_SMALL_NUMBERS)}
_SCALE_WORDS = frozenset(
    {
        "thirty",
        "forty",
        "fifty",
        "sixty",
        "seventy",
        "eighty",
        "ninety",
        "hundred",
        "thousand",
        "million",
        "billion",
        "trillion",
        "half",
        "double",
        "twice",
        "triple",
    }
)


def signature(text: str) -> tuple[tuple[str, ...], int]:
    """The numbers in a text (sorted, as written or spelled) and how many negations it has."""
    numbers: list[str] = []
    negations = 0
    for token in _WORD.findall(text.lower()):
        if token[0].isdigit():
            numbers.append(token.replace(",", ""))
        elif token in _NUMBER_WORDS:
            numbers.append(str(_NUMBER_WORDS[token]))
        elif token in _SCALE_WORDS:
            numbers.append(token)
        elif token in _NEGATIONS or token.endswith("n't"):
            negations += 1
    return tuple(sorted(numbers)), negations


def compatible(a: str, b: str) -> bool:
    return signature(a) == signature(b)
