"""An instance's credentials scrubbed out of what its engine says (`lockgate.credentials`)."""

from __future__ import annotations

import orjson

from lockgate.credentials import WITHHELD, Credentials


def test_an_exact_copy_is_redacted_and_any_other_form_withholds_the_message() -> None:
    creds = Credentials(["SECRETKEY-abc123", "pw12"])
    assert creds.scrub(b'{"error": {"message": "bad key Bearer SECRETKEY-abc123"}}') == (
        b'{"error": {"message": "bad key Bearer [redacted]"}}'
    )
    for form in ("secretkey-abc123", "SECRETKEY%2Dabc123", "SECRETKEY-abc\\u0031\\u0032\\u0033"):
        body = b'{"error": {"message": "bad key %s"}}' % form.encode()
        assert orjson.loads(creds.scrub(body))["error"]["message"] == WITHHELD, form
    assert creds.scrub_text("bad key secretkey-abc123") == WITHHELD
    # A short credential is redacted where it is exact, but not looked for in other forms (it would withhold every
    # message holding the same word).
    assert creds.scrub_text("PW12 pw12") == "PW12 [redacted]"
    assert not Credentials([]) and Credentials([]).scrub(b"anything") == b"anything"
    assert not Credentials(["abc", ""]) and Credentials(["abc"]).scrub_text("abc") == "abc"  # under 4: not looked for


def test_odd_bodies_never_raise() -> None:
    """A body nested deeper than orjson writes back (it reads 1,024 levels, writes 254), lone surrogates: a scrub that
    raised turned an engine's 400 into the gateway's own 500, its failure unreported (a code review)."""
    creds = Credentials(["SECRETKEY-abc123"])
    deep = b"[" * 300 + b"]" * 300
    assert creds.scrub(deep) == deep
    assert creds.scrub(b"[" * 300 + b'"SECRETKEY-abc\\u0031"' + b"]" * 300).startswith(b'{"error"')  # withheld
    assert creds.scrub_text("odd \ud800 text") == "odd ? text"
    assert creds.scrub(b"\xff\xfe not utf-8") == b"\xff\xfe not utf-8"


def test_a_base64_copy_at_any_alignment_or_escapes_written_out_withhold_the_message() -> None:
    """An outside run got an engine's credential through in base64 (`bad RmFrZUVuZ2luZUtleS1YWVo5ODc2NQ==`) and with a
    JSON escape written out as text (`FakeEngineKey\\u002dXYZ98765`, which a client reading it as JSON decodes)."""
    import base64

    secret = "FakeEngineKey-XYZ98765?>"  # (`?>` gives `/` and `+` in base64: both alphabets are looked for)
    creds = Credentials([secret])
    for before in ("", "x", "xy", "bad "):
        plain = (before + secret + " trailing").encode()
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            text = "token " + encode(plain).decode()
            assert creds.scrub_text(text) == WITHHELD, (before, encode)
    escaped = secret.replace("-", "\\u002d")
    assert creds.scrub_text(f"bad key {escaped}") == WITHHELD
    assert creds.scrub(orjson.dumps({"error": {"message": f"bad key {escaped}"}})).startswith(b'{"error"')
    assert (
        "withheld"
        in orjson.loads(creds.scrub(orjson.dumps({"error": {"message": f"bad key {escaped}"}})))["error"]["message"]
    )
    # Other base64 text (another key) goes through.
    assert creds.scrub_text("token " + base64.b64encode(b"another key entirely").decode()).startswith("token ")
