"""LoRA training: arguments, datasets, the run, evaluation; the CLI is ``python -m modules.training``."""
