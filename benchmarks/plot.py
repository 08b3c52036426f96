"""Plots a ``benchmarks/run.py`` JSON file: speedup bars (ours over eager and
over torch.compile, per problem, mode and dtype) and, when the run had
``--sweep``, time against batch size per problem.  Writes PNGs beside the JSON.

    python benchmarks/plot.py results/NVIDIA_H100_80GB_HBM3-2026-11-22.json
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path):
    path = Path(path)
    data = json.loads(path.read_text())
    rows, meta = data["rows"], data["meta"]
    # Rows of implementations that failed have no times.
    rows = [r for r in rows if r.get("median_ms") is not None]
    main_rows = [r for r in rows if not r.get("sweep")]
    by = {(r["problem"], r["dtype"], r["mode"], r["impl"]): r["median_ms"] for r in main_rows}
    dtypes = sorted({r["dtype"] for r in main_rows})
    problems = sorted({r["problem"] for r in main_rows})
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(11, 3.2 * len(dtypes)), squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, mode in enumerate(("forward", "train")):
            ax = axes[i][j]
            xs = range(len(problems))
            for k, base in enumerate(("eager", "compile")):
                vals = [by.get((p, dtype, mode, base), float("nan"))
                        / by.get((p, dtype, mode, "ours"), float("nan"))
                        for p in problems]
                ax.bar([x + 0.4 * k for x in xs], vals, width=0.4, label=f"ours vs {base}")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks([x + 0.2 for x in xs], [str(p) for p in problems])
            ax.set_title(f"{dtype}, {mode}")
            ax.set_ylabel("speedup (x)")
            ax.legend(fontsize=8)
    fig.suptitle(f"cupy-fused speedup, {meta['device']}, torch {meta['torch']}, {meta['date']}")
    fig.tight_layout()
    out = path.with_suffix(".speedup.png")
    fig.savefig(out, dpi=110)
    print(out)

    sweep = [r for r in rows if r.get("sweep")]
    if sweep:
        _plot_sweep(sweep, meta, path.with_suffix(".sweep.png"))


# Implementation -> colour, mode -> line style: one grid of panels (a row per
# dtype, a column per problem) read with one legend.
IMPL_STYLE = {"eager": dict(color="C0"), "compile": dict(color="C2"), "ours": dict(color="C1"),
              "ours+compile": dict(color="C3"), "ours+graphs": dict(color="C4"),
              "gemm": dict(color="0.5", lw=0.8)}
MODE_STYLE = {"forward": "-", "train": "--"}


def _plot_sweep(sweep, meta, out):
    """Time against batch size, per problem (columns) and dtype (rows)."""
    problems = sorted({r["problem"] for r in sweep})
    dtypes = sorted({r["dtype"] for r in sweep})
    fig, axes = plt.subplots(len(dtypes), len(problems), squeeze=False,
                             figsize=(3.3 * len(problems), 2.9 * len(dtypes)))
    for i, dtype in enumerate(dtypes):
        for j, problem in enumerate(problems):
            ax = axes[i][j]
            series = sorted({(r["impl"], r["mode"]) for r in sweep
                             if r["problem"] == problem and r["dtype"] == dtype})
            for impl, mode in series:
                pts = sorted((r["batch"], r["median_ms"]) for r in sweep
                             if r["problem"] == problem and r["dtype"] == dtype
                             and r["impl"] == impl and r["mode"] == mode)
                ax.loglog(*zip(*pts), marker="o", ms=2.5, ls=MODE_STYLE.get(mode, "-"),
                          label=f"{impl}, {mode}", **IMPL_STYLE.get(impl, {}))
            ax.set_title(f"problem {problem}, {dtype}", fontsize=9)
            ax.tick_params(labelsize=7)
            if i == len(dtypes) - 1:
                ax.set_xlabel("batch", fontsize=8)
            if j == 0:
                ax.set_ylabel("ms (median)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"time against batch size, {meta['device']}, torch {meta['torch']}, "
                 f"{meta['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=100)
    print(out)

if __name__ == "__main__":
    main(sys.argv[1])
