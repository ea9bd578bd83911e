"""Speculative decoding on a real server (stories260K), through the official openai client:
the same text as a server without it, stop strings that fall inside an accepted run, logprobs,
structured outputs beside drafts, vLLM's metrics, and a client gone mid-stream."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [
    "Once upon a time, there was a little girl. Once upon a time, there was a little",
    "Tom had a red ball. Tom had a red ball. Tom",
    "The cat sat on the mat and the dog sat on the",
]


@pytest.fixture(scope="module")
def servers(module_server_factory):
    """(with speculation, drafting wherever it can: the tests count drafts; without), side by side."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RINGLLM_SPEC_DECODE_GATE", "0")
        spec = module_server_factory(["--speculative-config", json.dumps(SPEC)])
    return spec, module_server_factory([])


def _complete(server, prompt: str, **extra) -> str:
    result = server.openai().completions.create(
        model="stories260K", prompt=prompt, max_tokens=80, temperature=0, extra_body={"ignore_eos": True}, **extra
    )
    return result.choices[0].text


def _stream(server, prompt: str) -> str:
    chunks = server.openai().completions.create(
        model="stories260K", prompt=prompt, max_tokens=80, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _spec_samples(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {
        s.name + (f"[{s.labels['position']}]" if "position" in s.labels else ""): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
        if s.name.startswith("vllm:spec_decode")
    }


def test_greedy_text_streamed_or_not_equals_the_server_without_speculation(servers) -> None:
    spec, plain = servers
    for prompt in PROMPTS:
        expected = _complete(plain, prompt)
        assert _complete(spec, prompt) == expected
        assert _stream(spec, prompt) == expected
    samples = _spec_samples(spec)
    assert samples["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < samples["vllm:spec_decode_num_accepted_tokens_total"] < samples["vllm:spec_decode_num_draft_tokens_total"]
    assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total[0]"] >= samples[
        "vllm:spec_decode_num_accepted_tokens_per_pos_total[3]"
    ]
    assert not any(name.startswith("vllm:spec_decode") for name in _spec_samples(plain))


def test_stop_strings_inside_an_accepted_run_cut_the_text_there(servers) -> None:
    spec, plain = servers
    for prompt in PROMPTS:
        full = _complete(plain, prompt)
        stop = full[20:26]  # somewhere in the middle, where drafts are being accepted
        expected = _complete(plain, prompt, stop=[stop])
        assert expected == full[: full.index(stop)]
        assert _complete(spec, prompt, stop=[stop]) == expected


def test_chat_logprobs_equal_the_server_without_speculation(servers) -> None:
    spec, plain = servers

    def chat(server):
        result = server.openai().chat.completions.create(
            model="stories260K", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=40, temperature=0,
            logprobs=True, top_logprobs=2,
        )
        return result.choices[0]

    a, b = chat(plain), chat(spec)
    assert b.message.content == a.message.content
    assert [t.token for t in b.logprobs.content] == [t.token for t in a.logprobs.content]
    for x, y in zip(a.logprobs.content, b.logprobs.content):
        assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
        assert [t.token for t in y.top_logprobs] == [t.token for t in x.top_logprobs]


def test_structured_output_requests_are_served_beside_drafting_ones(servers) -> None:
    spec, _ = servers
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    result = spec.openai().chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "A name, please."}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    jsonschema.validate(json.loads(result.choices[0].message.content), schema)


def test_a_client_gone_mid_stream_frees_every_block(servers) -> None:
    spec, _ = servers
    body = {"model": "stories260K", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", spec.base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(20):  # well into the run: drafts are being verified
            next(lines)

    def empty() -> bool:
        stats = spec.engine_stats()
        return stats["num_running_reqs"] == stats["num_waiting_reqs"] == 0 and stats["kv_cache_usage"] == 0

    wait_for(empty, "the engine to drop the request and free its KV cache")


@pytest.mark.parametrize(
    "config,message",
    [
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}', "lookahead"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs"),
        ("ngram", "invalid speculative config"),
    ],
)
def test_bad_speculative_configs_exit_2_with_the_reason(config: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app", "--speculative-config", config], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_bench_serve_reports_acceptance_over_its_run(servers) -> None:
    from bench.report import format_console
    from bench.serve import spec_decode_counters, spec_decode_summary

    spec, plain = servers
    assert spec_decode_counters(plain.base_url) is None
    before = spec_decode_counters(spec.base_url)
    _complete(spec, PROMPTS[0])
    after = spec_decode_counters(spec.base_url)
    summary = spec_decode_summary(before or {}, after)
    drafted, accepted = summary["spec_decode_draft_tokens"], summary["spec_decode_accepted_tokens"]
    assert 0 < accepted <= drafted and summary["spec_decode_num_drafts"] > 0
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / drafted)
    assert summary["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / summary["spec_decode_num_drafts"])
    per_position = summary["spec_decode_per_position_acceptance"]
    assert len(per_position) == SPEC["num_speculative_tokens"] and per_position == sorted(per_position, reverse=True)
    result = {
        "completed": 1, "failed": 0, "duration": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
        "request_throughput": 1.0, "output_throughput": 1.0, "max_output_tokens_per_s": 1.0,
        "max_concurrent_requests": 1.0, "total_token_throughput": 1.0, **summary,
    }
    assert "Acceptance length:" in format_console(result, [], [])
