"""A step's message pickles as its classes and field values in order (``positional_pickle``):
every field survives the round trip, after the fields were changed in place too, in a
quarter of the bytes of pickle's default (which names every field in every object)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from engine.core.protocol import EngineCoreOutput, EngineCoreOutputs, PinSnapshot, StepStats, positional_pickle
from kvtypes.outputs import TokenLogprob


def message() -> EngineCoreOutputs:
    lp = [TokenLogprob(token_id=5, logprob=-0.25, top=[(5, -0.25), (7, -1.5)])]
    outs = [EngineCoreOutput(f"req-{i}", [i, i + 1], "stop" if i == 2 else None, 2 if i == 2 else None, lp, 30 + i,
                             16, 4, 12.5, None, "bad grammar" if i == 1 else None) for i in range(3)]
    pin = PinSnapshot("ab" * 32, 48, 3, 3600.0, 12.5, "tenant")
    stats = StepStats(num_running=3, kv_num_blocks=100, kv_block_size=16, tier_queries={"device": 4},
                      offload_write_seconds={"disk": [0.1, 0.2]}, pins=(pin,), spec_num_accepted_tokens_per_pos=(1, 0))
    return EngineCoreOutputs(outs, stats)


def test_round_trip_keeps_every_field_in_fewer_bytes():
    msg = message()
    msg.outputs[0].new_token_ids.append(9)  # changed in place after __init__: still in field order
    msg.stats.num_waiting = 7
    raw = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(raw)
    assert back == msg and back.outputs[0].new_token_ids[-1] == 9 and back.stats.num_waiting == 7
    for obj, got in [(msg, back), (msg.stats, back.stats), *zip(msg.outputs, back.outputs)]:
        assert [getattr(got, f.name) for f in dataclasses.fields(obj)] == [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    classes = (EngineCoreOutputs, EngineCoreOutput, StepStats)
    reducers = {c: c.__dict__["__reduce__"] for c in classes}
    try:
        for c in classes:  # pickle's default, as before positional_pickle
            del c.__reduce__
        default = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for c, r in reducers.items():
            c.__reduce__ = r
    assert pickle.loads(default) == msg and len(raw) < len(default) / 2


def test_fields_that_init_does_not_take_are_refused():
    @dataclasses.dataclass
    class Bad:
        a: int
        b: int = dataclasses.field(init=False, default=0)

    with pytest.raises(TypeError, match="every field must be an __init__ argument"):
        positional_pickle(Bad)
