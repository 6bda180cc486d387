"""`runner run-batch`: OpenAI batch files answered as the server answers, in input order, errors per line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from runner import LLM, SamplingParams
from runner.cli.main import main


def test_a_batch_file_is_answered_line_by_line_as_the_server_would(engine_factory, tmp_path):
    engine = engine_factory("gqa")
    name = engine.resolve().name
    chat = {
        "model": name,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {
            "custom_id": "completion",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": name, "prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        },
        {
            "custom_id": "response",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": name, "input": "hello", "max_output_tokens": 8, "temperature": 0, "ignore_eos": True},
        },
        *({"custom_id": f"many-{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat} for i in range(6)),
        {
            "custom_id": "wrong-model",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**chat, "model": "gpt-9"},
        },
        {
            "custom_id": "bad-value",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**chat, "temperature": -1},
        },
        {"custom_id": "embeddings", "method": "POST", "url": "/v1/embeddings", "body": {"model": name, "input": "x"}},
        {
            "custom_id": "streaming",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": name, "prompt": "x", "stream": True},
        },
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n{not json\n")
    results = tmp_path / "results.jsonl"
    done = CliRunner().invoke(
        main, ["run-batch", str(engine), "-i", str(requests), "-o", str(results), "--max-in-flight", "3"]
    )
    assert done.exit_code == 0, done.output
    out = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["custom_id"] for r in out] == [line["custom_id"] for line in lines] + [None]  # input order
    by_id = {r["custom_id"]: r for r in out}
    llm = LLM(engine)
    greedy = llm.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert by_id["chat"]["response"]["body"]["choices"][0]["message"]["content"] == greedy.text
    assert all(
        by_id[f"many-{i}"]["response"]["body"]["choices"][0]["message"]["content"] == greedy.text for i in range(6)
    )
    completion = llm.generate("The quick brown", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert by_id["completion"]["response"]["body"]["choices"][0]["text"] == completion.text
    assert by_id["response"]["response"]["body"]["output"][0]["content"][0]["text"] == greedy.text
    assert (
        by_id["wrong-model"]["response"]["status_code"] == 404 and by_id["bad-value"]["response"]["status_code"] == 400
    )
    for failed in ("embeddings", "streaming", None):
        assert by_id[failed]["response"] is None and by_id[failed]["error"]["code"] == "invalid_request"
    assert "9 answered, 5 failed" in done.output  # (CliRunner mixes stderr in)
