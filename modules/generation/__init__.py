"""Generation: parameters, presets, stop strings and the pipeline that drives a backend."""
