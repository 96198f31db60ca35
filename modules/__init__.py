"""textgen: a local LLM workbench."""

import os as _os
import sys as _sys

# llama.cpp and torch share the system's libgomp, which gives every thread that runs a parallel region its own team
# of threads. Once a second long-lived thread has one (a torch call from a request thread, such as an embeddings
# request), libgomp counts more threads than cores and, by default, spins only 100 times at a barrier before
# sleeping, for every team: llama.cpp's many barriers per token then ran generation at a third of its speed for the
# rest of the process (measured: 105 -> 32 tokens/s). ACTIVE with the default spin count keeps idle threads spinning
# no longer than before (300000 spins, then they sleep) but lets a barrier spin 1000 times when oversubscribed: after
# an embeddings and a logits request one stream ran at 0.90-1.0x of its speed before them (0.42x without). Set before
# torch or llama_cpp is imported (libgomp reads them once); a value you set yourself wins. Linux only: elsewhere the
# OpenMP runtime is often LLVM's libomp, where ACTIVE means idle threads that spin for ever.
_unset = "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ
if _unset and _sys.platform.startswith("linux"):
    _os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    _os.environ["GOMP_SPINCOUNT"] = "300000"
