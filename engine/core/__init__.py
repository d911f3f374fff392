"""The engine core: an ``LLMEngine`` stepping in a loop of its own, and the client that talks to it.

``loop`` (``EngineCore``: the step loop and the child-process entry point), ``protocol``
(the messages between client and core: requests in, token ids and ``StepStats`` out),
``client`` (``EngineClient``: the core in a thread or a child process, restart on a fault),
``output_processor`` and ``detokenizer`` (client side: token ids to text deltas, stop strings).

Contract: only the core's thread touches its ``LLMEngine``; everything else sees the engine
through ``protocol`` messages. A core that dies fails its requests with an error, never
leaves one hanging.
"""
