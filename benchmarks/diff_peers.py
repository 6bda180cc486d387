"""Compare two runs of compare_peers (two commits, two machines, two hours): what moved, engine by engine.

    python benchmarks/diff_peers.py benchmarks/results/peers_zen3_55eca37.json benchmarks/results/peers.json

Prints a Markdown report: each run's machine, bandwidth, commit and versions (with a warning where they differ), then
for every engine in both runs its medians old -> new with the ratio (> 1: better in the new run, for times too), and
the paired standings (our best against the best peer, rounds of one run) side by side. Absolute numbers move with
the machine's memory bandwidth (which drifts within an hour on a shared VM), so between runs the paired standings,
each measured within one run, are the figures to compare; the report says so where the bandwidth moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

# (key path in an engine's results, label, whether a higher value is better)
METRICS = [
    (("short", "decode_tok_s"), "decode short tok/s", True),
    (("long", "decode_tok_s"), "decode long tok/s", True),
    (("short", "ttft_ms"), "TTFT short ms", False),
    (("long", "ttft_ms"), "TTFT long ms", False),
    (("peak_rss_mb",), "peak RSS MiB", False),
    (("perplexity",), "perplexity", False),
]
METRIC_NAMES = {
    "decode_tok_s": "decode",
    "ttft_ms": "TTFT",
}  # the standings' metrics, as compare_peers' table names them
BANDWIDTH_MOVED = 0.10  # beyond this relative change of the triad, absolute speeds are not comparable


def lookup(results: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(results, dict) or key not in results:
            return None
        results = results[key]
    return results


def improvement(old: float, new: float, higher_is_better: bool) -> float:
    """new against old, > 1 meaning better: a speed's ratio, a time's or a perplexity's inverse ratio."""
    return new / old if higher_is_better else old / new


def diff_report(old: dict, new: dict) -> list[str]:
    lines = ["| | old | new |", "|---|---|---|"]
    for key in ("commit", "machine", "bandwidth_gbs", "versions"):
        a, b = old.get(key), new.get(key)
        if key == "bandwidth_gbs":
            a, b = (f"{v:.1f} GB/s" if v is not None else None for v in (a, b))
        if key == "versions":
            a, b = (", ".join(f"{k} {v}" for k, v in sorted((v or {}).items())) for v in (a, b))
        lines.append(f"| {key.replace('_gbs', '')} | {a} | {b} |")
    lines.append("")
    if old.get("machine") != new.get("machine"):
        lines.append("**Different machines**: ratios below compare machines as much as commits.")
    bandwidths = old.get("bandwidth_gbs"), new.get("bandwidth_gbs")
    if all(bandwidths) and abs(bandwidths[1] / bandwidths[0] - 1) > BANDWIDTH_MOVED:
        lines.append(
            f"**The memory bandwidth moved {bandwidths[1] / bandwidths[0] - 1:+.0%}** between the runs: decode "
            "speeds follow it; compare the paired standings (last table)."
        )
    if old.get("versions") != new.get("versions"):
        lines.append("**Versions differ** (above).")
    lines += [
        "",
        "Engines in both runs, old -> new (ratio > 1: better in the new run):",
        "",
        "| engine | " + " | ".join(label for _, label, _ in METRICS) + " |",
        "|---|" + "---:|" * len(METRICS),
    ]
    old_engines, new_engines = old.get("engines", {}), new.get("engines", {})
    for engine in [e for e in new_engines if e in old_engines]:
        cells = []
        for path, _, higher in METRICS:
            a, b = lookup(old_engines[engine], path), lookup(new_engines[engine], path)
            cells.append("-" if a is None or b is None else f"{a:.4g} -> {b:.4g} ({improvement(a, b, higher):.2f}x)")
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    for label, names in (
        ("only in the old run", [e for e in old_engines if e not in new_engines]),
        ("only in the new run", [e for e in new_engines if e not in old_engines]),
    ):
        if names:
            lines += ["", f"Engines {label}: {', '.join(names)}."]
    lines += [
        "",
        "Our best engine against the best peer, paired within each run (> 1: ours ahead):",
        "",
        "| prompt | metric | old: ours / peer | old | new: ours / peer | new |",
        "|---|---|---|---:|---|---:|",
    ]
    old_standing = {(r["prompt"], r["metric"]): r for r in old.get("standing", [])}
    for row in new.get("standing", []):
        before = old_standing.get((row["prompt"], row["metric"]))
        old_cells = (
            (
                f"{before['ours']} / {before['peer']} | {before['ours_ahead_by']:.2f}x "
                f"({before['lowest']:.2f}-{before['highest']:.2f})"
            )
            if before
            else "- | -"
        )
        lines.append(
            f"| {row['prompt']} | {METRIC_NAMES[row['metric']]} | {old_cells} | {row['ours']} / {row['peer']} | "
            f"{row['ours_ahead_by']:.2f}x ({row['lowest']:.2f}-{row['highest']:.2f}) |"
        )
    return lines


@click.command()
@click.argument("old_run", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("new_run", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def main(old_run: Path, new_run: Path) -> None:
    runs = []
    for path in (old_run, new_run):
        try:
            runs.append(json.loads(path.read_text()))
        except json.JSONDecodeError as error:
            raise click.ClickException(f"{path} is not a compare_peers result (JSON: {error})") from error
        if not isinstance(runs[-1], dict) or "engines" not in runs[-1]:
            raise click.ClickException(f"{path} is not a compare_peers result (no 'engines')")
    click.echo("\n".join(diff_report(*runs)))


if __name__ == "__main__":
    main()
