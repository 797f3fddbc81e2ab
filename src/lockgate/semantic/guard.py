"""Lexical guards against a paraphrase cache answering a different question (pure functions).

Sentence embeddings place "Is coffee bad for you?" and "Is coffee not bad for you?" closer together
(cosine 0.98 with all-MiniLM-L6-v2) than many true paraphrases, and "12 times 7" near "12 times 8"
(GPTCache issue #694 is this failure in production). A semantic hit is therefore only allowed when both
texts carry the same numbers, in the same order and with the same signs ("7 minus 12" is not "12 minus 7", "-5"
is not "5"), and the same number of negations, however the apostrophe is typed (typographic, as phones and Macs
type it, or left out: "dont"); similarity decides only among texts that pass. Antonyms ("good" / "bad") are not
caught here: the threshold has to.
"""

from __future__ import annotations

import re

#: A number's minus sign: a hyphen or minus sign right before its digits, not after a word or a digit ("5-10" is
#: a range: 5 and 10).
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|(?<![\w.])[-\u2212]?\d+(?:[.,]\d+)*|\d+(?:[.,]\d+)*")
#: Apostrophes as keyboards type them (typographic right and left quotes, the modifier letters, primes, a backtick,
#: the acute accent European keyboards put there, the fullwidth one).
_APOSTROPHES = str.maketrans({c: "'" for c in "\u2019\u2018\u201b\u02bc\u02b9\u02bb\u2032\u2035`\u00b4\uff07"})
#: Any other mark between a negation's "n" and its "t" ("isn\u02bet"): an apostrophe too, whatever was typed.
_ODD_APOSTROPHE = re.compile(r"(?<=[a-z]n)[^a-z0-9\s'](?=t\b)")
#: A number grouped in thousands ("1,234,567"); other commas between digits separate numbers ("1,2,3"; a European
#: decimal "1,5" is then 1 and 5: never equal to 15).
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NEGATIONS = frozenset(
    {"not", "no", "never", "none", "nobody", "nothing", "nowhere", "neither", "nor", "without", "cannot", "nope"}
    # Contractions typed without their apostrophe.
    | {"dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "cant", "couldnt", "wouldnt", "shouldnt"}
    | {"wont", "hasnt", "havent", "hadnt", "aint", "mustnt", "neednt", "mightnt", "shant"}
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
    """The numbers in a text (in order, as written or spelled, with their signs) and how many negations it has."""
    numbers: list[str] = []
    negations = 0
    for token in _WORD.findall(_ODD_APOSTROPHE.sub("'", text.lower().translate(_APOSTROPHES))):
        if token[0].isdigit() or token[0] in "-\u2212":
            token = token.replace("\u2212", "-")
            if _THOUSANDS.fullmatch(token):
                numbers.append(token.replace(",", ""))
            else:
                numbers.extend(token.split(","))
        elif token in _NUMBER_WORDS:
            numbers.append(str(_NUMBER_WORDS[token]))
        elif token in _SCALE_WORDS:
            numbers.append(token)
        elif token in _NEGATIONS or token.endswith("n't"):
            negations += 1
    return tuple(numbers), negations


def compatible(a: str, b: str) -> bool:
    return signature(a) == signature(b)
