"""Quantization table for the default model's HF copy: size, bits/weight, PPL, KLD vs F16, tokens/s per type.

    .venv/bin/python -m bench.quant_table [--types F16 Q8_0 ...] [--keep DIR]

Every type is compared with the F16 file exported in the same run (the ratio column is PPL / F16's PPL).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
from pathlib import Path

from bench.common import ROOT, write_result


def main(argv: list[str] | None = None) -> int:
    from modules import jobs
    from modules.lifecycle import quant_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--types", nargs="+", default=list(quant_table.DEFAULT_TYPES))
    parser.add_argument("--keep", type=Path, help="keep the GGUF files in this folder")
    args = parser.parse_args(argv)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="quant-table-"))
    report, close = jobs.tqdm_reporter("quant table", unit="type")
    try:
        table_args = quant_table.TableArgs(args.source, folder, tuple(args.types), overwrite=True)  # ours, or --keep
        rows = quant_table.build(table_args, report, threading.Event())
    finally:
        close()
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(quant_table.markdown(rows))
    print(f"results: {write_result('quant_table', {'source': str(args.source), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
