"""Lexical guards against a paraphrase cache answering a different question (pure functions).

Sentence embeddings place "Is coffee bad for you?" and "Is coffee not bad for you?" closer together
(cosine 0.98 with all-MiniLM-L6-v2) than many true paraphrases, and "12 times 7" near "12 times 8"
(GPTCache issue #694 is this failure in production). A semantic hit is therefore only allowed when both
texts carry the same numbers, in the same order and with the same signs ("7 minus 12" is not "12 minus 7", "-5"
is not "5"), the same comparisons (`>`, `<=`, ...), arithmetic words, units and poles (before / after, ascending /
descending, maximum / minimum, ...) in the same order ("5 miles to km" is not "5 km to miles"), and the same number
of negations, in English however the apostrophe is typed (typographic, as phones and Macs type it, or left out:
"dont") and in the other languages the model reads most (French, Spanish, Portuguese, Italian, German, Dutch,
Russian); similarity decides only among texts that pass. Other antonyms ("good" / "bad") are not caught here: the
threshold has to.
"""

from __future__ import annotations

import re

#: A number's minus sign: a hyphen or minus sign right before its digits, not after a word or a digit ("5-10" is
#: a range: 5 and 10).
_WORD = re.compile(
    r"[^\W\d_]+(?:'[^\W\d_]+)?|(?<![\w.])[-\u2212]?\d+(?:[.,]\d+)*|\d+(?:[.,]\d+)*|[<>!=]=|[<>\u2264\u2265\u2260]|\u00b0[cf]"
)
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
    # French, Spanish, Portuguese, Italian, German, Dutch, Russian (an outside run: "n'est pas bon" was served the
    # answer of "est bon"); a French "n'" elision counts too.
    | {"ne", "pas", "jamais", "aucun", "aucune", "rien", "sans", "non", "nunca", "nada", "ninguno", "ninguna"}
    | {"ningún", "sin", "tampoco", "não", "nenhum", "nenhuma", "sem", "mai", "niente", "nessuno", "senza", "nicht"}
    | {"kein", "keine", "keinen", "keinem", "keiner", "keines", "nie", "niemals", "nichts", "ohne", "niet", "geen"}
    | {"nooit", "niets", "zonder", "не", "нет", "ни", "никогда", "ничего", "без"}
)
#: Words whose swap turns a question into another, by the label they count as (in order, with the numbers).
_POLES = {
    **dict.fromkeys(("before", "earlier", "prior"), "before"),
    **dict.fromkeys(("after", "later"), "after"),
    **dict.fromkeys(("above", "over"), "above"),
    **dict.fromkeys(("below", "under", "beneath"), "below"),
    **dict.fromkeys(("ascending", "increasing", "increase", "increases", "rise", "rises"), "up"),
    **dict.fromkeys(("descending", "decreasing", "decrease", "decreases", "fall", "falls"), "down"),
    **dict.fromkeys(("uppercase", "upper"), "upper"),
    **dict.fromkeys(("lowercase", "lower"), "lower"),
    **dict.fromkeys(("maximum", "max", "largest", "biggest", "highest", "most"), "max"),
    **dict.fromkeys(("minimum", "min", "smallest", "lowest", "least"), "min"),
    **dict.fromkeys(("more", "greater", "larger", "bigger", "higher"), "more"),
    **dict.fromkeys(("less", "fewer", "smaller"), "less"),
    **dict.fromkeys(("first", "oldest"), "first"),
    **dict.fromkeys(("last", "newest", "latest"), "last"),
    **dict.fromkeys(("plus", "add", "added", "sum"), "+"),
    **dict.fromkeys(("minus", "subtract", "subtracted", "difference"), "-"),
    **dict.fromkeys(("times", "multiplied", "multiply", "product"), "*"),
    **dict.fromkeys(("divided", "divide", "quotient"), "/"),
    **dict.fromkeys(("km", "kilometer", "kilometers", "kilometre", "kilometres"), "km"),
    **dict.fromkeys(("mile", "miles", "mi"), "mile"),
    **dict.fromkeys(("kg", "kilogram", "kilograms", "kilo", "kilos"), "kg"),
    **dict.fromkeys(("lb", "lbs", "pound", "pounds"), "lb"),
    **dict.fromkeys(("celsius", "°c", "centigrade"), "°c"),
    **dict.fromkeys(("fahrenheit", "°f"), "°f"),
    **dict.fromkeys(("meter", "meters", "metre", "metres"), "m"),
    **dict.fromkeys(("foot", "feet", "ft"), "ft"),
    **dict.fromkeys(("cm", "centimeter", "centimeters", "centimetre", "centimetres"), "cm"),
    **dict.fromkeys(("inch", "inches"), "inch"),
    **dict.fromkeys(("liter", "liters", "litre", "litres"), "l"),
    **dict.fromkeys(("gallon", "gallons"), "gal"),
    **dict.fromkeys(("usd", "dollar", "dollars"), "usd"),
    **dict.fromkeys(("eur", "euro", "euros"), "eur"),
    **{op: op for op in ("<", ">", "<=", ">=", "!=", "==")},
    "\u2264": "<=",
    "\u2265": ">=",
    "\u2260": "!=",
}
#: A unit written as one letter right after a number ("100 F in C"): the temperature scales.
_LETTER_UNITS = {"c": "°c", "f": "°f"}
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
    """The numbers in a text (in order, as written or spelled, with their signs), with its comparisons, arithmetic
    words, units and poles among them in their order (`_POLES`), and how many negations it has."""
    numbers: list[str] = []
    negations = 0
    after_number = False
    for token in _WORD.findall(_ODD_APOSTROPHE.sub("'", text.lower().translate(_APOSTROPHES))):
        number = False
        if token[0].isdigit() or (token[0] in "-\u2212" and len(token) > 1):
            token = token.replace("\u2212", "-")
            if _THOUSANDS.fullmatch(token):
                numbers.append(token.replace(",", ""))
            else:
                numbers.extend(token.split(","))
            number = True
        elif token in _NUMBER_WORDS:
            numbers.append(str(_NUMBER_WORDS[token]))
            number = True
        elif token in _SCALE_WORDS:
            numbers.append(token)
            number = True
        elif token in _POLES:
            numbers.append(_POLES[token])
        elif after_number and token in _LETTER_UNITS:
            numbers.append(_LETTER_UNITS[token])
        elif token in _NEGATIONS or token.endswith("n't") or token.startswith("n'"):
            negations += 1
        after_number = number
    return tuple(numbers), negations


def compatible(a: str, b: str) -> bool:
    return signature(a) == signature(b)
