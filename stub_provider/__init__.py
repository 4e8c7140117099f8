"""Stub provider: a local HTTP stand-in for BFL, Vertex AI Gemini and OpenAI TTS.

Directives, determinism and each provider's routes: docs/STUB_PROVIDER.md.
"""

from .app import create_app

__all__ = ["create_app"]
