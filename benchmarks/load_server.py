"""Load benchmark: N concurrent streaming clients against `runner serve`, for several --max-batch settings.

    python benchmarks/load_server.py --engine engines-out/default-b16 [--batches 1,8,16] [--duration 20] [--rounds 3]

The engine must be built with --max-batch at least the largest setting. One server per setting (--max-batch N,
N clients) runs for the whole benchmark, and the settings take turns: in each of --rounds rounds every setting in
turn gets its N clients for --duration seconds. Each client sends chat requests back to back (mixed: by default
every 4th is the ~650-token prompt, the others short chat turns; output lengths 32..128, EOS ignored, seeded; the
same mix for every client count) until the round's deadline, when it disconnects (the server cancels what it was
generating). With --turns T each request continues a conversation of up to T requests, sending all of it again,
as chat clients do; a setting written `8c` is a server with --enable-prefix-caching, so

    python benchmarks/load_server.py --engine engines-out/default --batches 8,8c --turns 4

measures what prefix caching does for 8 clients in multi-turn chats.

Throughput is steady state: output tokens streamed while all N clients were sending, per second. A run of a fixed
number of requests instead ends in a drain where fewer and fewer clients are left, which says more about how the
request lengths fell than about batching. Turns alternate because a shared VM's speed drifts within minutes:
a ratio is taken between runs of the same round. Prints, per setting, output tokens/s (median of the rounds), its
ratio to the first setting's in the same rounds (median), TTFT p50/p99 and inter-token latency p50/p99 over all
rounds, and the machine's memory bandwidth (STREAM triad) before each round; writes benchmarks/results/load.json.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import source_commit  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis simply.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Describe a cat to someone who never saw one.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


FOLLOW_UPS = ["Tell me more.", "Can you make it shorter?", "Give me an example.", "Why is that?"]


@dataclass(frozen=True)
class Load:
    """What every client sends: conversations of `turns` requests (each sending the conversation so far), every
    `long_every`-th of them opening with the long prompt."""

    long_text: str
    long_every: int
    turns: int = 1


def long_question() -> str:
    from runner.tools.bench import license_text

    return "Summarise this text:\n" + " ".join(license_text().split()[:420])


@dataclass
class Turn:
    """One setting's clients for one round: what they received before the deadline (the clients add to it)."""

    clients: int
    seconds: float
    tokens: int = 0  # content chunks streamed before the deadline (one per generated token)
    ttft_s: list[float] = field(default_factory=list)  # of requests whose first token came before the deadline
    itl_s: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


async def client(url: str, rng: random.Random, deadline: float, load: Load, turn: Turn) -> None:
    async with httpx.AsyncClient(timeout=600) as http:
        conversations = 0
        history: list[dict] = []  # the conversation so far: with --turns > 1 every request sends it again
        while time.perf_counter() < deadline:
            if not history or len(history) >= 2 * load.turns:
                # every client starts the same mix, whatever the number of clients: each `long_every`-th is long
                long = load.long_every > 0 and conversations % load.long_every == load.long_every - 1
                conversations += 1
                history = [{"role": "user", "content": load.long_text if long else rng.choice(QUESTIONS)}]
            else:
                history.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
            body = {
                "model": "bench",
                "messages": history,
                "stream": True,
                "max_tokens": rng.randint(32, 128),
                "temperature": 0.0,
                "ignore_eos": True,
            }
            start = time.perf_counter()
            stamps, reply = [], []
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    if now >= deadline:
                        break  # leaving the stream disconnects; the server cancels the request
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choices = json.loads(line[6:])["choices"]
                        if choices and choices[0]["delta"].get("content") is not None:
                            stamps.append(now)
                            reply.append(choices[0]["delta"]["content"])
            history.append({"role": "assistant", "content": "".join(reply)})
            turn.tokens += len(stamps)
            if stamps:
                turn.ttft_s.append(stamps[0] - start)
                turn.itl_s += np.diff(stamps).tolist()


async def run_turn(url: str, clients: int, seconds: float, load: Load, seed: int) -> Turn:
    turn = Turn(clients, seconds)
    start = time.perf_counter()
    await asyncio.gather(
        *(client(url, random.Random(seed * 1000 + i), start + seconds, load, turn) for i in range(clients))
    )
    return turn


def start_server(engine: str, max_batch: int, threads: int, prefix_caching: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner.cli.main",
            "serve",
            engine,
            "--port",
            str(port),
            "--max-batch",
            str(max_batch),
            "--threads",
            str(threads),
            "--model-name",
            "bench",
            "--max-waiting",
            "256",
        ]
        + (["--enable-prefix-caching"] if prefix_caching else []),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.TransportError as err:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit(
                    f"server did not start: {server.stderr.read() if server.poll() is not None else 'timeout'}"
                ) from err
            time.sleep(0.3)


