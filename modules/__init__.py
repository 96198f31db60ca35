"""textgen: a local LLM workbench."""
