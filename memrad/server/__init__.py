"""The HTTP side: aiohttp app factory and OpenAI-compatible routes."""
