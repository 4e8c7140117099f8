"""Provider adapters, by the name a catalog entry gives in ``adapter``."""

from __future__ import annotations

from typing import Callable

from . import bfl, openai_speech, vertexai
from .base import HandBack, ProviderCall, ProviderFailure, ProviderOutput

ADAPTERS: dict[str, Callable[[ProviderCall], ProviderOutput]] = {
    "bfl": bfl.run,
    "vertexai": vertexai.run,
    "openai_speech": openai_speech.run,
}

__all__ = ["ADAPTERS", "HandBack", "ProviderCall", "ProviderFailure", "ProviderOutput"]
