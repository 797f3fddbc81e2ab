"""Lexical guards against a paraphrase cache answering a different question (pure functions).

Sentence embeddings place "Is coffee bad for you?" and "Is coffee not bad for you?" closer together
(cosine 0.98 with all-MiniLM-L6-v2) than many true paraphrases, and "12 times 7" near "12 times 8"
(GPTCache issue #694 is this failure in production). A semantic hit is therefore only allowed when both
texts carry the same numbers, in the same order and with the same signs ("7 minus 12" is not "12 minus 7", "-5"
is not "5"), the same comparisons (`>`, `<=`, ...), arithmetic words, units and poles (before / after, ascending /
descending, maximum / minimum, ...) in the same order ("5 miles to km" is not "5 km to miles"), and the same number
of negations, in English however the apostrophe is typed (typographic, as phones and Macs type it, or left out:
"dont") and in the other languages the model reads most (French, Spanish, Portuguese, Italian, German, Dutch,
Russian); and the two must be a rewording (`reworded`), not the same words in another order nor the same text with a
word or two of substance changed (an outside run: "5 ounces to grams" / "5 grams to ounces", "tenth" / "ninth",
"legal" / "illegal", "adults" / "children" each served the other's answer at the default threshold). Similarity
decides only among texts that pass; antonyms within a longer rewording are left to the threshold.
"""

from __future__ import annotations

import difflib
import re
import unicodedata

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


