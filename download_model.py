"""Download a model from the Hugging Face Hub into models/ (a LoRA adapter into loras/).

    python download_model.py ORG/NAME[:BRANCH] [--branch B] [--include GLOB ...] [--exclude GLOB ...]
        [--specific-file F] [--quant Q4_K_M] [--output DIR] [--list]

The work is modules/lifecycle/hub.py (this command: hub_cli.py) (also ``python -m modules.lifecycle download``, the Model tab's download box
and ``POST /v1/internal/model/download``). HF_TOKEN and HF_ENDPOINT are honoured; an interrupted download resumes.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from modules.lifecycle.hub_cli import main

if __name__ == "__main__":
    sys.exit(main())
