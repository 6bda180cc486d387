"""The command lines, run as a user would: `builder build | train-drafter` and
`runner generate | chat | bench | serve | info`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

BUILDER = [sys.executable, "-c", "from training.cli import main; main()"]
RUNNER = [sys.executable, "-c", "from runner.cli.main import main; main()"]


def run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)


def test_build_then_generate(checkpoint_factory, tmp_path):
    out = tmp_path / "engine"
    built = run(
        BUILDER
        + ["build", str(checkpoint_factory("gqa")), "--out", str(out), "--max-seq-len", "128", "--max-batch", "2"]
    )
    assert built.returncode == 0, built.stderr
    assert "[3/4] tracing" in built.stderr and "model.onnx.data" in built.stdout and "built in" in built.stdout
    generated = run(RUNNER + ["generate", str(out), "hello", "--max-tokens", "8"])
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip()
    chat = run(
        RUNNER + ["generate", str(out), "hello", "--chat", "--max-tokens", "4", "--temperature", "0.7", "--seed", "1"]
    )
    assert chat.returncode == 0, chat.stderr
    again = run(BUILDER + ["build", str(checkpoint_factory("gqa")), "--out", str(out)])
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_generate_takes_stops_penalties_and_refuses_bad_values_in_one_line(engine_factory):
    engine = str(engine_factory("gqa"))
    full = run(RUNNER + ["generate", engine, "hello", "--max-tokens", "16", "--ignore-eos", "--no-stats"]).stdout
    at = next(i for i in range(2, len(full) - 2) if full[i : i + 2].strip() and full.find(full[i : i + 2]) == i)
    stopped = run(
        RUNNER
        + ["generate", engine, "hello", "--max-tokens", "16", "--ignore-eos", "--stop", full[at : at + 2], "--no-stats"]
    )
    assert stopped.returncode == 0 and stopped.stdout.rstrip("\n") == full[:at]
    penalised = run(
        RUNNER
        + [
            "generate",
            engine,
            "hello",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--repetition-penalty",
            "1.5",
            "--presence-penalty",
            "1",
            "--frequency-penalty",
            "1",
            "--min-p",
            "0.1",
            "--no-stats",
        ]
    )
    assert penalised.returncode == 0 and penalised.stdout != full
    refused = run(RUNNER + ["generate", engine, "hello", "--min-p", "2"])
    assert refused.returncode == 2 and "min_p" in refused.stderr and "Traceback" not in refused.stderr
    templated = run(
        RUNNER
        + [
            "generate",
            engine,
            "hello",
            "--chat",
            "--chat-template",
            "{{ messages[0]['content'] }}!",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--no-stats",
        ]
    )
    plain = run(RUNNER + ["generate", engine, "hello!", "--max-tokens", "16", "--ignore-eos", "--no-stats"])
    assert templated.returncode == 0 and templated.stdout == plain.stdout
    broken = run(RUNNER + ["generate", engine, "hello", "--chat", "--chat-template", "{% if %}"])
    assert broken.returncode == 2 and "does not parse" in broken.stderr and "Traceback" not in broken.stderr


def test_generate_and_chat_hold_answers_to_a_choice_a_regex_or_a_schema(engine_factory, tmp_path):
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (scripts/test.sh installs it)")
    engine = str(engine_factory("gqa"))
    picked = run(RUNNER + ["generate", engine, "hello", "--choice", "north", "--choice", "south", "--no-stats"])
    assert picked.returncode == 0, picked.stderr
    assert picked.stdout.strip() in ("north", "south")
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "enum": [1, 2]}},
                "required": ["n"],
                "additionalProperties": False,
            }
        )
    )
    answered = run(
        RUNNER + ["generate", engine, "hello", "--json-schema", str(schema), "--max-tokens", "60", "--no-stats"]
    )
    assert answered.returncode == 0 and json.loads(answered.stdout)["n"] in (1, 2), answered.stdout
    chatted = run(RUNNER + ["chat", engine, "--regex", "[0-9]{3}", "--no-stats"], input="hi\nagain\n")
    assert chatted.returncode == 0 and all(len(line) == 3 and line.isdigit() for line in chatted.stdout.split())
    for args, message in ((["--regex", "[0-9"], "Unclosed"), (["--regex", "a", "--choice", "b"], "one of")):
        refused = run(RUNNER + ["generate", engine, "hi", *args])
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr


def test_clear_one_line_errors(tmp_path, engine_factory):
    missing = run(BUILDER + ["build", str(tmp_path / "nope"), "--out", str(tmp_path / "e")])
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == f"error: checkpoint not found: {tmp_path / 'nope'}"
    not_engine = run(RUNNER + ["generate", str(tmp_path), "hi"])
    assert not_engine.returncode == 2 and "not an engine artifact" in not_engine.stderr
    assert "Traceback" not in not_engine.stderr
    bad_param = run(RUNNER + ["generate", str(engine_factory("gqa")), "hi", "--top-p", "0"])
    assert bad_param.returncode == 2 and "top_p" in bad_param.stderr
    too_long = run(RUNNER + ["generate", str(engine_factory("gqa")), "hello " * 400])
    assert too_long.returncode == 2 and "max sequence length" in too_long.stderr
    bad_distill = run(
        BUILDER + ["train-drafter", str(engine_factory("gqa")), "--out", str(tmp_path / "h"), "--distill", "2"]
    )
    assert bad_distill.returncode == 2 and bad_distill.stderr.strip().splitlines()[-1].endswith(
        "between 0 and 1; got 2.0"
    )
    bad_rows = run(RUNNER + ["serve", str(engine_factory("gqa")), "--speculative-max-rows", "some"])
    assert bad_rows.returncode == 2 and "'some' is neither 'auto' nor a count >= 0" in bad_rows.stderr


def test_info_describes_an_engine_and_refuses_a_damaged_one(engine_factory, tmp_path):
    import shutil

    engine = engine_factory("gqa")
    described = run(RUNNER + ["info", str(engine)])
    assert described.returncode == 0, described.stderr
    manifest = json.loads((engine / "manifest.json").read_text())
    text = described.stdout
    assert f"{manifest['model']['num_layers']} layers" in text and f"max_seq_len: {manifest['max_seq_len']}" in text
    assert "decode: graph step" in text and "model.onnx.data" in text and "checksums: every file verified" in text
    assert "kernels: " in text and ("DecodeAttention" in text or "GroupQueryAttention" in text)
    assert json.loads(run(RUNNER + ["info", str(engine), "--json"]).stdout) == manifest
    damaged = tmp_path / "damaged"
    shutil.copytree(engine, damaged)
    altered = bytearray((damaged / "tokenizer.json").read_bytes())
    altered[len(altered) // 2] ^= 1  # same size: only the checksum sees it
    (damaged / "tokenizer.json").write_bytes(bytes(altered))
    refused = run(RUNNER + ["info", str(damaged)])
    assert refused.returncode == 2 and "tokenizer.json" in refused.stderr and "Traceback" not in refused.stderr
    assert run(RUNNER + ["info", str(damaged), "--no-verify"]).returncode == 0


def test_the_runner_needs_no_torch(engine_factory, tiny_draft_head):
    """A serving image carries onnxruntime + numpy + tokenizers only: torch is made unimportable here."""
    for engine in (engine_factory("gqa"), engine_factory("gqa", draft_head=tiny_draft_head[0])):
        script = (
            "import sys; sys.modules['torch'] = None\n"
            "from runner import LLM, SamplingParams\n"
            f"out = LLM({str(engine)!r}).generate('hello', SamplingParams(max_tokens=8, temperature=0))\n"
            "assert len(out[0].token_ids) == 8\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        )
        result = run([sys.executable, "-c", script])
        assert result.returncode == 0, result.stderr


def test_train_drafter_then_build_and_bench_a_speculative_engine(checkpoint_factory, engine_factory, tmp_path):
    head = tmp_path / "head.safetensors"
    trained = run(
        BUILDER
        + [
            "train-drafter",
            str(engine_factory("gqa")),
            "--out",
            str(head),
            "--prompts",
            "12",
            "--validation",
            "4",
            "--max-new-tokens",
            "16",
            "--epochs",
            "1",
            "--draft-vocab",
            "64",
            "--fp32",
        ]
    )
    assert trained.returncode == 0, trained.stderr
    assert "draft head:" in trained.stdout and "validation tokens per step" in trained.stdout
    out = tmp_path / "engine"
    built = run(
        BUILDER
        + [
            "build",
            str(checkpoint_factory("gqa")),
            "--out",
            str(out),
            "--max-seq-len",
            "128",
            "--speculative",
            "redrafter",
            "--draft-head",
            str(head),
            "--beam-width",
            "2",
            "--draft-len",
            "3",
        ]
    )
    assert built.returncode == 0, built.stderr
    assert "[4/5] exporting the ReDrafter draft graph" in built.stderr and "draft.onnx" in built.stdout
    assert "draft_len=3, max_tree_nodes=11, beam_width=2" in built.stdout
    report = tmp_path / "bench.json"
    bench = run(
        RUNNER
        + [
            "bench",
            str(out),
            "--prompt",
            "hello",
            "--long-prompt-tokens",
            "60",
            "--new-tokens",
            "12",
            "--runs",
            "1",
            "--batch-sizes",
            "1,2",
            "--threads",
            "2",
            "--json",
            str(report),
            "--profile",
        ]
    )
    assert bench.returncode == 0, bench.stderr
    assert "decode" in bench.stdout and "tokens per verify step" in bench.stdout and "draft" in bench.stdout
    assert "memory bandwidth" in bench.stdout and "MBU" in bench.stdout
    measured = json.loads(report.read_text())
    assert set(measured["prompts"]) == {"short", "long"} and [b["batch"] for b in measured["batches"]] == [1, 2]
    assert measured["speculation"]["tokens_per_verify_step"] >= 1 and measured["bandwidth_gbs"] > 0
    assert "per operator type" in bench.stdout and measured["profile"]["ops"][0]["nodes_per_run"] > 0
    too_long = run(RUNNER + ["bench", str(out), "--long-prompt-tokens", "650"])
    assert too_long.returncode == 2 and "max sequence length 128" in too_long.stderr
    bad_batch = run(RUNNER + ["bench", str(out), "--long-prompt-tokens", "0", "--batch-sizes", "1,16"])
    assert bad_batch.returncode == 2 and "--batch-sizes must be in [1, 8]" in bad_batch.stderr


def test_speculative_build_errors(checkpoint_factory, tiny_draft_head, tmp_path):
    no_head = run(
        BUILDER + ["build", str(checkpoint_factory("gqa")), "--out", str(tmp_path / "a"), "--speculative", "redrafter"]
    )
    assert no_head.returncode == 2 and "needs --draft-head" in no_head.stderr
    missing = run(
        BUILDER
        + [
            "build",
            str(checkpoint_factory("gqa")),
            "--out",
            str(tmp_path / "b"),
            "--speculative",
            "redrafter",
            "--draft-head",
            str(tmp_path / "nope.safetensors"),
        ]
    )
    assert missing.returncode == 2 and "draft head not found" in missing.stderr
    foreign = run(
        BUILDER
        + [
            "build",
            str(checkpoint_factory("odd")),
            "--out",
            str(tmp_path / "c"),
            "--speculative",
            "redrafter",
            "--draft-head",
            str(tiny_draft_head[0]),
        ]
    )
    assert foreign.returncode == 2 and "was trained for hidden size 64" in foreign.stderr
    assert not (tmp_path / "c").exists()  # nothing half-built is left behind
    no_model = run(
        BUILDER
        + ["build", str(checkpoint_factory("gqa")), "--out", str(tmp_path / "d"), "--speculative", "draft-model"]
    )
    assert no_model.returncode == 2 and "needs --draft-model" in no_model.stderr
    certain = run(
        BUILDER
        + [
            "build",
            str(checkpoint_factory("gqa")),
            "--out",
            str(tmp_path / "e"),
            "--speculative",
            "redrafter",
            "--draft-head",
            str(tiny_draft_head[0]),
            "--min-draft-prob",
            "1",
        ]
    )
    assert certain.returncode == 2 and "--min-draft-prob must be in [0, 1)" in certain.stderr


def test_serve_on_a_port_in_use_says_so_and_does_not_claim_to_serve(engine_factory):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(RUNNER + ["serve", str(engine_factory("gqa")), "--port", str(port)])
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "serving" not in result.stderr


def test_serve_answers_and_stops_cleanly_on_sigint(engine_factory):
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = [
        "serve",
        str(engine_factory("gqa")),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        "2",
    ]
    proc = subprocess.Popen(
        RUNNER + serve, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )  # vLLM's flag names
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, (
                    proc.stderr.read() if proc.poll() is not None else "timeout"
                )
                time.sleep(0.2)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
            timeout=30,
        ).json()
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "serving 'tiny'" in stderr and "Traceback" not in stderr
    assert "num_scheduler_steps 1)" in stderr  # a server streams token by token unless told to burst


def test_build_quantized_from_the_command_line(checkpoint_factory, tmp_path):
    import json

    out = tmp_path / "int4"
    built = run(
        BUILDER
        + [
            "build",
            str(checkpoint_factory("gqa")),
            "--out",
            str(out),
            "--quant",
            "int4",
            "--group-size",
            "64",
            "--float-lm-head",
            "--max-seq-len",
            "128",
            "--max-batch",
            "1",
        ]
    )
    assert built.returncode == 0, built.stderr
    assert "int4 (group 64, LM head float, int8 activations" in built.stderr
    quantization = json.loads((out / "manifest.json").read_text())["quantization"]
    assert (quantization["bits"], quantization["group_size"], quantization["lm_head"]) == (4, 64, False)
    generated = run(RUNNER + ["generate", str(out), "hello", "--max-tokens", "4"])
    assert generated.returncode == 0, generated.stderr


def test_build_gptq_from_the_command_line(checkpoint_factory, tmp_path):
    import json

    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "gptq"
    built = run(
        BUILDER
        + [
            "build",
            str(checkpoint_factory("gqa")),
            "--out",
            str(out),
            "--quant",
            "gptq",
            "--gptq-samples",
            "2",
            "--gptq-sample-len",
            "16",
            "--gptq-damping",
            "0.05",
            "--calibration-text",
            str(text),
            "--max-seq-len",
            "128",
            "--max-batch",
            "1",
        ]
    )
    assert built.returncode == 0, built.stderr
    quantization = json.loads((out / "manifest.json").read_text())["quantization"]
    assert quantization["method"] == "gptq" and quantization["gptq"]["damping"] == 0.05
    assert quantization["gptq"]["calibration"] == "calibration.txt: 2 x 16 tokens"
    refused = run(
        BUILDER
        + [
            "build",
            str(checkpoint_factory("gqa")),
            "--out",
            str(tmp_path / "x"),
            "--quant",
            "gptq",
            "--gptq-damping",
            "0",
        ]
    )
    assert refused.returncode == 2 and "damping" in refused.stderr


def test_chat_keeps_the_conversation_reuses_its_prefix_and_drops_the_oldest_turns_when_full(engine_factory):
    engine = str(engine_factory("gqa"))  # max_seq_len 256
    turns = "hello\nhow are you\n/reset\nhello\n"
    chat = run(RUNNER + ["chat", engine, "--max-tokens", "6", "--system", "be brief"], input=turns)
    assert chat.returncode == 0, chat.stderr
    stats = [line for line in chat.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 3
    assert (
        "cached" not in stats[0] and "cached" in stats[1] and "cached" in stats[2]
    )  # a new conversation, a known prefix

    long_message = " ".join(f"word{i}" for i in range(8))  # ~60 tokens of the tiny tokenizer
    too_long = " ".join(f"word{i}" for i in range(50))
    full = run(RUNNER + ["chat", engine, "--max-tokens", "4"], input=f"{long_message}\n" * 6 + f"{too_long}\nhello\n")
    assert full.returncode == 0, full.stderr
    assert "its oldest turn was dropped" in full.stderr
    assert "error: the prompt has" in full.stderr  # the over-long message is refused, the conversation goes on
    assert full.stderr.strip().splitlines()[-1].startswith("[")  # "hello" was answered after it
