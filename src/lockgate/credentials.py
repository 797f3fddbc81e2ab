"""The credentials the gateway sends one engine, and their removal from what that engine says.

Some engines and proxies repeat the `Authorization` they got in an error ("Incorrect API key provided: Bearer
..."): the gateway passes engines' errors on to clients and into usage records, so each instance scrubs its own
credentials (its `api_key`; its URL's password, as written, decoded and inside the Basic credential) out of them.
An exact copy becomes `[redacted]` (the rest of the message stays useful); a copy in any other form an outside run
got through (another case, percent-encoded, JSON `\\u` escapes, even written out literally, base64 at any alignment)
withholds the whole text, for credentials of 8 characters or more, as nothing finer can be trusted to catch it. A
partial copy (a provider's own mask: the first and last few characters) is not caught.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from urllib.parse import unquote

import orjson

REDACTED = b"[redacted]"
#: The shortest credential looked for at all, and in other forms than its exact copy.
EXACT_MIN = 4
FOLDED_MIN = 8
#: What stands for an engine's message that held a credential in a form exact replacement does not catch.
WITHHELD = "[the engine's message was withheld: it repeated the gateway's credential for it]"
_WITHHELD_BODY = orjson.dumps({"error": {"message": WITHHELD, "type": "upstream_error"}})


#: A JSON `\\u` escape written out as text (an engine's message that escaped its own text before quoting it).
_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


def _base64_cores(secret: bytes) -> tuple[str, ...]:
    """What base64 text holding `secret` holds whatever its alignment: for each of the three offsets at which it may
    begin in the encoded bytes, the characters that depend on it alone (standard and URL-safe alphabets)."""
    cores = []
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + secret).decode().rstrip("=")
        start = (pad * 4 + 2) // 3  # characters that also hold the padding
        end = len(encoded) - (1 if (pad + len(secret)) % 3 else 0)  # a last one that holds what follows
        core = encoded[start:end]
        cores += [core, core.replace("+", "-").replace("/", "_")]
    return tuple(dict.fromkeys(cores))


class Credentials:
    __slots__ = ("_base64", "_exact", "_folded")

    def __init__(self, secrets: Iterable[str]) -> None:
        # Those under 4 characters are left out (too short to tell from other text); the longest first (one that
        # holds another is replaced whole).
        found = sorted({s for s in secrets if len(s) >= EXACT_MIN}, key=len, reverse=True)
        self._exact = tuple(s.encode() for s in found)
        # (Not the short ones in other forms: a 4-character key would withhold every message holding that word.)
        self._folded = tuple(s.lower() for s in found if len(s) >= FOLDED_MIN)
        self._base64 = tuple(core for s in found if len(s) >= FOLDED_MIN for core in _base64_cores(s.encode()))

    def __bool__(self) -> bool:
        return bool(self._exact)

    def scrub(self, data: bytes) -> bytes:
        """An engine's answer (an error body) without the credentials: exact copies redacted; an OpenAI error body
        saying `WITHHELD` if a copy in another form remains."""
        if not self._exact:
            return data
        data = self._replaced(data)
        return _WITHHELD_BODY if self._hidden_in(data.decode("utf-8", "replace")) else data

    def scrub_text(self, text: str) -> str:
        """An engine's message (already decoded) without the credentials; `WITHHELD` if a copy in another form
        remains."""
        if not self._exact:
            return text
        text = self._replaced(text.encode("utf-8", "replace")).decode("utf-8", "replace")  # (lone surrogates too)
        return WITHHELD if self._hidden_in(text) else text

    def _replaced(self, data: bytes) -> bytes:
        for secret in self._exact:
            if secret in data:
                data = data.replace(secret, REDACTED)
        return data

    def _hidden_in(self, text: str) -> bool:
        if any(core in text for core in self._base64):
            return True
        forms = {text.lower(), unquote(text).lower()}
        if "\\u" in text:
            # (Inside a JSON body the written-out escape's backslash is itself escaped: both read as one.)
            written = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text.replace("\\\\", "\\"))
            forms |= {written.lower(), unquote(written).lower()}
        try:
            decoded = orjson.dumps(orjson.loads(text)).decode()  # JSON's `\u` escapes read, written plainly
        except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # (not JSON; or nested too deep to write again)
            if self._folded and "\\u" in text:  # escapes that could not be read back: nothing finer can be trusted
                return True
        else:
            forms |= {decoded.lower(), unquote(decoded).lower()}
        return any(secret in form for secret in self._folded for form in forms)
