"""Process-level settings of the host the engine runs on: OpenMP threads (``openmp``) and
glibc's malloc arenas (``host_malloc``). Standard library and torch only."""
