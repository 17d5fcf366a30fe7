#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Turns kvport_bench's Google Benchmark JSON into a markdown report and a plot.

Usage: scripts/bench_report.py BENCH.json --markdown OUT.md [--plot OUT.png]
                               [--command "the command that produced BENCH.json"]

The zeroing benchmarks ("Zeroing/<backend>/<model>/<layout>/<ids>/<batch>/...")
carry three strategies measured in the same iterations: (a) reference, one
memset per layer for K and V per block; (b) batched, PagedKvCache::zero_blocks;
(c) limit, one contiguous memset of the same bytes. With
--benchmark_repetitions, every figure in the report is the median over the
repetitions (ratios included: the median of the per-repetition ratio, which
compares strategies measured in the same run). The core-ops benchmarks
(BM_*) give ns per operation from items_per_second.

Plot: zeroing throughput (GB/s) against batch size, one subplot per model
(columns) and layout (rows); solid lines scattered ids, dotted contiguous.
"""

import argparse
import json
import statistics
import sys
from collections import OrderedDict

GB = 1e9
STRATEGIES = [("reference", "(a) reference"), ("batched", "(b) batched"), ("limit", "(c) limit")]
COLORS = {"reference": "tab:red", "batched": "tab:blue", "limit": "tab:green"}

# The targets of the host backend (docs/performance.md).
TARGET_MODEL, TARGET_BATCH, TARGET_RATIO = "llama-3-70b", 256, 0.8
TARGET_ALLOC_FREE_NS = 10.0


def load_runs(path):
    """{run_name: {"kind": "zeroing"|"core", "counters": {key: median}, ...}} in file order."""
    with open(path) as f:
        data = json.load(f)
    iterations = OrderedDict()
    aggregates = OrderedDict()
    for b in data.get("benchmarks", []):
        if b.get("error_occurred"):
            print(f"bench_report: {b['name']}: error: {b.get('error_message')}", file=sys.stderr)
            continue
        run_name = b.get("run_name", b["name"])
        if b.get("run_type") == "aggregate":
            aggregates.setdefault(run_name, {})[b.get("aggregate_name")] = b
        else:
            iterations.setdefault(run_name, []).append(b)

    runs = OrderedDict()
    for run_name in list(iterations) + [n for n in aggregates if n not in iterations]:
        if run_name in iterations:
            reps = iterations[run_name]
            keys = [k for k, v in reps[0].items() if isinstance(v, (int, float))
                    and not isinstance(v, bool)]
            values = {k: statistics.median(r[k] for r in reps if k in r) for k in keys}
            label = reps[0].get("label", "")
            count = len(reps)
        else:
            agg = aggregates[run_name].get("median") or aggregates[run_name].get("mean")
            if agg is None:
                continue
            values = {k: v for k, v in agg.items() if isinstance(v, (int, float))
                      and not isinstance(v, bool)}
            label = agg.get("label", "")
            count = int(agg.get("repetitions", 1))
        runs[run_name] = {"values": values, "label": label, "repetitions": count}
    return data.get("context", {}), runs


def parse_zeroing(runs):
    cases = []
    for name, run in runs.items():
        parts = name.split("/")
        if parts[0] != "Zeroing" or len(parts) < 6:
            continue
        v = run["values"]
        case = {
            "backend": parts[1], "model": parts[2], "layout": parts[3], "ids": parts[4],
            "batch": int(parts[5]), "bytes": v.get("bytes", 0),
            "batched_over_limit": v.get("batched_over_limit", float("nan")),
            "batched_over_reference": v.get("batched_over_reference", float("nan")),
            "repetitions": run["repetitions"],
        }
        for s, _ in STRATEGIES:
            case[s] = {"bytes_per_s": v.get(f"{s}_bytes_per_s", float("nan")),
                       "calls": v.get(f"{s}_calls", float("nan"))}
        cases.append(case)
    return cases


def parse_core(runs):
    rows = []
    for name, run in runs.items():
        if not name.startswith("BM_"):
            continue
        ips = run["values"].get("items_per_second")
        if not ips:
            continue
        rows.append({"name": name, "ns_per_op": 1e9 / ips, "label": run["label"],
                     "repetitions": run["repetitions"]})
    return rows


def fmt_bytes(n):
    n = float(n)
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"]:
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def fmt_calls(c):
    return f"{c:.0f}" if c == int(c) else f"{c:.1f}"


def order_key(models, layouts):
    return lambda c: (models.index(c["model"]), layouts.index(c["layout"]), c["ids"] != "scattered",
                      c["batch"])


def first_seen(values):
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def write_markdown(path, preset, context, cases, core, command):
    lines = [f"# kvport benchmarks: `{preset}` preset", ""]
    if command:
        lines += ["Command:", "", "```sh", command, "```", ""]
    ctx = []
    for key, label in [("date", "date"), ("host_name", "host"), ("num_cpus", "CPUs"),
                       ("mhz_per_cpu", "MHz per CPU"), ("library_build_type", "Google Benchmark library build"),
                       ("load_avg", "load average at the start")]:
        if key in context:
            value = context[key]
            if isinstance(value, list):
                value = ", ".join(f"{x:.2f}" for x in value)
            ctx.append(f"{label} {value}")
    if ctx:
        lines += ["Context (from Google Benchmark): " + "; ".join(ctx) + ".", ""]
    reps = sorted({c["repetitions"] for c in cases} | {r["repetitions"] for r in core})
    if reps:
        lines += [f"Repetitions per benchmark: {', '.join(map(str, reps))}; every figure is the "
                  "median over the repetitions.", ""]

    for backend in first_seen(c["backend"] for c in cases):
        bc = [c for c in cases if c["backend"] == backend]
        models = first_seen(c["model"] for c in bc)
        layouts = first_seen(c["layout"] for c in bc)
        bc.sort(key=order_key(models, layouts))
        lines += [f"## Block zeroing on the `{backend}` backend", "",
                  "(a) reference: one memset per layer for K and one for V, per block; "
                  "(b) batched: `PagedKvCache::zero_blocks`, one backend call per batch; "
                  "(c) limit: one contiguous memset of the same bytes. Throughput in GB/s "
                  "(10^9 bytes/s) of device time; calls are backend contract calls per batch; "
                  "b/c and b/a are the ratios of (b)'s throughput to (c)'s and (a)'s, "
                  "measured in the same iterations.", "",
                  "| model | layout | ids | batch | bytes | (a) GB/s | (b) GB/s | (c) GB/s "
                  "| (a) calls | (b) calls | (c) calls | b/c | b/a |",
                  "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for c in bc:
            lines.append(
                f"| {c['model']} | {c['layout']} | {c['ids']} | {c['batch']} | "
                f"{fmt_bytes(c['bytes'])} | "
                + " | ".join(f"{c[s]['bytes_per_s'] / GB:.2f}" for s, _ in STRATEGIES) + " | "
                + " | ".join(fmt_calls(c[s]["calls"]) for s, _ in STRATEGIES) + " | "
                f"{c['batched_over_limit']:.2f}x | {c['batched_over_reference']:.1f}x |")
        lines.append("")

        # The targets, read off the table.
        checks = []
        for c in bc:
            if (c["model"], c["ids"], c["batch"]) == (TARGET_MODEL, "scattered", TARGET_BATCH):
                ok = c["batched_over_limit"] >= TARGET_RATIO
                checks.append(f"- (b)/(c), {TARGET_BATCH} scattered {TARGET_MODEL} blocks, "
                              f"{c['layout']}: **{c['batched_over_limit']:.2f}x** "
                              f"(target >= {TARGET_RATIO}x: {'met' if ok else 'missed'})")
        bad = [c for c in bc if c["batched"]["calls"] != 1]
        if bc:
            top = max(c["batch"] for c in bc)
            reference = []
            for model in models:
                c = next(c for c in bc if c["model"] == model and c["batch"] == top)
                calls = c["reference"]["calls"]
                reference.append(f"{fmt_calls(calls)} = 2 x {fmt_calls(calls / (2 * top))} layers "
                                 f"x {top} blocks ({model})")
            checks.append("- (b) backend calls per batch: " +
                          ("**1 in every case**" if not bad else
                           f"**not 1 in {len(bad)} cases**") +
                          "; (a): " + ", ".join(reference))
        if checks:
            lines += ["Targets:", ""] + checks + [""]

    if core:
        lines += ["## Block management (host side)", "",
                  "ns per operation = 1e9 / items_per_second. An alloc+free pair is one item of "
                  "`BM_AllocFreePair`; `BM_FreeBlocksTable1k` counts one item per block freed.", "",
                  "| benchmark | ns/op | note |", "|---|--:|---|"]
        for r in core:
            lines.append(f"| `{r['name']}` | {r['ns_per_op']:.2f} | {r['label']} |")
        lines.append("")
        pair = next((r for r in core if r["name"] == "BM_AllocFreePair/trace:0"), None)
        if pair:
            ok = pair["ns_per_op"] <= TARGET_ALLOC_FREE_NS
            lines += [f"Target: alloc+free pair with tracing off **{pair['ns_per_op']:.2f} ns** "
                      f"(target <= {TARGET_ALLOC_FREE_NS:.0f} ns: {'met' if ok else 'missed'}).",
                      ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_plot(path, preset, cases):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    backends = first_seen(c["backend"] for c in cases)
    models = first_seen(c["model"] for c in cases)
    layouts = first_seen(c["layout"] for c in cases)
    rows = [(b, l) for b in backends for l in layouts]
    width = max(4.6 * len(models), 8.0)
    fig, axes = plt.subplots(len(rows), len(models), figsize=(width, 3.6 * len(rows) + 0.8),
                             squeeze=False, sharex=True)
    ymax = max(c[s]["bytes_per_s"] for c in cases for s, _ in STRATEGIES) / GB
    for i, (backend, layout) in enumerate(rows):
        for j, model in enumerate(models):
            ax = axes[i][j]
            sel = [c for c in cases
                   if (c["backend"], c["layout"], c["model"]) == (backend, layout, model)]
            for ids, style in [("scattered", "-"), ("contiguous", ":")]:
                pts = sorted((c for c in sel if c["ids"] == ids), key=lambda c: c["batch"])
                if not pts:
                    continue
                xs = [c["batch"] for c in pts]
                for s, _ in STRATEGIES:
                    ax.plot(xs, [c[s]["bytes_per_s"] / GB for c in pts], style,
                            color=COLORS[s], marker="o" if ids == "scattered" else None,
                            linewidth=2 if ids == "scattered" else 1.2)
            ax.set_xscale("log", base=2)
            batches = sorted({c["batch"] for c in sel})
            ax.set_xticks(batches)
            ax.set_xticklabels([str(b) for b in batches])
            ax.set_ylim(0, ymax * 1.08)
            ax.grid(True, which="major", alpha=0.3)
            title = f"{model}, {layout}"
            if len(backends) > 1:
                title = f"{backend}: {title}"
            ax.set_title(title, fontsize=10)
            if i == len(rows) - 1:
                ax.set_xlabel("batch size (blocks, log scale)")
            if j == 0:
                ax.set_ylabel("zeroing throughput (GB/s)")
    handles = [Line2D([], [], color=COLORS[s], linewidth=2, label=label)
               for s, label in STRATEGIES]
    handles += [Line2D([], [], color="gray", linestyle="-", marker="o", label="scattered ids"),
                Line2D([], [], color="gray", linestyle=":", label="contiguous ids")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles) if width >= 12 else 3,
               frameon=False)
    fig.suptitle(f"kvport block zeroing throughput, {preset} preset")
    fig.tight_layout(rect=(0, 0.06 if width >= 12 else 0.1, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="Google Benchmark JSON from kvport_bench")
    parser.add_argument("--markdown", required=True, help="markdown report to write")
    parser.add_argument("--plot", help="PNG plot to write")
    parser.add_argument("--preset", default="host", help="preset name, for the titles")
    parser.add_argument("--command", default="", help="the command that produced the JSON")
    args = parser.parse_args()

    context, runs = load_runs(args.json)
    cases = parse_zeroing(runs)
    core = parse_core(runs)
    if not cases and not core:
        sys.exit(f"bench_report: no kvport benchmarks in {args.json}")
    write_markdown(args.markdown, args.preset, context, cases, core, args.command)
    print(f"bench_report: wrote {args.markdown}")
    if args.plot:
        if cases:
            write_plot(args.plot, args.preset, cases)
            print(f"bench_report: wrote {args.plot}")
        else:
            print("bench_report: no zeroing benchmarks, no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
