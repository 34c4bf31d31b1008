"""Ways in: the Python `LLM` API, the OpenAI-compatible server, and the CLI."""
