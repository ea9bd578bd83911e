"""OutputProcessor and RequestOutputCollector: stop strings, hold-back, merging, errors.

Engine outputs are built by hand from real tokenizations, so the tests show
exactly which step a stop string completes in and what each delta holds.
"""

from __future__ import annotations

import asyncio

import pytest

from app.output_processor import (
    OutputProcessor,
    RequestOutput,
    RequestOutputCollector,
    find_stop_string,
)
from core.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    SamplingParams,
)
from tests.support.tokenizers import build_byte_level_tokenizer

TEXT = " The cat sat on the mat. The end came soon after, and then more text."


@pytest.fixture(scope="module")
def tok():
    return build_byte_level_tokenizer()


def add(proc: OutputProcessor, tok, rid: str = "r", **params) -> RequestOutputCollector:
    prompt = tok.encode("Once upon a time")
    collector = RequestOutputCollector()
    request = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(**params))
    proc.add_request(request, collector)
    return collector


def feed(proc, collector, ids, rid="r", finish_last=FinishReason.LENGTH, per_step=1):
    """Send ``ids`` as engine steps; return (outputs the consumer saw, abort lists per step)."""
    outputs, aborts = [], []
    for start in range(0, len(ids), per_step):
        step = ids[start : start + per_step]
        last = start + per_step >= len(ids)
        eco = EngineCoreOutput(request_id=rid, new_token_ids=step, finish_reason=finish_last if last else None)
        aborts.append(proc.process_outputs([eco]))
        out = collector.get_nowait()
        if out is not None:
            outputs.append(out)
    return outputs, aborts


def joined(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_without_stop_strings_the_text_is_the_decode(tok) -> None:
    proc = OutputProcessor(tok)
    collector = add(proc, tok, max_tokens=100)
    ids = tok.encode(TEXT, add_special_tokens=False)
    outputs, aborts = feed(proc, collector, ids)
    assert joined(outputs) == TEXT
    assert [o.finished for o in outputs] == [False] * (len(ids) - 1) + [True]
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == len(ids)
    assert sum((o.token_ids for o in outputs), []) == ids
    assert not any(aborts) and not proc.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_trims_and_aborts(tok, include) -> None:
    proc = OutputProcessor(tok)
    collector = add(proc, tok, stop=["on the m"], include_stop_str_in_output=include)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert not any("on the m" in tok.decode([i]) for i in ids)  # it really spans tokens
    outputs, aborts = feed(proc, collector, ids)
    expected = " The cat sat on the m" if include else " The cat sat "
    assert joined(outputs) == expected
    final = outputs[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == "on the m"
    # Exactly one abort, at the step the stop string completed; later engine
    # outputs for the request are ignored.
    stop_step = next(i for i, a in enumerate(aborts) if a)
    assert aborts[stop_step] == ["r"] and not any(aborts[stop_step + 1 :])
    assert tok.decode(ids[: stop_step + 1]).find("on the m") >= 0
    assert "on the m" not in tok.decode(ids[:stop_step])
    assert final.num_output_tokens == stop_step + 1
    assert len(outputs) == stop_step + 1 and not proc.has_unfinished_requests()


def test_held_back_text_never_shows_part_of_a_stop_string(tok) -> None:
    """Streamed text lags by len(longest stop) - 1 chars, so a prefix of a stop
    string is not sent before it is known whether the stop string completes."""
    stops = ["The end", "xyz"]
    proc = OutputProcessor(tok)
    collector = add(proc, tok, stop=stops)
    ids = tok.encode(TEXT, add_special_tokens=False)
    sent = ""
    for i, token in enumerate(ids):
        proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[token])])
        out = collector.get_nowait()
        sent += out.text
        if out.finished:
            break
        seen = tok.decode(ids[: i + 1])
        assert sent == seen[: max(len(seen) - (len("The end") - 1), 0)]
    assert sent == " The cat sat on the mat. "
    assert out.stop_reason == "The end"


def test_partial_match_that_does_not_complete_is_released(tok) -> None:
    proc = OutputProcessor(tok)
    collector = add(proc, tok, stop=["mat!"])  # " mat." comes, never "mat!"
    ids = tok.encode(TEXT, add_special_tokens=False)
    outputs, aborts = feed(proc, collector, ids)
    assert joined(outputs) == TEXT and outputs[-1].finish_reason == "length"
    assert not any(aborts)


def test_earliest_stop_string_wins(tok) -> None:
    proc = OutputProcessor(tok)
    collector = add(proc, tok, stop=["end", "mat", "cat sat on"])
    ids = tok.encode(TEXT, add_special_tokens=False)
    outputs, _ = feed(proc, collector, ids, per_step=len(ids))  # all in one step
    assert joined(outputs) == " The " and outputs[-1].stop_reason == "cat sat on"


