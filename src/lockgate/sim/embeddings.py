"""`POST /v1/embeddings` of the simulator: deterministic vectors in vLLM's response shape.

Each input (a string, or a list of token ids) is tokenized like a prompt and turned into a unit vector
seeded by a hash of its tokens: the same input always gets the same vector, different inputs different
ones, on every simulator. The response is vLLM's: `{"object": "list", "data": [{"object": "embedding",
"index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`, the vectors as float lists
or, with `encoding_format: base64`, as base64 of little-endian float32 (what the openai SDK asks for).
"""

from __future__ import annotations

import base64
import math
import random
import struct
import time
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from .config import SimConfig
from .tokens import tokenize
from .wire import WireError

#: The vector size when the request sets no `dimensions` (a small model's hidden size).
DEFAULT_DIMENSIONS = 64
#: The largest `dimensions` the simulator accepts (vLLM refuses more than the model's size too).
MAX_DIMENSIONS = 4096


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    model: str
    #: Each input's tokens (strings for text, the ids' decimal strings for token ids).
    inputs: list[list[str]]
    dimensions: int
    base64: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.inputs)


def parse_embed_request(body: dict[str, Any], config: SimConfig) -> EmbedRequest:
    model = body.get("model")
    if not isinstance(model, str):
        raise WireError(400, "'model' is required", param="model")
    if model not in config.models:
        raise WireError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    raw = body.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise WireError(400, "'input' must be a string or a non-empty list", param="input")
    inputs: list[list[str]] = []
    for item in raw:
        if isinstance(item, str):
            tokens = tokenize(item)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            tokens = [str(t) for t in item]
        else:
            raise WireError(400, "each input must be a string or a list of token ids", param="input")
        if not tokens:
            raise WireError(400, "an input is empty", param="input")
        if len(tokens) > config.max_model_len:
            raise WireError(
                400,
                f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
                f"{len(tokens)} tokens in the input for embedding generation. Please reduce the length of the input.",
                param="input",
            )  # (vLLM's words)
        inputs.append(tokens)
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = DEFAULT_DIMENSIONS
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= MAX_DIMENSIONS:
        raise WireError(400, f"'dimensions' must be an integer from 1 to {MAX_DIMENSIONS}", param="dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise WireError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    return EmbedRequest(model=model, inputs=inputs, dimensions=dimensions, base64=encoding == "base64")


def vector(tokens: list[str], dimensions: int) -> list[float]:
    """A unit vector determined by the tokens alone."""
    rng = random.Random(xxhash.xxh64_intdigest("\x1f".join(tokens).encode()))
    values = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def embed_response(req: EmbedRequest, response_id: str) -> bytes:
    data: list[dict[str, Any]] = []
    for index, tokens in enumerate(req.inputs):
        values = vector(tokens, req.dimensions)
        encoded: list[float] | str = (
            base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii") if req.base64 else values
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    n = req.prompt_tokens
    return orjson.dumps(
        {
            "id": response_id,
            "object": "list",
            "created": int(time.time()),
            "model": req.model,
            "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None},
        }
    )
