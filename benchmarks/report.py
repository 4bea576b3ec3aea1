"""benchmarks/RESULTS.md from the records in results.json: for each goal, met or not, by how much, and why."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _goal_line(goal: Mapping[str, Any]) -> str:
    if goal["met"]:
        return f"- **met**: {goal['description']} (measured {_number(goal['value'])})"
    why = goal.get("why") or "no cause was measured"
    return f"- **not met**: {goal['description']}: {goal['shortfall']}. Why: {why}"


def render(records: Sequence[Mapping[str, Any]], run_info: Mapping[str, Any]) -> str:
    hardware = run_info["hardware"]
    lines = [
        "# Benchmark results",
        "",
        f"Produced by `make bench` (`python -m benchmarks.run`) on {run_info['finished']} in "
        f"{run_info['total_seconds']:.0f} s, scale `{run_info['scale']}`"
        + (f"; re-measured separately and merged: {', '.join(run_info['updated'])}" if run_info.get("updated") else "")
        + ".",
        "",
        f"Hardware: {hardware['cpu']}, {hardware['usable_cores']} usable cores, "
        f"{hardware['memory_bytes'] / 2**30:.0f} GiB RAM, {hardware['platform']}; "
        f"GPUs: {', '.join(hardware['cuda_devices']) or 'none'}. "
        f"Load average (1 min) at start {run_info['load_average_start']:.2f}, at end {hardware['load_average_1m']:.2f} "
        "(a load above the core count means other work shared the CPU and the timings are noisy).",
        "",
        "Packages: " + ", ".join(f"{k} {v}" for k, v in sorted(run_info["packages"].items()) if v) + ".",
        "",
        "GPU figures come from `make gpu-check` on a lent GPU machine (docs/gpu-check.md): "
        "one JSON line per check in its `measurements.jsonl`, the device named.",
        "",
        "Every figure is the median of the repetitions listed; ratios are ours / reference from those "
        "medians. Raw samples, settings and per-process details are in `benchmarks/results.json`.",
        "",
        "| benchmark | units | ours | reference | ratio | repetitions | goals |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        if rec["status"] != "measured":
            lines.append(f"| {rec['title']} | - | - | - | - | - | {rec['status']} |")
            continue
        met = sum(g["met"] for g in rec["goals"])
        lines.append(
            f"| {rec['title']} | {rec['units']} | {_number(rec['ours']['median'])} | "
            f"{_number(rec['reference']['median']) if rec['reference'] else '-'} | "
            f"{_number(rec['ratio']) if rec['ratio'] is not None else '-'} | {rec['repetitions']} | "
            f"{met}/{len(rec['goals'])} met |"
        )
    for rec in records:
        lines += ["", f"## {rec['title']}", ""]
        if rec["status"] != "measured":
            lines.append(f"**{rec['status'].replace('_', ' ')}**: {rec['message']}")
            continue
        series = [rec["ours"]] + ([rec["reference"]] if rec["reference"] else []) + list(rec["others"])
        for s in series:
            samples = ", ".join(_number(x) for x in s["samples"])
            lines.append(f"- {s['label']}: **{_number(s['median'])}** {s['units']} (samples: {samples})")
        if rec["ratio"] is not None:
            lines.append(f"- ratio ours / reference: **{rec['ratio']:.3g}** "
                         f"({'higher' if rec['higher_is_better'] else 'lower'} is better)")
        lines.append("")
        lines.append("Goals:")
        lines += [_goal_line(goal) for goal in rec["goals"]]
        if rec["notes"]:
            lines.append("")
            lines += [f"- {note}" for note in rec["notes"]]
    return "\n".join(lines) + "\n"
