"""Tokenizer loading: the model's HF tokenizer (with its chat template), or GGUF metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from qwenserve.config import ModelConfig


def load_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    source = model_config.source
    if source.is_gguf and model_config.tokenizer == source.folder:
        from qwenserve.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(source.gguf_file)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_config.tokenizer)
    except Exception as e:
        raise ValueError(f"Could not load a tokenizer from {model_config.tokenizer} "
                         f"({type(e).__name__}: {e}); add tokenizer files (tokenizer.json, "
                         "tokenizer_config.json) or pass --tokenizer") from e
