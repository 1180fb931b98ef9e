"""ggrun's engine: tensors, deferred graphs, the graph allocator, backends and the scheduler.

The engine knows nothing about language models; core.llm builds on it.
"""
