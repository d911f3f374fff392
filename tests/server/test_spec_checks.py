"""The frontend's grammar check (``OpenAIServing._check_spec``): a spec it has not seen is
checked on a worker thread, not on the event loop that streams every other request's tokens;
each distinct spec is checked once, its verdict (a 400 naming the field, or none) remembered."""
from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

import server.serving as serving
from kvtypes.structured_spec import StructuredOutputSpec
from server.errors import APIError


def _checker(pool: ThreadPoolExecutor):
    """``_check_spec`` bound to a stand-in server with its own verdicts; (check, verdicts)."""
    host = SimpleNamespace(_tokenizer_pool=pool, _spec_verdicts=OrderedDict())
    host._off_loop = functools.partial(serving.OpenAIServing._off_loop, host)
    return functools.partial(serving.OpenAIServing._check_spec, host), host._spec_verdicts


def test_a_new_spec_is_checked_off_the_loop_and_once(monkeypatch):
    checked: list[tuple[str, int]] = []

    def spec_error(spec):
        checked.append((spec.value, threading.get_ident()))
        return "unknown keyword" if spec.value == "bad" else None

    monkeypatch.setattr(serving, "_spec_error", spec_error)
    good, bad = StructuredOutputSpec("regex", "good"), StructuredOutputSpec("regex", "bad")

    async def main(check) -> int:
        for _ in range(2):
            await check(good, "response_format", "response_format")
            with pytest.raises(APIError) as refused:
                await check(bad, "response_format", "response_format")
            assert (refused.value.status, refused.value.param) == (400, "response_format")
            assert refused.value.message == "invalid response_format: unknown keyword"
        return threading.get_ident()

    with ThreadPoolExecutor(1) as pool:
        loop_thread = asyncio.run(main(_checker(pool)[0]))
    assert [value for value, _ in checked] == ["good", "bad"]  # the second round came from the verdicts
    assert all(thread != loop_thread for _, thread in checked)


def test_the_real_check_refuses_a_broken_schema():
    """Through llguidance itself: a schema that cannot compile gets its error message."""
    broken = StructuredOutputSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}}))
    fine = StructuredOutputSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))

    async def main(check) -> None:
        await check(fine, "response_format", "response_format")
        with pytest.raises(APIError) as refused:
            await check(broken, "response_format", "response_format")
        assert refused.value.status == 400 and refused.value.message.startswith("invalid response_format: ")

    with ThreadPoolExecutor(1) as pool:
        check, verdicts = _checker(pool)
        asyncio.run(main(check))
    assert verdicts[fine] is None and verdicts[broken]
