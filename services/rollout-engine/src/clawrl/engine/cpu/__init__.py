"""The CPU engine: a transformers model behind an iteration-level batching scheduler."""
