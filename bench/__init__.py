"""textgen's benchmarks (`make bench`, `python -m bench.run`)."""

# The server's OpenMP settings (modules/__init__.py) for this process too, before llama_cpp or torch loads libgomp:
# the raw references then run as the server's engine does, and the scheduler measured in this process (a thread with
# a team of its own beside the main thread's) is not slowed by libgomp's oversubscribed barriers.
import modules  # noqa: F401
