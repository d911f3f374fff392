"""The GGUF side of loading: ``reader`` parses a file's header and tensor index (no dependency
on the ``gguf`` package); ``names`` maps llama.cpp's tensor names and q/k row order to
transformers'; ``blocks`` holds the block formats and matrices the kernels read; ``tensors``
walks a file's tensors once, keeping block matrices as blocks and dequantizing the rest."""
