"""Tokenizers the router and the engine emulator share or adapt to."""

from router.tokenization.words import WordTokenizer, render_chat

__all__ = ["WordTokenizer", "render_chat"]
