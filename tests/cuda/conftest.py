"""Fixtures of the CUDA tests: the integration tests' tiny Llama (``actor_batches``, imported by name). Nothing here
needs Ray or vLLM: a GPU machine with torch, transformers, deepspeed, flash-attn and openrlhf collects and runs
``pytest -m cuda tests/core tests/cuda``."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from actor_batches import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
