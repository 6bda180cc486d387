"""Soak: mixed and abusive traffic against `runner serve` for a while, watching what the other clients feel and
whether memory comes back.

    python benchmarks/soak_server.py --engine engines-out/default --minutes 10 --out benchmarks/results/soak.json

Traffic, all at once until the deadline: 4 clients streaming chat answers back to back (every 4th a ~650-token
prompt), 1 client that starts streams and disconnects after a few tokens, 1 client asking for JSON answers to a
schema new each time (every 8th one whose grammar compiles for minutes: refused at the server's grammar deadline),
and 3 clients sending oversized bodies:
two of 20 MiB (over the body limit: a 413) and one 6 MiB chat (under the limit, over what the context could take: a
400 before templating), back to back (a flood, the default) or one every `--oversized-every` seconds each, from a
process of their own.
A probe asks /health every 50 ms from a process of its own (as a load balancer's health check would: its latency
is the server's, not that of a client process busy with the other clients' threads). Prints and writes: answers by
kind and status, /health latency p50 / p99 / max, the server's RSS after a warm-up with the same traffic (every
request shape, and the normal clients together for a while, so that the engine has run its batch shapes: the
start), at its peak and at the end after the traffic stopped, and the ratio end / start (target: within 10%);
and the RSS of the server's child processes (its grammar compile process) at the end."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import click
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script

from benchmarks.provenance import source_commit  # noqa: E402
from runner.core.machine import cpu_model  # noqa: E402

WARM_UP_SECONDS = 30.0
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


def structured(url: str, model: str):
    """A client asking for JSON to a schema of its own each time (no grammar cache helps), every 8th one with 4,000
    optional properties, whose grammar compiles for minutes (the server refuses it at its deadline)."""

    def send(index: int) -> int:
        if index % 8 == 7:
            schema = {"type": "object", "properties": {f"p{index}_{k}": {"type": "string"} for k in range(4000)}}
        else:
            schema = {"type": "object", "properties": {f"n{index}": {"type": "integer"}}, "required": [f"n{index}"]}
        response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        body = chat_body(model, "Answer in JSON.", max_tokens=16, response_format=response_format)
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).status_code

    return send


def children_rss_mib(pid: int) -> float:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return sum(rss_mib(int(child)) for child in found)


def probe_health(port: int, seconds: float, latencies) -> None:
    """/health every 50 ms for `seconds`, a new connection each time (as a load balancer's probe); latencies in ms
    into the `latencies` queue. Plain http.client: `httpx.get` builds a TLS context per call, ~35 ms of the
    client's own CPU on this VM, which a probe of the server must not count."""
    found, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        begin = time.perf_counter()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/health")
        connection.getresponse().read()
        connection.close()
        found.append((time.perf_counter() - begin) * 1e3)
        time.sleep(0.05)
    latencies.put(found)


def run_clients(traffic: list[tuple[str, Callable[[int], int | str]]], seconds: float) -> Counter:
    """One thread per (kind, send) sending requests back to back for `seconds`; their statuses counted by kind."""
    answers: Counter = Counter()
    lock = threading.Lock()
    until = time.monotonic() + seconds

    def client(kind: str, send) -> None:
        index = 0
        while index == 0 or time.monotonic() < until:  # at least one request each
            try:
                status = send(index)
            except httpx.HTTPError as error:
                status = type(error).__name__
            with lock:
                answers[f"{kind} {status}"] += 1
            index += 1

    threads = [threading.Thread(target=client, args=kind_send) for kind_send in traffic]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def abuse(url: str, model: str, seconds: float, every: float, counts) -> None:
    """The oversized clients, in a process of their own (spawned by the soak, so that building and sending their
    bodies takes nothing from the normal clients' process): two 20 MiB bodies and a 6 MiB chat, each client one
    body every `every` seconds or back to back; their statuses into the `counts` queue (None: just once each)."""
    huge = json.dumps(chat_body(model, "word " * (4 * 2**20))).encode()  # 20 MiB: over the body limit
    too_long = json.dumps(chat_body(model, "word " * (6 * 2**20 // 5))).encode()  # 6 MiB: over the context

    def oversized(content: bytes):
        def send(_: int) -> int:
            begin = time.monotonic()
            status = post_raw(url, content)
            time.sleep(max(0.0, every - (time.monotonic() - begin)))
            return status

        return send

    answers = run_clients([("20MiB", oversized(huge))] * 2 + [("6MiB", oversized(too_long))], seconds)
    if counts is not None:
        counts.put(answers)


def post_raw(url: str, content: bytes) -> int:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers, timeout=300).status_code


@click.command()
@click.option("--engine", type=click.Path(exists=True), default="engines-out/default", show_default=True)
@click.option("--minutes", type=float, default=10.0, show_default=True)
@click.option("--port", type=int, default=8991, show_default=True)
@click.option(
    "--oversized-every", type=float, default=0.0, show_default=True, help="Seconds between a client's oversized bodies."
)
@click.option("--out", type=click.Path(dir_okay=False), default=None)
def main(engine: str, minutes: float, port: int, oversized_every: float, out: str | None) -> None:
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
        normal = [
            chat_body(model, "Tell me about rivers.", max_tokens=64),
            chat_body(model, LONG_PROMPT, max_tokens=64),
        ]
        normal_traffic = [("stream", lambda i: stream(url, normal[i % 4 == 3]))] * 4
        normal_traffic += [("abort", lambda i: stream(url, normal[i % 2], stop_after=3))]
        normal_traffic += [("json", structured(url, model))]
        # warm-up: every request shape, then the normal clients together (the engine's batch shapes)
        for body in normal:
            stream(url, body)
        stream(url, normal[1], stop_after=4)
        abuse(url, model, 0.0, 0.0, None)
        run_clients(normal_traffic, WARM_UP_SECONDS)
        time.sleep(1)
        start_rss = peak_rss = rss_mib(server.pid)
        seconds = 60 * minutes
        spawn = multiprocessing.get_context("spawn")
        latencies, abuse_counts = spawn.Queue(), spawn.Queue()
        helpers = [
            spawn.Process(target=probe_health, args=(port, seconds, latencies)),
            spawn.Process(target=abuse, args=(url, model, seconds, oversized_every, abuse_counts)),
        ]
        for helper in helpers:
            helper.start()
        normal_answers: list[Counter] = []
        clients = threading.Thread(target=lambda: normal_answers.append(run_clients(normal_traffic, seconds)))
        clients.start()
        while clients.is_alive():
            peak_rss = max(peak_rss, rss_mib(server.pid))
            time.sleep(0.5)
        answers = normal_answers[0] + abuse_counts.get()
        health = latencies.get()
        for helper in helpers:
            helper.join()
        time.sleep(2)
        end_rss, children_rss = rss_mib(server.pid), children_rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=30)
    results = {
        "engine": engine,
        "minutes": minutes,
        "oversized_every_s": oversized_every,
        "commit": source_commit(),
        "cpu": cpu_model(),
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
        "children_rss_mib_end": round(children_rss),
    }
    print(json.dumps(results, indent=2))
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
