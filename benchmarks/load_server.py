"""Load benchmark: N concurrent streaming clients against `runner serve`, for several --max-batch settings.

    python benchmarks/load_server.py --engine engines-out/default16 [--threads 2] [--requests-per-client 3]

The engine must be built with --max-batch at least the largest setting (16 by default). For each setting the
server starts in its own process with that --max-batch and as many concurrent clients; every client sends chat
requests one after another (mixed: by default every 4th is the ~650-token prompt, the others short chat turns;
output lengths 32..128, EOS ignored, seeded; the same mix for every client count).
Prints output tokens/s, TTFT p50/p99 and inter-token latency p50/p99 per setting; writes benchmarks/results/load.json.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis simply.",
    "Give me three tips for learning to cook.", "Why is the sky blue?", "Describe a cat to someone who never saw one.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def long_question() -> str:
    from runner.bench import license_text

    return "Summarise this text:\n" + " ".join(license_text().split()[:420])


async def client(url: str, rng: random.Random, count: int, long_text: str, long_every: int, records: list) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        for index in range(count):
            # every client sends the same mix, whatever the number of clients: each `long_every`-th is long
            long = long_every > 0 and index % long_every == long_every - 1
            question = long_text if long else rng.choice(QUESTIONS)
            body = {
                "model": "bench", "messages": [{"role": "user", "content": question}], "stream": True,
                "max_tokens": rng.randint(32, 128), "temperature": 0.0, "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            stamps = []
            tokens = 0
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                        stamps.append(time.perf_counter())
            records.append({"ttft": stamps[0] - start, "itl": list(np.diff(stamps)), "tokens": tokens})


async def run_clients(url: str, clients: int, per_client: int, long_text: str, long_every: int) -> tuple[list, float]:
    records: list = []
    start = time.perf_counter()
    await asyncio.gather(*(client(url, random.Random(i), per_client, long_text, long_every, records) for i in range(clients)))
    return records, time.perf_counter() - start


def measure(engine: str, max_batch: int, threads: int, per_client: int, long_text: str, long_every: int) -> dict:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "runner.cli", "serve", engine, "--port", str(port), "--max-batch", str(max_batch),
         "--threads", str(threads), "--model-name", "bench", "--max-waiting", "256"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"server did not start: {server.stderr.read() if server.poll() is not None else 'timeout'}")
                time.sleep(0.3)
        asyncio.run(run_clients(url, 1, 1, long_text, 0))  # warm-up
        records, seconds = asyncio.run(run_clients(url, max_batch, per_client, long_text, long_every))
    finally:
        server.terminate()
        server.wait(timeout=60)
    ttft = np.array([r["ttft"] for r in records]) * 1000
    itl = np.array([x for r in records for x in r["itl"]]) * 1000
    tokens = sum(r["tokens"] for r in records)
    return {
        "max_batch": max_batch, "clients": max_batch, "requests": len(records), "output_tokens": tokens,
        "seconds": seconds, "output_tok_s": tokens / seconds,
        "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "itl_ms_p50": float(np.percentile(itl, 50)), "itl_ms_p99": float(np.percentile(itl, 99)),
    }


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True))
@click.option("--batches", default="1,8,16", show_default=True, help="--max-batch settings (clients = max-batch).")
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--requests-per-client", type=int, default=4, show_default=True)
@click.option("--long-every", type=int, default=4, show_default=True, help="Each client's every N-th request is the ~650-token prompt (0: none).")
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results" / "load.json")
def main(engine, batches, threads, requests_per_client, long_every, out) -> None:
    from runner.machine import cpu_model

    long_text = long_question()
    results = [measure(engine, int(b), threads, requests_per_client, long_text, long_every) for b in batches.split(",")]
    base = results[0]["output_tok_s"]
    print(f"machine: {cpu_model()}, {threads} threads; {requests_per_client} requests per client, "
          f"every {long_every}th a ~650-token prompt, the others short chat turns" if long_every else "all short chat turns")
    print(f"{'max-batch':>9} {'clients':>7} | {'out tok/s':>9} {'vs 1':>6} | {'TTFT p50':>9} {'p99':>8} | {'ITL p50':>8} {'p99':>8}")
    for r in results:
        print(f"{r['max_batch']:>9} {r['clients']:>7} | {r['output_tok_s']:>9.1f} {r['output_tok_s'] / base:>5.2f}x | "
              f"{r['ttft_ms_p50']:>7.0f}ms {r['ttft_ms_p99']:>6.0f}ms | {r['itl_ms_p50']:>6.1f}ms {r['itl_ms_p99']:>6.0f}ms")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": f"{cpu_model()}, {threads} threads", "commit": commit,
                               "requests_per_client": requests_per_client, "long_every": long_every, "results": results}, indent=2))


if __name__ == "__main__":
    main()
