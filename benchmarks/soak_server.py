"""Soak: mixed and abusive traffic against `runner serve` for a while, watching what the other clients feel and
whether memory comes back.

    python benchmarks/soak_server.py --engine engines-out/default --minutes 10 --out benchmarks/results/soak.json

Traffic, all at once until the deadline: 4 clients streaming chat answers back to back (every 4th a ~650-token
prompt), 1 client that starts streams and disconnects after a few tokens, 1 sending 20 MiB bodies (over the body
limit: a 413), 1 sending 6 MiB chats (under the limit, over what the context could take: a 400 before templating).
A probe asks /health every 50 ms. Prints and writes: answers by kind and status, /health latency p50 / p99 / max,
the server's RSS after a warm-up with the same traffic shapes (the start), at its peak and at the end after the
traffic stopped, and the ratio end / start (target: within 10%)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import click
import httpx
import numpy as np

LONG_PROMPT = "Summarise the following notes. " + "The meeting moved to Thursday and the budget was approved. " * 55


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def chat_body(model: str, content: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


def stream(url: str, body: dict, stop_after: int | None = None) -> int:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as answer:
        for index, _ in enumerate(answer.iter_lines()):
            if stop_after is not None and index >= stop_after:
                break  # the client leaves: the server must cancel and free the row
        return answer.status_code


def post_raw(url: str, content: bytes) -> int:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers, timeout=300).status_code


@click.command()
@click.option("--engine", type=click.Path(exists=True), default="engines-out/default", show_default=True)
@click.option("--minutes", type=float, default=10.0, show_default=True)
@click.option("--port", type=int, default=8991, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None)
def main(engine: str, minutes: float, port: int, out: str | None) -> None:
    server = subprocess.Popen(
        ["runner", "serve", engine, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        huge = json.dumps(chat_body(model, "word " * (4 * 2**20))).encode()  # 20 MiB
        too_long = json.dumps(chat_body(model, "word " * (6 * 2**20 // 5))).encode()  # 6 MiB
        normal = [
            chat_body(model, "Tell me about rivers.", max_tokens=64),
            chat_body(model, LONG_PROMPT, max_tokens=64),
        ]
        # warm-up: every shape of the traffic once, so the start is a server that has seen it all
        for body in normal:
            stream(url, body)
        stream(url, normal[1], stop_after=4)
        post_raw(url, huge), post_raw(url, too_long)
        time.sleep(1)
        start_rss = peak_rss = rss_mib(server.pid)
        deadline = time.monotonic() + 60 * minutes
        answers: Counter = Counter()
        lock = threading.Lock()

        def client(kind: str, send) -> None:
            index = 0
            while time.monotonic() < deadline:
                try:
                    status = send(index)
                except httpx.HTTPError as error:
                    status = type(error).__name__
                with lock:
                    answers[f"{kind} {status}"] += 1
                index += 1

        clients = [
            threading.Thread(target=client, args=("stream", lambda i: stream(url, normal[i % 4 == 3])))
            for _ in range(4)
        ]
        clients += [
            threading.Thread(target=client, args=("abort", lambda i: stream(url, normal[i % 2], stop_after=3))),
            threading.Thread(target=client, args=("20MiB", lambda i: post_raw(url, huge))),
            threading.Thread(target=client, args=("6MiB", lambda i: post_raw(url, too_long))),
        ]
        for thread in clients:
            thread.start()
        health = []
        while time.monotonic() < deadline:
            begin = time.perf_counter()
            httpx.get(f"{url}/health", timeout=30)
            health.append((time.perf_counter() - begin) * 1e3)
            peak_rss = max(peak_rss, rss_mib(server.pid))
            time.sleep(0.05)
        for thread in clients:
            thread.join()
        time.sleep(2)
        end_rss = rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    results = {
        "engine": engine,
        "minutes": minutes,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "answers": dict(sorted(answers.items())),
        "health_ms": {
            "probes": len(health),
            "p50": round(float(np.percentile(health, 50)), 1),
            "p99": round(float(np.percentile(health, 99)), 1),
            "max": round(max(health), 1),
        },
        "rss_mib": {"start": round(start_rss), "peak": round(peak_rss), "end": round(end_rss)},
        "rss_end_over_start": round(end_rss / start_rss, 3),
    }
    print(json.dumps(results, indent=2))
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
