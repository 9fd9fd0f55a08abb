"""The benchmark's outputs: a markdown report and PNG plots, from the results JSON alone.

    python -m iterserve.loadtests.bench_report loadtests/studies/static_vs_continuous/results/bench.json \
        --markdown BENCHMARKS_SERVING.md --plots loadtests/studies/static_vs_continuous/results

so a report can be regenerated (or restyled) without rerunning the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iterserve.loadtests.bench_stats import FloorCheck, compare

# The committed figures (static vs continuous), relative to a checkout's root.
RESULTS = Path("loadtests/studies/static_vs_continuous/results")

MODES = ("static", "continuous")
PLOT_FILES = {
    "throughput": "throughput_vs_concurrency.png",
    "ttft": "ttft_p95_vs_concurrency.png",
    "kv": "kv_usage_over_time.png",
}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def write_plots(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {key: out_dir / name for key, name in PLOT_FILES.items()}
    modes = {mode: data for mode, data in results["modes"].items() if data.get("levels")}

    for key, field_name, label, log in (
            ("throughput", "output_tokens_per_s", "output tokens/s", False),
            ("ttft", "ttft_ms_p95", "p95 TTFT (ms)", True)):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for mode, data in modes.items():
            points = [(lv["concurrency"], lv[field_name]) for lv in data["levels"]
                      if lv[field_name] is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(paths[key], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(len(modes) or 1, 1, figsize=(7.5, 2.6 * max(len(modes), 1)),
                             sharex=True, squeeze=False)
    for ax, (mode, data) in zip(axes[:, 0], modes.items(), strict=False):
        samples = data.get("samples", [])
        ax.plot([s["t"] for s in samples], [s["kv_usage"] * 100 for s in samples],
                lw=1, label="KV usage %")
        ax.plot([s["t"] for s in samples], [s["running"] for s in samples], lw=1,
                alpha=0.7, label="running requests")
        for level in data["levels"]:
            ax.axvline(level["t_start"], color="grey", lw=0.6, ls=":")
            ax.text(level["t_start"], ax.get_ylim()[1] * 0.92, f" c={level['concurrency']}",
                    fontsize=7, color="grey")
        ax.set_ylabel(mode)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the first level started")
    fig.suptitle("KV-cache usage and batch occupancy over time (sampled from /metrics)")
    fig.tight_layout()
    fig.savefig(paths["kv"], dpi=110)
    plt.close(fig)
    return paths


def _level_rows(mode: str, levels: Sequence[dict[str, Any]]) -> list[str]:
    return [
        f"| {mode} | {lv['concurrency']} | {lv['completed']}/{lv['requests']} | "
        f"{_fmt(lv['output_tokens_per_s'])} | {_fmt(lv.get('steady_output_tokens_per_s'))} | "
        f"{_fmt(lv['ttft_ms_p50'], 0)} | "
        f"{_fmt(lv['ttft_ms_p95'], 0)} | {_fmt(lv['ttft_ms_p99'], 0)} | "
        f"{_fmt(lv['tpot_ms_mean'])} | {_fmt(lv['itl_ms_p99'])} | {_pct(lv['kv_usage_peak'])} | "
        f"{_pct(lv['kv_usage_mean'])} | {_fmt(lv['out_of_blocks'], 0)} | "
        f"{_fmt(lv['preemptions'], 0)} | {_fmt(lv['goodput_rps'], 2)} "
        f"({_pct(lv['goodput_fraction'])}) |"
        for lv in levels
    ]


def _comparison(results: dict[str, Any]) -> tuple[list[str], FloorCheck | None]:
    static = results["modes"].get("static", {}).get("levels", [])
    continuous = results["modes"].get("continuous", {}).get("levels", [])
    lines = ["| concurrency | continuous / static output tokens/s | same, steady state | "
             "p95 TTFT: continuous vs static |", "|---:|---:|---:|---:|"]
    floor = None
    for concurrency in results["concurrency"]:
        check = compare(static, continuous, concurrency)
        if concurrency == results["floor_concurrency"]:
            floor = check
        ratio = "n/a" if check.throughput_ratio is None else f"{check.throughput_ratio:.2f}x"
        steady = ("n/a" if check.steady_throughput_ratio is None
                  else f"{check.steady_throughput_ratio:.2f}x")
        reduction = ("n/a" if check.ttft_p95_reduction is None
                     else f"{check.ttft_p95_reduction * 100:.0f}% lower"
                     if check.ttft_p95_reduction >= 0
                     else f"{-check.ttft_p95_reduction * 100:.0f}% higher")
        lines.append(f"| {concurrency} | {ratio} | {steady} | {reduction} |")
    return lines, floor


def render_markdown(results: dict[str, Any], plot_paths: dict[str, Path],
                    markdown_path: Path) -> str:
    env, workload = results["environment"], results["workload"]
    rel = {key: os.path.relpath(path, markdown_path.parent) for key, path in plot_paths.items()}
    comparison, floor = _comparison(results)
    floor_line = "not measured (the floor concurrency was not part of this run)"
    if floor is not None and floor.throughput_ratio is not None:
        verdict = "PASS" if floor.passed else "FAIL"
        steady = ("" if floor.steady_throughput_ratio is None else
                  f" (steady state, while all {floor.concurrency} requests were in flight: "
                  f"{floor.steady_throughput_ratio:.2f}x)")
        floor_line = (f"**{verdict}** at concurrency {floor.concurrency}: continuous delivers "
                      f"{floor.throughput_ratio:.2f}x static's output tokens/s{steady} (floor "
                      f"2x, judged on whole-level tokens/s) and its p95 TTFT is "
                      f"{_pct(floor.ttft_p95_reduction)} lower (floor 40%).")
    lines = [
        "# Serving benchmark: static vs continuous batching", "",
        f"Generated by `iterserve bench` on {results['started_at']}; raw numbers in "
        f"`{results['json_path']}`. Command:", "",
        "```", results["command"], "```", "",
        "## Verdict", "", floor_line, "",
        "## Setup", "",
        f"* Machine: {env['cpu_count']} CPU cores, {env['platform']}, GPU: {env['gpu']}.",
        f"* Model: `{env['model']}`; engine flags shared by both modes: "
        f"`{' '.join(results['serve_args']) or '(defaults)'}`"
        + (f", server environment `{results['serve_env']}`" if results.get("serve_env") else "")
        + "; only `--batching` differs.",
        f"* Workload (seed {workload['seed']}): prompt buckets {workload['prompt_buckets']}; "
        f"output lengths {workload['output_lengths']}; `ignore_eos`, so lengths are exact. "
        f"Each concurrency level sends the same first N requests to both modes "
        f"(N = {workload['requests_per_level']}).",
        "* Both deployments run side by side; at each concurrency the two modes run back to "
        "back, alternating which goes first, so changes in background load hit both alike.",
        f"* Closed loop: `c` requests in flight; each finished request is replaced at once. "
        f"Goodput SLO: {results['slo']}.", "",
        "## Results", "",
        "| mode | c | done | output tok/s | steady tok/s | TTFT p50 ms | TTFT p95 ms | "
        "TTFT p99 ms | TPOT mean ms | ITL p99 ms | KV peak | KV mean | out-of-blocks | "
        "preemptions | goodput req/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        lines += _level_rows(mode, results["modes"].get(mode, {}).get("levels", []))
    lines += ["", "## Continuous vs static", "", *comparison, "",
              f"![throughput]({rel['throughput']})", "", f"![p95 TTFT]({rel['ttft']})", "",
              f"![KV usage]({rel['kv']})", "",
              "## Definitions", "",
              "TTFT: request sent to first streamed token. TPOT: (E2E - TTFT) / (output tokens "
              "- 1) per request. ITL: every gap between streamed chunks, pooled. Output tokens/s: "
              "all output tokens / level wall time (first send to last reply), as vLLM reports "
              "it; it includes the level's final drain, when fewer than c requests remain. "
              "Steady tok/s: tokens streamed while all c requests were in flight (from the "
              "level's start to the dispatch of its last request) / that time. KV peak/mean: "
              "`iterserve:kv_cache_usage_perc` sampled from GET /metrics every "
              f"{results['sample_interval_s']} s during the level. Out-of-blocks and "
              "preemptions: change of the server counters across the level. Goodput: requests "
              "meeting every SLO / level wall time (DistServe; vLLM `--goodput`).", ""]
    notes = results.get("notes") or []
    if notes:
        lines += ["## Notes", "", *[f"* {note}" for note in notes], ""]
    return "\n".join(lines)


def write_report(results: dict[str, Any], markdown_path: Path, plots_dir: Path) -> Path:
    plot_paths = write_plots(results, plots_dir)
    markdown_path.write_text(render_markdown(results, plot_paths, markdown_path))
    return markdown_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="bench.json written by iterserve bench")
    parser.add_argument("--markdown", type=Path, default=Path("BENCHMARKS_SERVING.md"),
                        help="where the markdown report is written")
    parser.add_argument("--plots", type=Path, default=RESULTS, help="folder for the PNG plots")
    parser.add_argument("--note", action="append", default=[],
                        help="an extra line for the Notes section (the JSON is not changed)")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    results["notes"] = [*results.get("notes", []), *args.note]
    print(f"wrote {write_report(results, args.markdown, args.plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
