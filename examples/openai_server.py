"""Serve an engine with `runner serve` and use it through the official `openai` client: a streamed chat completion,
then a two-turn conversation over the Responses API (the second turn names the first by previous_response_id, so
only the new message is sent).

    python examples/openai_server.py engines-out/default
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(engine: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-c", "from runner.cli.main import main; main()", "serve", engine, "--port", str(port)]
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("the server did not come up")


def main(engine: str) -> None:
    port = free_port()
    server = start_server(engine, port)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id  # the engine directory's name unless --served-model-name
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=24, temperature=0, stream=True
        )
        for chunk in stream:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()
        first = client.responses.create(
            model=model, input="Name a colour.", instructions="Answer briefly.", max_output_tokens=24, temperature=0
        )
        second = client.responses.create(
            model=model, input="And another one?", previous_response_id=first.id, max_output_tokens=24, temperature=0
        )
        print(f"{first.output_text!r} -> {second.output_text!r} ({second.usage.input_tokens} input tokens)")
    finally:
        server.send_signal(signal.SIGINT)  # running requests finish, then the server exits
        server.wait(timeout=60)


if __name__ == "__main__":
    main(sys.argv[1])
