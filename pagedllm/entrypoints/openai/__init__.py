"""The OpenAI-compatible HTTP server: `pagedllm serve` or
`python -m pagedllm.entrypoints.openai.api_server`."""
