"""The spec_vs_llama_server probe's pure parts (prompts, sides, ratios, medians, log parsing, the
table), and llama-server's n-gram flag sets against the installed llama-server (skipped, with the
reason, where ``scripts/llama-server-peer.sh version`` fails: no sid tree built)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench.probes.spec_decode import PASSAGE
from bench.probes.spec_vs_llama_server import (CHAT_CLASS, COPY, COPY_CLASSES, FUNCTION_60, LLAMA, LLAMA_NGRAM, PLAIN,
                                               Side, accept_cell, llama_log_drafts, make_sides,
                                               median_ratio, median_value, prompt_texts, round_order, run_probe,
                                               spec_config, table_rows, tabulate)
from bench.peers.llama_server import SCRIPT


def test_prompt_classes_are_the_issues_copy_heavy_ones_and_chat():
    texts = prompt_texts(chat_prompts=2)
    assert list(texts) == ["repeat-edit", "quote", "code-edit", CHAT_CLASS]
    assert len(texts[CHAT_CLASS]) == 2 and all(len(texts[c]) == 1 for c in COPY_CLASSES)
    assert PASSAGE in texts["repeat-edit"][0] and "'lantern' instead of 'lamp'" in texts["repeat-edit"][0]
    assert PASSAGE in texts["quote"][0] and "word for word" in texts["quote"][0]
    assert FUNCTION_60.count("\n") == 60 and FUNCTION_60 in texts["code-edit"][0]
    compile(FUNCTION_60, "function", "exec")  # real code: a copy of it is a copy of real code


def test_prompt_ids_render_the_chat_template():
    from transformers import AutoTokenizer

    from bench.probes.spec_vs_llama_server import prompt_ids
    from engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)
    ids = prompt_ids(tokenizer, chat_prompts=1)
    assert 500 < len(ids["code-edit"][0]) < 1000  # the 60-line function
    assert "lantern" in tokenizer.decode(ids["repeat-edit"][0])
    assert tokenizer.decode(ids[CHAT_CLASS][0]).rstrip().endswith("assistant")  # the generation prompt


def test_sides_and_their_flags():
    from scheduler.config import SpeculativeConfig

    sides = make_sides(["ngram", "suffix"], 4, 1, 3, ["simple", "mod"])
    assert [s.name for s in sides] == [PLAIN, "kvserve ngram", "kvserve suffix", LLAMA, "llama-server ngram-simple",
                                       "llama-server ngram-mod"]
    assert [s.spec for s in sides] == [False, True, True, False, True, True]
    ngram = json.loads(sides[1].args[1])
    assert SpeculativeConfig(**ngram) == SpeculativeConfig("ngram", 4, 1, 3)
    assert json.loads(spec_config("suffix", 6)) == {"method": "suffix", "num_speculative_tokens": 6}
    assert sides[4].args == LLAMA_NGRAM["simple"] and "--spec-type" in sides[5].args
    assert [s.name for s in make_sides(["ngram"], 4, llama=False)] == [PLAIN, "kvserve ngram"]
    assert [s.name for s in round_order(sides[:3], 1)] == ["kvserve suffix", "kvserve ngram", PLAIN]
    assert round_order(sides, 2) == sides


def test_ratios_and_medians():
    assert median_ratio([10, 30, 20], [5, 10, 10]) == (2.0, [2.0, 3.0, 2.0])
    assert median_ratio([10, None, 20], [5, 10, 0]) == (2.0, [2.0])  # rounds missing a side are left out
    assert median_ratio([None], [1]) == (None, [])
    assert median_value([3.0, 1.0, 2.0, 4.0]) == 2.0 and median_value([None]) is None


def test_llama_server_log_acceptance():
    log = ("slot print_timing: id  0 | task 9 |        eval time =    1306.32 ms /   128 tokens\n"
           "slot print_timing: id  0 | task 9 | draft acceptance = 0.39161 (   56 accepted /   143 generated), "
           "mean len = 19.67\n"
           "slot print_timing: id  0 | task 82 | draft acceptance = 1.00000 (   4 accepted /     4 generated)\n")
    assert llama_log_drafts(log) == (147, 60)
    assert llama_log_drafts("no speculation here") == (0, 0)


def _side_run(tok_s, drafted=None, accepted=None, texts=("a",)):  # one side, one class, one round
    return {"tok_s": tok_s, "tpot_p50_ms": 1000 / tok_s, "output_tokens": 128, "drafted": drafted,
            "accepted": accepted, "acceptance": None, "foreign_cores": 0.1, "idle_sides_cores": 0.0,
            "texts": list(texts)}


def test_tabulate_median_rounds_and_acceptance():
    sides = make_sides(["ngram"], 4, llama_ngram=["simple"])
    rounds = [{"copy": {PLAIN: _side_run(10), "kvserve ngram": _side_run(20, 40, 30), LLAMA: _side_run(8),
                        "llama-server ngram-simple": _side_run(16, 10, 5, texts=("b",))}},
              {"copy": {PLAIN: _side_run(12), "kvserve ngram": _side_run(30, 40, 34), LLAMA: _side_run(10),
                        "llama-server ngram-simple": _side_run(15, 10, 5)}},
              {"copy": {PLAIN: _side_run(11), "kvserve ngram": _side_run(22, 20, 16), LLAMA: _side_run(11),
                        "llama-server ngram-simple": _side_run(20, 0, 0)}}]
    table = tabulate(rounds, sides, ["copy"])["copy"]
    spec = table["kvserve ngram"]
    assert spec["tok_s"] == 22 and spec["round_tok_s"] == [20, 30, 22]
    assert spec["vs_plain"] == 2.0 and spec["vs_plain_rounds"] == [2.0, 2.5, 2.0]
    assert spec["vs_llama"] == 2.5 and spec["vs_llama-server ngram-simple_rounds"] == [1.25, 2.0, 1.1]
    assert spec["acceptance"] == 0.8 and (spec["drafted"], spec["accepted"]) == (100, 80)
    assert spec["same_text_as_plain"] == 3
    assert table["llama-server ngram-simple"]["same_text_as_plain"] == 2
    assert table[PLAIN]["acceptance"] is None and "vs_plain" not in table[PLAIN]
    assert accept_cell(spec) == "0.800 (80/100)" and accept_cell(table[PLAIN]) == "-"
    rows = table_rows({"classes": {"copy": table}})
    assert [r[1] for r in rows] == [s.name for s in sides] and rows[1][5:8] == [2.0, 2.5, 1.25]
    assert rows[0][-1] == "0.10/0.10/0.10"  # the other processes' load, each round


def _llama_server_ready() -> str | None:
    """None where the installed llama-server can run here, else why not."""
    if os.geteuid() != 0:
        return "llama-server runs chrooted in a private mount namespace, which needs root"
    proc = subprocess.run(["bash", str(SCRIPT), "version"], capture_output=True, text=True)
    if proc.returncode != 0:
        return (f"`scripts/llama-server-peer.sh version` failed ({proc.stderr.strip()}): build the tree once "
                "with `sudo scripts/llama-server-peer.sh build`")
    return None


def test_llama_server_sides_accept_their_flags_and_report_acceptance(tmp_path):
    """The installed llama-server at its defaults and with each n-gram flag set, on the shipped
    GGUF, through the probe's own loop: one short copy request per side."""
    reason = _llama_server_ready()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from bench.probes.spec_vs_llama_server import prompt_ids
    from engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)
    prompts = {"repeat-edit": prompt_ids(tokenizer)["repeat-edit"]}
    sides = [Side(LLAMA, "llama")] + [Side(f"{LLAMA} ngram-{n}", "llama", f, True) for n, f in LLAMA_NGRAM.items()]
    result = run_probe(sides, prompts, threads=2, max_tokens=24, rounds=1, log_dir=tmp_path, progress=False)
    rows = result["classes"]["repeat-edit"]
    assert set(rows) == {s.name for s in sides}
    assert all(row["output_tokens"] == 24 and row["tok_s"] > 0 for row in rows.values())
    assert rows[LLAMA]["drafted"] is None
    # ngram-simple (3-token lookup) drafts while repeating the passage; ngram-mod may not in 24 tokens
    assert rows[f"{LLAMA} ngram-simple"]["drafted"] > 0, (tmp_path / "llama-server_ngram-simple.log").read_text()
    assert COPY not in result["classes"]  # one copy class: no aggregate row
