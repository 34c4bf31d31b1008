"""The engine loop (sync core and its async front)."""
