"""`ggrun serve`'s HTTP front end: llama-server's OpenAI-compatible API on FastAPI over core.llm.engine_loop."""
