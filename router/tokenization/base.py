"""The tokenizer interface routing uses.

Every mode turns a prompt (text, or chat messages) into token ids, so block keys are
computed one way for all of them. Only ``exact`` tokenizers produce the ids the engine
itself uses; their keys match the keys the router derives from the engine's KV events.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar


class TokenizeError(ValueError):
    """The prompt cannot be tokenized (a bad chat message, a template error): a 400."""


class TokenizerUnavailable(RuntimeError):
    """The tokenizer cannot answer now (its engine is unreachable): route on load alone."""


class PromptTokenizer(ABC):
    """Turns prompts into the token ids routing hashes."""

    mode: ClassVar[str]
    exact: ClassVar[bool] = True
    """Whether these are the engine's own token ids (so KV events can confirm them)."""

    @abstractmethod
    async def prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt, special tokens included as the engine adds them."""

    @abstractmethod
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat rendered with the model's template."""