def summarise(setting: str, turns: list[Turn], base_turns: list[Turn]) -> dict:
    ttft = np.array([x for t in turns for x in t.ttft_s]) * 1000
    itl = np.array([x for t in turns for x in t.itl_s]) * 1000
    return {
        "setting": setting,
        "max_batch": turns[0].clients,
        "clients": turns[0].clients,
        "prefix_caching": setting.endswith("c"),
        "output_tok_s": float(np.median([t.tok_s for t in turns])),
        "output_tok_s_rounds": [round(t.tok_s, 1) for t in turns],
        "vs_base": float(np.median([t.tok_s / b.tok_s for t, b in zip(turns, base_turns)])),
        "vs_base_rounds": [round(t.tok_s / b.tok_s, 2) for t, b in zip(turns, base_turns)],
        "requests_started": len(ttft),
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "itl_ms_p50": float(np.percentile(itl, 50)),
        "itl_ms_p99": float(np.percentile(itl, 99)),
    }


@click.command()
@click.option("--engine", required=True, type=click.Path(exists=True))
@click.option(
    "--batches",
    default="1,8,16",
    show_default=True,
    help="--max-batch settings (clients = max-batch), a `c` after one for a server with --enable-prefix-caching "
    "(e.g. 8,8c); the first is the base of the ratios.",
)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--duration", type=float, default=20.0, show_default=True, help="Seconds of load per setting and round.")
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option(
    "--long-every",
    type=int,
    default=4,
    show_default=True,
    help="Each client's every N-th conversation opens with the ~650-token prompt (0: none).",
)
@click.option(
    "--turns",
    type=int,
    default=1,
    show_default=True,
    help="Requests per conversation: each sends the conversation so far.",
)
@click.option("--out", type=click.Path(path_type=Path), default=ROOT / "benchmarks" / "results" / "load.json")
def main(engine, batches, threads, duration, rounds, long_every, turns, out) -> None:
    from runner.core.machine import cpu_model, memory_bandwidth_gbs

    settings = batches.split(",")
    clients = {setting: int(setting.rstrip("c")) for setting in settings}
    load = Load(long_question(), long_every, turns)
    servers = {}
    try:
        for setting in settings:
            servers[setting] = start_server(engine, clients[setting], threads, prefix_caching=setting.endswith("c"))
            # warm-up: first runs of each shape
            asyncio.run(run_turn(servers[setting][1], 1, 3.0, Load(load.long_text, 0), seed=999))
        runs: dict[str, list[Turn]] = {setting: [] for setting in settings}
        bandwidths = []  # one decoding row is bound by memory bandwidth, a full batch far less: it sets the ratios
        for round_index in range(rounds):
            bandwidths.append(memory_bandwidth_gbs(threads))
            print(f"round {round_index + 1}: memory bandwidth {bandwidths[-1]:.1f} GB/s", flush=True)
            for setting in settings:
                turn = asyncio.run(run_turn(servers[setting][1], clients[setting], duration, load, seed=round_index))
                runs[setting].append(turn)
                print(f"round {round_index + 1}: {setting} clients {turn.tok_s:.1f} tok/s", flush=True)
                time.sleep(0.5)  # the server just left notices the disconnects and goes idle
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(timeout=60)
    results = [summarise(setting, runs[setting], runs[settings[0]]) for setting in settings]
    mix = (
        f"every {long_every}th conversation opens with a ~650-token prompt, the others with a short chat turn"
        if long_every
        else "all short chat turns"
    ) + (f"; conversations of {turns} requests" if turns > 1 else "")
    print(
        f"machine: {cpu_model()}, {threads} threads, memory bandwidth (triad) "
        f"{'/'.join(f'{b:.1f}' for b in bandwidths)} GB/s in the rounds; {rounds} rounds of {duration:.0f} s per "
        f"setting; {mix}"
    )
    print(
        f"{'clients':>7} | {'out tok/s':>9} {'vs ' + settings[0]:>6} {'(rounds)':<20} | "
        f"{'TTFT p50':>9} {'p99':>8} | {'ITL p50':>8} {'p99':>8}"
    )
    for r in results:
        per_round = "/".join(f"{x:.2f}" for x in r["vs_base_rounds"])
        print(
            f"{r['setting']:>7} | {r['output_tok_s']:>9.1f} {r['vs_base']:>5.2f}x {per_round:<20} | "
            f"{r['ttft_ms_p50']:>7.0f}ms {r['ttft_ms_p99']:>6.0f}ms | {r['itl_ms_p50']:>6.1f}ms "
            f"{r['itl_ms_p99']:>6.0f}ms"
        )
    commit = source_commit()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": f"{cpu_model()}, {threads} threads",
                "commit": commit,
                "duration_s": duration,
                "rounds": rounds,
                "bandwidth_gbs_rounds": [round(b, 1) for b in bandwidths],
                "long_every": long_every,
                "turns": turns,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
