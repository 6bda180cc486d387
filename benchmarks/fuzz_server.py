"""The long fuzzer run: schemathesis generates requests from the server's own OpenAPI schema (valid and invalid,
positive and negative data), `--examples` per route, against a served engine (a tiny random one by default), and
counts the answers by status. A 5xx is a bug; the result (counts, the failing requests) is printed as JSON and
written with `--out`.

    python -m benchmarks.fuzz_server --examples 160 --out benchmarks/results/fuzz_server.json
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from benchmarks.provenance import source_commit
from runner.core.machine import cpu_model
from tests.runner.serving.test_fuzz import served_model
from tests.runner.serving.test_server import LiveServer
from tests.tiny_checkpoint import make_checkpoint


def tiny_engine(work: Path) -> Path:
    from builder.build import BuildOptions, build_engine

    out = work / "engine"
    build_engine(
        BuildOptions(str(make_checkpoint(work / "ckpt")), out, max_seq_len=256, max_batch=4), log=lambda *_: None
    )
    return out


def fuzz(url: str, examples: int) -> dict:
    """`examples` per route, half valid by the schema, half not."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    statuses: collections.Counter = collections.Counter()
    failures: list[dict] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        strategy = st.one_of(operation.as_strategy(mode) for mode in GenerationMode)

        @given(strategy.map(lambda case: served_model(case, model)))
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            response = case.call(timeout=60)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                failures.append({"route": f"{case.method} {case.path}", "body": repr(case.body)[:500],
                                 "answer": response.text[:500]})  # fmt: skip

        run()
    healthy = httpx.get(f"{url}/health").status_code == 200
    return {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "server_errors": len(failures), "failures": failures[:20], "healthy_after": healthy}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, help="an engine directory (default: a tiny random one, built here)")
    parser.add_argument("--examples", type=int, default=160, help="generated requests per route")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        engine = args.engine or tiny_engine(Path(work))
        live = LiveServer(engine)
        start = time.perf_counter()
        try:
            results = fuzz(live.url, args.examples)
        finally:
            live.stop()
    seconds = round(time.perf_counter() - start, 1)
    results |= {"seconds": seconds, "examples_per_route": args.examples, "schemathesis": schemathesis.__version__}
    results |= {"commit": source_commit(), "cpu": cpu_model()}
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
