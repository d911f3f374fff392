"""Continuous-batching scheduler: ``Request``, the waiting/running queues, the per-step plan
(``SchedulerOutput``: decodes and chunked prefills under one token budget), preemption by
recompute, aborts, stop conditions on token ids, and cumulative ``SchedulerStats``.

Contract: plans and bookkeeping only; it never runs the model and never detokenizes. It depends
on ``cache`` (block allocation) and ``kvtypes`` (``SamplingParams``), nothing above.
"""