def test_find_stop_string_only_reports_matches_ending_in_new_text() -> None:
    assert find_stop_string("abcabc", 3, ["abc"]) == (3, "abc")
    assert find_stop_string("abcab", 2, ["abc"]) is None
    assert find_stop_string("xxab", 1, ["ab", "b"]) == (2, "ab")


def test_min_tokens_suppresses_stop_strings(tok) -> None:
    proc = OutputProcessor(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    cat_step = next(i for i in range(len(ids)) if "cat" in tok.decode(ids[: i + 1]))
    collector = add(proc, tok, stop=["cat", "end"], min_tokens=cat_step + 2, max_tokens=100)
    outputs, _ = feed(proc, collector, ids)
    assert joined(outputs) == " The cat sat on the mat. The " and outputs[-1].stop_reason == "end"


def test_engine_finish_flushes_held_back_text_and_keeps_its_reason(tok) -> None:
    proc = OutputProcessor(tok)
    collector = add(proc, tok, stop=["never appears"])
    ids = tok.encode(" short one", add_special_tokens=False)
    proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=ids[:-1])])
    assert collector.get_nowait().text == ""  # all of it is still held back
    proc.process_outputs(
        [
            EngineCoreOutput(
                request_id="r", new_token_ids=ids[-1:], finish_reason=FinishReason.STOP,
                stop_reason=7, num_cached_tokens=3,
            )
        ]
    )
    final = collector.get_nowait()
    assert final.text == " short one"
    assert (final.finish_reason, final.stop_reason, final.num_cached_tokens) == ("stop", 7, 3)


def test_stop_string_in_the_engines_last_step_needs_no_abort(tok) -> None:
    proc = OutputProcessor(tok)
    collector = add(proc, tok, stop=["sat"])
    ids = tok.encode(TEXT, add_special_tokens=False)
    last = EngineCoreOutput(request_id="r", new_token_ids=ids, finish_reason=FinishReason.LENGTH)
    aborts = proc.process_outputs([last])
    assert aborts == []
    out = collector.get_nowait()
    assert (out.text, out.finish_reason, out.stop_reason) == (" The cat ", "stop", "sat")


def test_lagging_consumer_gets_one_merged_output(tok) -> None:
    proc = OutputProcessor(tok)
    collector = add(proc, tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    for i, token in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[token], finish_reason=finish)])
    merged = collector.get_nowait()
    assert (merged.text, merged.token_ids, merged.finished) == (TEXT, ids, True)
    assert merged.num_output_tokens == len(ids)
    assert collector.get_nowait() is None


async def test_collector_get_waits_for_put() -> None:
    collector = RequestOutputCollector()

    async def producer() -> None:
        await asyncio.sleep(0)
        collector.put(RequestOutput("r", [1], "a", [5]))
        collector.put(
            RequestOutput("r", [1], "b", [6], finished=True, finish_reason="length", num_output_tokens=2)
        )

    task = asyncio.create_task(producer())
    out = await collector.get()
    await task
    assert (out.text, out.token_ids, out.finish_reason, out.num_output_tokens) == ("ab", [5, 6], "length", 2)


async def test_exception_wins_over_pending_output() -> None:
    collector = RequestOutputCollector()
    collector.put(RequestOutput("r", [1], "a", [5]))
    collector.put(EngineDeadError())
    collector.put(RequestOutput("r", [1], "b", [6]))
    with pytest.raises(EngineDeadError):
        await collector.get()
    assert collector.get_nowait() is None


def test_propagate_error_fails_every_request(tok) -> None:
    proc = OutputProcessor(tok)
    collectors = [add(proc, tok, rid=f"r{i}") for i in range(3)]
    proc.propagate_error(EngineDeadError("boom"))
    assert proc.get_num_unfinished_requests() == 0
    for collector in collectors:
        with pytest.raises(EngineDeadError, match="boom"):
            collector.get_nowait()


def test_abort_requests_forgets_and_optionally_notifies(tok) -> None:
    proc = OutputProcessor(tok)
    quiet, told = add(proc, tok, rid="quiet"), add(proc, tok, rid="told")
    ids = tok.encode(" The cat", add_special_tokens=False)
    proc.process_outputs([EngineCoreOutput(request_id="told", new_token_ids=ids)])
    told.get_nowait()
    assert proc.abort_requests(["quiet", "missing"]) == ["quiet"]
    assert proc.abort_requests(["told"], notify=True) == ["told"]
    assert quiet.get_nowait() is None
    last = told.get_nowait()
    assert (last.finished, last.finish_reason, last.num_output_tokens, last.text) == (True, "abort", len(ids), "")
    # Outputs still in flight from the engine are dropped.
    assert proc.process_outputs([EngineCoreOutput(request_id="quiet", new_token_ids=[5])]) == []
    assert not proc.has_unfinished_requests()


def test_duplicate_request_id_is_refused(tok) -> None:
    proc = OutputProcessor(tok)
    add(proc, tok)
    with pytest.raises(ValueError, match="already running"):
        add(proc, tok)
