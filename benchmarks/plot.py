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
                vals = [by.get((p, dtype, mode, base), float("nan")) / by.get((p, dtype, mode, "ours"), float("nan"))
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
        problems = sorted({r["problem"] for r in sweep})
        fig, axes = plt.subplots(1, len(problems), figsize=(4 * len(problems), 3.4), squeeze=False)
        for ax, p in zip(axes[0], problems):
            for (impl, mode, dtype) in sorted({(r["impl"], r["mode"], r["dtype"]) for r in sweep
                                               if r["problem"] == p and r["impl"] != "gemm"}):
                pts = sorted((r["batch"], r["median_ms"]) for r in sweep if r["problem"] == p
                             and r["impl"] == impl and r["mode"] == mode and r["dtype"] == dtype)
                ax.loglog(*zip(*pts), marker="o", ms=3, label=f"{impl} {mode} {dtype}")
            ax.set_title(f"problem {p}")
            ax.set_xlabel("batch")
            ax.set_ylabel("ms")
            ax.legend(fontsize=6)
        fig.tight_layout()
        out = path.with_suffix(".sweep.png")
        fig.savefig(out, dpi=110)
        print(out)


if __name__ == "__main__":
    main(sys.argv[1])
