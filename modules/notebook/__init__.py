"""The Code notebook: Jupyter kernels (kernel.py), .ipynb documents (document.py), outputs as HTML (render.py)
and the model writing or fixing cells (assist.py)."""
