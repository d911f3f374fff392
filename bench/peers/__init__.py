"""The peers kvserve is measured against: one adapter module per peer.

* ``transformers``: ``generate`` (single stream, static batches) and its continuous batching;
* ``llama_server``: llama.cpp's own HTTP server (Debian sid's build in a chroot), started one way;
* ``node_llama_cpp``: llama.cpp in process through the npm package node-llama-cpp.

An adapter installs (or finds) its peer, starts and stops it, and runs requests through it,
returning raw measurements; it judges nothing (the targets and ratios are the suite's
scenarios'). A peer that cannot run here raises ``PeerUnavailable`` with the reason, so a
scenario reports it as skipped, never silently dropped. Beside the adapters: ``base`` (what they
share: ``PeerUnavailable``, the bench cache, the ``Server`` handle and ``launch``) and
``gguf_files`` (what a GGUF file holds; the all-F32 copy of the default model).

Imports: the engine layers below bench and each other; never the suite (``bench.*`` outside this
package) or ``bench.probes``. The suite and the probes may import the peers.
"""
