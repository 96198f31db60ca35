"""textgen: a local LLM workbench."""

import os as _os

# llama.cpp and torch share the system's libgomp, which gives every thread that runs a parallel region its own team
# of threads. Once a second long-lived thread has one (a torch call from a request thread, such as an embeddings
# request), libgomp counts more threads than cores and, by default, spins only 100 times at a barrier before
# sleeping, for every team: llama.cpp's many barriers per token then ran generation at a third of its speed for the
# rest of the process (measured: 105 -> 32 tokens/s). ACTIVE with the default spin count keeps idle threads spinning
# no longer than before (300000 spins, then they sleep) but lets a barrier spin 1000 times when oversubscribed, which
# is enough: no slowdown measured. Set before torch or llama_cpp is imported (libgomp reads them once); a value you
# set yourself wins.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    _os.environ["GOMP_SPINCOUNT"] = "300000"
