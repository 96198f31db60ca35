"""The model lifecycle: default model setup, GGUF inspection, download, export, quantize."""