#: Any one character that is not a letter, a digit or a space: symbols count as words here ("$", "€", "%", "-").
_TOKEN = re.compile(_WORD.pattern + r"|[^\w\s]")
#: Contractions spelled out, so that "what's" is "what is" and "isn't" is "is not" on both sides ("can't" and "won't"
#: first: the general rule left "ca" and "wo", and "I can't" differed from "I cannot").
_CONTRACTIONS = (
    (re.compile(r"\bcan't\b|\bcannot\b"), "can not"),
    (re.compile(r"\bwon't\b"), "will not"),
    (re.compile(r"\bshan't\b"), "shall not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"'s\b"), " is"),
    (re.compile(r"'re\b"), " are"),
    (re.compile(r"'m\b"), " am"),
    (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'ve\b"), " have"),
    (re.compile(r"'d\b"), " would"),
)
#: A dash or "and"/"to" between two numbers: a range ("5-10", "5 to 10", "5 and 10" alike).
_RANGE = re.compile(r"(?<=\d)\s*(?:-|\u2013|\bto\b|\band\b)\s*(?=\d)")
#: Words and marks a rewording adds, drops or swaps without changing the question: courtesy, "do" / "can" and the like,
#: articles and determiners, sentence punctuation (who, when and prepositions are substance: `_ROLES`, `_PREPOSITIONS`).
_FILLER = frozenset(
    {"please", "kindly", "thanks", "thank", "so", "much", "just", "hey", "hi", "hello", "quick", "question", "help"}
    | {"can", "could", "would", "do", "does", "is", "are", "am", "be", "it", "its"}
    | {"tell", "show", "explain", "give", "let", "know", "want"}
    | {"need", "like", "wonder", "wondering", "the", "a", "an", "this", "that", "there", "some", "any", "really"}
    | {"excuse", "sorry", "cheers", "appreciated", "advance"}
    | set(".,;:!?\"'()[]{}-\u2013\u2014\u2026")
)
#: Prepositions are substance (an outside run: "copy data to S3" / "from S3", "flights from Paris to London" / "to
#: Paris from London", "melatonin with alcohol" / "for alcohol" were served each other's answers), by their sense.
_PREPOSITIONS = {
    **dict.fromkeys(("to", "into", "toward", "towards", "onto"), "to"),
    **dict.fromkeys(("in", "inside", "within"), "in"),
    **{word: word for word in ("of", "for", "on", "at", "by", "with", "from", "about", "as", "out", "off")},
}
#: Who and when are substance too, by their sense (a third run: "Should I call you or should you call me?" / "Should
#: you call me or should I call you?", "Why did my order get cancelled?" / "Why will...", "Can I take ibuprofen while
#: pregnant?" / "Should I..." were served each other's answers); "how do I" and "how can I" stay one question.
_ROLES = {
    **dict.fromkeys(("i", "me", "my", "mine", "myself"), "i"),
    **dict.fromkeys(("we", "us", "our", "ours", "ourselves"), "we"),
    **dict.fromkeys(("you", "your", "yours", "yourself", "yourselves"), "you"),
    **dict.fromkeys(("did", "was", "were", "had"), "past"),
    **dict.fromkeys(("will", "shall"), "future"),
    **dict.fromkeys(("should", "must", "ought"), "should"),
}
#: "Tell me", "show me", ...: a courtesy, not the asker's role.
_ASKED = re.compile(r"\b(tell|show|give|let|help)\s+(?:me|us)\b")
#: A word at least this long is the same word without its plural ending, or with two neighbouring letters swapped.
_SPELLING_MIN = 4
#: Texts with more words than this are not compared word by word (no hit): the comparison's cost grows faster than
#: the square of the words (128 words repeating two: ~10 ms; 4,000 such took minutes), and a text the model reads
#: whole has at most its 128 tokens.
_MAX_WORDS = 128


def _content(text: str) -> list[str]:
    """A text's words that carry its question (`_FILLER` left out), contractions spelled out, negations as "not",
    units and poles by their label (`_POLES`), prepositions by their sense, numbers as "#", so that a rewording's are
    the same words. Characters the model's tokenizer drops (format characters such as a zero-width space, control
    characters, combining marks alone) are not words: an outside run padded a question with thousands of them, which
    the model read as the question and the comparison as thousands of words (139 s on the event loop)."""
    text = _ODD_APOSTROPHE.sub("'", text.lower().translate(_APOSTROPHES))
    for pattern, spelled in _CONTRACTIONS:
        text = pattern.sub(spelled, text)
    words: list[str] = []
    for token in _TOKEN.findall(_RANGE.sub(" ", _ASKED.sub(r"\1", text))):
        if token in _FILLER or (len(token) == 1 and unicodedata.category(token)[0] in "CMZ"):
            continue
        if token[0].isdigit() or (token[0] in "-\u2212" and len(token) > 1) or token in _NUMBER_WORDS:
            words.append("#")  # (the numbers themselves are the signature's: "1,000" is "1000", "twelve" 12)
        elif token in _PREPOSITIONS:
            words.append(_PREPOSITIONS[token])
        elif token in _ROLES:
            words.append(_ROLES[token])
        else:
            words.append("not" if token in _NEGATIONS else _POLES.get(token, token))
    return words


def _stem(word: str) -> str:
    """`word` without a plural ending ("rows" / "row"); other endings ("-ed", "-ing", "-e") may make another question
    of it ("plane" is not "plan", "cancelled" not "cancelling")."""
    for ending in ("es", "s"):
        if len(word) - len(ending) >= 3 and word.endswith(ending):
            return word[: -len(ending)]
    return word


def _same_word(a: str, b: str) -> bool:
    """A plural of one word ("row" / "rows") or a typo that swapped two neighbouring letters ("waht"): not a letter
    changed, added or dropped ("cats" / "bats", "plan" / "plane" are other words)."""
    if _stem(a) == _stem(b):
        return True
    if len(a) != len(b) or len(a) < _SPELLING_MIN:
        return False
    differ = [i for i in range(len(a)) if a[i] != b[i]]
    if len(differ) != 2 or differ[1] != differ[0] + 1:
        return False
    i, j = differ
    return a[i] == b[j] and a[j] == b[i]


def _rotated(a: list[str], b: list[str]) -> bool:
    """Whether `b` is `a` with a leading phrase moved to its end, or the reverse ("In Python, how do I reverse a list?"
    / "How do I reverse a list in Python?"): a rotation, which swaps no roles ("Alice owes Bob" / "Bob owes Alice")."""
    return len(a) >= 3 and len(a) == len(b) and any(a[k:] + a[:k] == b for k in range(1, len(a)))


def reworded(a: str, b: str) -> bool:
    """Whether `b` asks what `a` does in other words, as far as words tell (pure). Not when the two are the same words
    in another order ("Is Python faster than Java?" / "Is Java faster than Python?", "5 ounces to grams" / "5 grams
    to ounces", "x-y" / "y-x"; a phrase moved from the front to the end is a rewording), nor when they are the same
    text but for a word or two of substance ("the tenth digit" / "the ninth digit", "legal" / "illegal", "for adults" /
    "for children", "to S3" / "from S3"): an embedding puts such pairs closer together (0.93-0.99, an outside run, each
    served the other's answer at the default 0.92) than many true paraphrases. Courtesy, auxiliaries, articles and the
    like (`_FILLER`), a plural or a swap of neighbouring letters, and contractions spelled either way are not
    substance; a rewording of more than two words is left to the threshold. The cost, measured by an outside run on
    pairs of its own: most true paraphrases that change a word or two (synonyms, "how do I" / an imperative) miss."""
    words_a, words_b = _content(a), _content(b)
    if words_a == words_b:
        return True
    if max(len(words_a), len(words_b)) > _MAX_WORDS:
        return False
    if sorted(words_a) == sorted(words_b):
        return _rotated(words_a, words_b)  # else the same words in another order: roles or operands swapped
    matcher = difflib.SequenceMatcher(a=words_a, b=words_b, autojunk=False)
    dropped: list[str] = []
    added: list[str] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            dropped += words_a[i1:i2]
            added += words_b[j1:j2]
    for word in list(dropped):  # a typo or a plural is the same word
        twin = next((other for other in added if _same_word(word, other)), None)
        if twin is not None:
            dropped.remove(word)
            added.remove(twin)
    if not dropped and not added:
        return True
    kept = sum(block.size for block in matcher.get_matching_blocks())
    return not (len(dropped) <= 2 and len(added) <= 2 and kept >= 0.5 * max(len(words_a), len(words_b)))


def compatible(a: str, b: str) -> bool:
    """Whether a semantic hit may answer `b` with `a`'s answer: the same signature (numbers, units, poles, negations)
    and a rewording, not another question in the same words (`reworded`)."""
    return signature(a) == signature(b) and reworded(a, b)
