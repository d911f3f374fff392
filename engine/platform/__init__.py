"""Process-level settings of the host the engine runs on: OpenMP threads (``openmp``), glibc's
malloc arenas (``host_malloc``), host buffers on transparent huge pages (``huge_pages``: the decode
weights and the CPU KV pool), and what its CPU can do (``cpu_features``). Standard library and
torch only."""
