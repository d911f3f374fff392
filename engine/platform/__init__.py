"""Process-level settings of the host the engine runs on: OpenMP threads (``openmp``), glibc's
malloc arenas (``host_malloc``), and what its CPU can do (``cpu_features``). Standard library and
torch only."""
