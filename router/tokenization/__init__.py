"""Tokenizers: the emulator's words, Hugging Face, the engine's own, approximate."""

from router.tokenization.base import PromptTokenizer, TokenizeError, TokenizerUnavailable
from router.tokenization.modes import (
    ApproximateTokenizer,
    EngineTokenizer,
    HFTokenizer,
    WordsTokenizer,
)
from router.tokenization.pools import Tokenizers
from router.tokenization.words import WordTokenizer, render_chat

__all__ = [
    "ApproximateTokenizer",
    "EngineTokenizer",
    "HFTokenizer",
    "PromptTokenizer",
    "TokenizeError",
    "TokenizerUnavailable",
    "Tokenizers",
    "WordTokenizer",
    "WordsTokenizer",
    "render_chat",
]
