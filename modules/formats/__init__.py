"""File-format readers that both the backends (``modules/loaders``) and the lifecycle stand on.

Headers only, no weights: a GGUF's metadata and tensor table (type codes and block sizes from gguf-py, llama.cpp's
own Python package), a safetensors file's JSON header. Nothing here imports ``modules.loaders``,
``modules.lifecycle`` or the extensions.
"""
