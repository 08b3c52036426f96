"""Publishes result files of ``benchmarks/run.py``: the latest tables of
docs/performance.md and README.md, ``results/latest.json`` and a row of
``results/history.jsonl``.  ``run.py`` calls it at the end of a complete
run whose results file is in the repository's ``results/``; by hand:

    python benchmarks/publish.py results/<device>-<date>.json [more.json ...]
    python benchmarks/publish.py                      # redraw the tables from latest.json
    python benchmarks/publish.py --fresh --no-history A.json B.json   # rebuild latest.json

``results/latest.json`` holds the rows the tables show (``{"sources":
{file: meta}, "rows": [...]}``, each row with the ``source`` file it came
from).  Publishing merges the given files into it, in order: the rows of
one (problem, dtype, mode, batch of a sweep point) in a later file replace
all the rows of that key before them, in place, and keys not in the later
file keep their rows.  So a partial run (``--dtypes bf16 --problems 37 88
94``) replaces just those rows.  A key's rows are replaced together, never
one implementation at a time: the implementations of one row are timed in
turns in one run, and their ratios mean little across runs.

The tables are written between markers, and nothing outside them:
``<!-- latest-run:start ... -->`` / ``<!-- latest-run:end -->`` in
docs/performance.md (the "Latest run" heading, the autocast table and the
model-dtype table) and ``<!-- headline:start ... -->`` / ``<!--
headline:end -->`` in README.md (the paragraph's leading "<GPU>, <date>,
<n> run(s)," and the headline table; the rest of the paragraph is prose).

The history row: the date, run label and device of the published files,
the commit they measured (their ``meta["commit"]``; ``git rev-parse
--short HEAD`` where a file has none), torch / CUDA versions and,
per problem, dtype and mode at the benchmark shape, torch.compile's time
over ours (e.g. ``"76 bfloat16 train ours/compile": <ratio>``).

This module needs no torch: ``markdown`` (the results table that run.py
also writes beside its JSON) lives here for that reason.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The README's headline table: these dtypes, then these problems, in order.
HEADLINE_DTYPES = ("amp-bf16", "bfloat16", "float32")
HEADLINE_PROBLEMS = (37, 76, 88, 94, 1)
SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
MARKERS = {"performance": "latest-run", "readme": "headline"}


def _ms(value) -> str:
    return "nan" if value is None else f"{value:.3f}"


def markdown(rows) -> str:
    """The Markdown table of the rows at the benchmark shapes: one line per
    problem, dtype and mode.  The columns of CUDA graphs (ours+graphs,
    ours+graphed, compile+graphs) and the host columns (ours's host issue /
    GPU time per step, which implementations are host-bound, and
    torch.compile's GPU time per step over ours's) appear when the rows
    have them; implementations that failed are listed under the table.  Where a step is host-bound, its
    "ours/compile speedup" (of event times) compares the implementations'
    host issue times; the GPU-time ratio says what their kernels do.

    Args:
        rows: result rows of ``run.bench_problem``.

    Returns:
        The Markdown text.
    """
    key = lambda r: (r["problem"], r["dtype"], r["mode"], r["batch"])  # noqa: E731
    groups = {}
    for r in rows:
        groups.setdefault(key(r), {})[r["impl"]] = r
    graphs = [i for i in ("ours+graphs", "ours+graphed", "compile+graphs")
              if any(r["impl"] == i for r in rows)]
    host = any(r.get("host_ms") is not None for r in rows)
    head = ["problem", "dtype", "mode", "eager ms", "compile ms", "ours ms", "ours+compile ms"]
    head += [f"{i} ms" for i in graphs]
    head += ["GEMM/conv alone ms", "ours/eager speedup", "ours/compile speedup",
             "peak extra GiB (eager / compile / ours)", "ours TFLOP/s (of ceiling)"]
    head += ["ours host / GPU ms per step", "host-bound", "ours/compile on GPU time"] * host
    head += ["fwd rel. error vs fp64 (ours / eager / compile)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    failed = []
    for (p, d, m, _), g in groups.items():
        def get(i, f="median_ms"):
            value = g[i].get(f) if i in g else None
            return float("nan") if value is None else value

        mem = " / ".join(f"{get(i, 'peak_extra_gib'):.3f}" for i in ("eager", "compile", "ours"))
        cells = [p, d, m] + [f"{get(i):.3f}" for i in ("eager", "compile", "ours", "ours+compile")]
        cells += [f"{get(i):.3f}" for i in graphs]
        cells += [f"{get('gemm'):.3f}", f"{get('eager') / get('ours'):.2f}x",
                  f"{get('compile') / get('ours'):.2f}x", mem if m == "train" else "-",
                  f"{get('ours', 'tflops'):.1f} ({100 * get('ours', 'ceiling_fraction'):.0f}%)"]
        if host:
            ours = g.get("ours", {})
            cells.append(f"{_ms(ours.get('host_ms'))} / {_ms(ours.get('gpu_ms'))}")
            bound = [i for i, r in g.items() if r.get("host_bound")]
            cells.append(", ".join(bound) if bound else "-")
            gpu = get("compile", "gpu_ms") / get("ours", "gpu_ms")
            cells.append("-" if math.isnan(gpu) else f"{gpu:.2f}x")  # a GPU time missing
        errors = [get("ours", "fwd_rel_error"), get("eager", "fwd_rel_error"),
                  get("compile", "compile_fwd_rel_error")]
        cells.append(" / ".join("-" if math.isnan(e) else f"{e:.1e}" for e in errors))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        failed += [f"- {p} {d} {m} {i}: {r['error']}" for i, r in g.items() if r.get("error")]
    if failed:
        lines += ["", "Failed (no times):", ""] + failed
    return "\n".join(lines)


def merge_key(row: dict) -> tuple:
    """The key a later file's rows replace an earlier one's by: (problem,
    dtype label, mode, batch of a sweep point or None)."""
    return (row["problem"], row["dtype"], row["mode"], row["batch"] if row.get("sweep") else None)


def merge(rows, newer) -> list:
    """``rows`` with the keys of ``newer`` replaced by its rows.

    Args:
        rows: the current rows.
        newer: rows of a later run.

    Returns:
        The merged rows: a replaced key's new rows where its old ones
        were, keys new to ``rows`` at the end.
    """
    groups = {}
    for r in newer:
        groups.setdefault(merge_key(r), []).append(r)
    out, placed = [], set()
    for r in rows:
        k = merge_key(r)
        if k not in groups:
            out.append(r)
        elif k not in placed:
            out += groups[k]
            placed.add(k)
    return out + [r for k, g in groups.items() if k not in placed for r in g]


def short_device(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100": the name without the vendor and
    the memory or form factor."""
    name = re.sub(r"^(NVIDIA\s+)?(GeForce\s+|Tesla\s+)?", "", name)
    return re.split(r"[ -](?:\d+GB|PCIe|SXM\d*|HBM\w*|NVL)\b", name)[0]


def run_label(path: str, rows) -> str:
    """The run's name: what its file name has after the date
    ("...-2026-11-24-autocast.json" -> "autocast"), else its dtypes
    ("bf16+fp32")."""
    stem = os.path.basename(path)[:-5] if path.endswith(".json") else os.path.basename(path)
    m = re.search(r"\d{4}-\d{2}-\d{2}-(.+)$", stem)
    if m:
        return m.group(1)
    dtypes = dict.fromkeys(SHORT_DTYPES.get(r["dtype"], r["dtype"]) for r in rows)
    return "+".join(dtypes) or "empty"


def _ratio(by, p, d, mode, base):
    ours, other = by.get((p, d, mode, "ours")), by.get((p, d, mode, base))
    return None if ours is None or other is None else other / ours


def _by_key(rows) -> dict:
    """The timed rows at the benchmark shape by (problem, dtype, mode, impl)."""
    return {(r["problem"], r["dtype"], r["mode"], r["impl"]): r
            for r in rows if not r.get("sweep") and r.get("median_ms") is not None}


def _times(rows) -> dict:
    return {k: r["median_ms"] for k, r in _by_key(rows).items()}


def headline(rows) -> str:
    """The README's headline table: the training step's time of ours and its
    speedup over eager and torch.compile, that over torch.compile on GPU
    time and which sides the host set the pace of (a host-bound row's
    wall-time ratio says how fast the host issues, the GPU time's what the
    kernels do), and the forward's speedup over torch.compile, per (dtype,
    problem) of ``HEADLINE_DTYPES`` x ``HEADLINE_PROBLEMS`` that ``rows``
    time; a ratio without both times is "-".

    Args:
        rows: result rows.

    Returns:
        The Markdown table.
    """
    full = _by_key(rows)
    by = {k: r["median_ms"] for k, r in full.items()}
    lines = ["| problem | mode | training step: ours ms | vs eager | vs torch.compile "
             "| vs torch.compile on GPU time | host-bound | forward: vs torch.compile |",
             "|---|---|---|---|---|---|---|---|"]

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    def on_gpu(p, d):
        ours, other = (full.get((p, d, "train", i), {}).get("gpu_ms") for i in ("ours", "compile"))
        return None if not ours or not other else other / ours

    def bound(p, d):
        sides = [i for i in ("eager", "compile", "ours")
                 if full.get((p, d, "train", i), {}).get("host_bound")]
        return ", ".join(sides) or "-"

    for d in HEADLINE_DTYPES:
        for p in HEADLINE_PROBLEMS:
            ours = by.get((p, d, "train", "ours"))
            if ours is None:
                continue
            lines.append(f"| {p} | {d} | {ours:.2f} | {x(_ratio(by, p, d, 'train', 'eager'))} "
                         f"| {x(_ratio(by, p, d, 'train', 'compile'))} | {x(on_gpu(p, d))} "
                         f"| {bound(p, d)} | {x(_ratio(by, p, d, 'forward', 'compile'))} |")
    return "\n".join(lines)


def history_ratios(rows) -> dict:
    """{"<problem> <dtype> <mode> ours/compile": compile ms / ours ms} of the
    rows at the benchmark shape, rounded to 3 decimals, keys sorted.  Each
    ratio pairs two times of one file (rows' ``source``: one run); where
    several files give a key, the last one's."""
    out = {}
    for source in dict.fromkeys(r.get("source") for r in rows):
        by = _times([r for r in rows if r.get("source") == source])
        for p, d, mode, impl in by:
            if impl == "ours":
                r = _ratio(by, p, d, mode, "compile")
                if r is not None:
                    out[f"{p} {d} {mode} ours/compile"] = round(r, 3)
    return dict(sorted(out.items()))


def _lead(latest: dict, rows) -> tuple:
    """(GPUs, dates: the oldest "to" the newest where they differ, source
    files) of ``rows`` (rows of ``latest``): the tables' rows may come from
    several runs, and the heading says so."""
    names = list(dict.fromkeys(r["source"] for r in rows))
    metas = [latest["sources"][n] for n in names]
    devices = " / ".join(dict.fromkeys(short_device(m.get("device", "?")) for m in metas))
    dates = sorted({m.get("date", "?") for m in metas}) or ["?"]
    date = dates[-1] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return devices, date, names


def _source_note(meta: dict) -> str:
    """A source file's date, and the commit it measured where it says."""
    date = meta.get("date", "?")
    return f"{date}, commit {meta['commit']}" if meta.get("commit") else date


def performance_section(latest: dict) -> str:
    """The "Latest run" section of docs/performance.md (between its markers):
    heading, the files the rows come from, the table of the autocast modes
    and the table of the model dtypes."""
    rows = [r for r in latest["rows"] if not r.get("sweep")]
    devices, date, names = _lead(latest, rows)
    amp = [r for r in rows if r["dtype"].startswith("amp-")]
    model = [r for r in rows if not r["dtype"].startswith("amp-")]
    files = ",\n".join(f"`{n}` ({_source_note(latest['sources'][n])})" for n in names)
    parts = [f"## Latest run ({devices}, {date})", "",
             f"Rows of {files};\nmerged in `results/latest.json`."]
    if amp:
        parts += ["", "### Under autocast, float32 model", "", markdown(amp)]
    if model:
        in_model = list(dict.fromkeys(SHORT_DTYPES.get(r["dtype"], r["dtype"]) for r in model))
        listed = ", ".join(in_model[:-1]) + " and " * (len(in_model) > 1) + in_model[-1]
        parts += ["", f"### Model in {listed}", "", markdown(model)]
    return "\n".join(parts)


_README_LEAD = re.compile(r"^[^,\n]+, \d{4}-\d{2}-\d{2}(?: to \d{4}-\d{2}-\d{2})?, (?:one run|\w+ runs),")
_COUNTS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TABLE = re.compile(r"(?:^\|.*\n?)+", re.M)


def readme_section(region: str, latest: dict) -> str:
    """The README's headline region with its lead ("H100, 2026-11-24, one
    run,") and its table drawn from ``latest``, its prose as it was.

    Args:
        region: the text between the README's markers.
        latest: the merged rows (``results/latest.json``).

    Returns:
        The new text of the region.
    """
    shown = [r for r in latest["rows"] if not r.get("sweep") and r["dtype"] in HEADLINE_DTYPES
             and r["problem"] in HEADLINE_PROBLEMS]
    devices, date, names = _lead(latest, shown)
    n = len(names)
    runs = f"{_COUNTS[n] if n < len(_COUNTS) else n} run" + "s" * (n != 1)
    body = region.lstrip("\n")
    if not _README_LEAD.match(body) or not _TABLE.search(body):
        raise ValueError("README.md: the headline region needs a paragraph starting "
                         "'<GPU>, <YYYY-MM-DD>, one run,' and a table")
    body = _README_LEAD.sub(f"{devices}, {date}, {runs},", body, count=1)
    return _TABLE.sub(lambda m: headline(latest["rows"]) + "\n", body, count=1).rstrip("\n")


def replace_between(text: str, name: str, new) -> str:
    """``text`` with what lies between ``<!-- name:start ... -->`` and
    ``<!-- name:end -->`` replaced (the markers' lines stay as they are).

    Args:
        text: the file's text.
        name: the markers' name ("headline", "latest-run").
        new: called with the text between the markers, returns its
            replacement.

    Returns:
        The new text.

    Raises:
        ValueError: when the markers are not there once each, in order.
    """
    pattern = re.compile(r"(<!-- %s:start[^\n]*-->\n)(.*?)(\n?<!-- %s:end -->)" % (name, name),
                         re.S)
    found = pattern.findall(text)
    if len(found) != 1:
        raise ValueError(f"expected one <!-- {name}:start --> ... <!-- {name}:end --> pair, "
                         f"found {len(found)}")
    return pattern.sub(lambda m: m.group(1) + new(m.group(2)) + "\n" + m.group(3).lstrip("\n"),
                       text)


def git_commit(root: str):
    """The short hash of ``root``'s HEAD, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def tree_commit(root: str = REPO):
    """The commit a run measures: ``root``'s short HEAD, with "+dirty"
    where its tracked files differ from it; None outside a git checkout
    (a copy of the tree: run.py's ``--commit`` says it)."""
    head = git_commit(root)
    if head is None:
        return None
    try:
        out = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return head
    return head + "+dirty" if out.returncode == 0 and out.stdout.strip() else head


def _source_name(path: str, root: str) -> str:
    path = os.path.abspath(path)
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else rel


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def publish(result_paths, root: str = REPO, history: bool = True, commit=None, run=None,
            fresh: bool = False) -> dict:
    """Merges result files into ``<root>/results/latest.json`` and redraws the
    tables of ``<root>/docs/performance.md`` and ``<root>/README.md`` from it;
    appends a row to ``<root>/results/history.jsonl``.

    Everything is computed before anything is written, so that a missing
    marker leaves every file as it was.

    Args:
        result_paths: JSON files of ``benchmarks/run.py``, oldest first;
            none: redraw the tables from latest.json as it is.
        root: the repository whose files are written.
        history: append the history row (not when ``result_paths`` is
            empty).
        commit: the commit of the history row; default the files'
            ``meta["commit"]`` (the tree each measured), or ``git rev-parse
            --short HEAD`` in ``root`` where one has none.
        run: the run label of the history row; default from the file names
            (:func:`run_label`).
        fresh: start from no rows instead of latest.json (to rebuild it).

    Returns:
        The history row (appended or not), or None without result files.
    """
    root = os.fspath(root)
    latest_path = os.path.join(root, "results", "latest.json")
    if fresh or not os.path.exists(latest_path):
        latest = {"sources": {}, "rows": []}
    else:
        with open(latest_path) as f:
            latest = json.load(f)
    new_rows, metas, labels = [], [], []
    for path in map(os.fspath, result_paths):
        with open(path) as f:
            data = json.load(f)
        name = _source_name(path, root)
        meta = data.get("meta", {})
        if meta.get("quick"):  # (its rows would replace the benchmark shapes' by their keys)
            raise ValueError(f"{path}: a run of small shapes (--quick), not published")
        latest["sources"][name] = {k: meta[k] for k in ("device", "date", "torch", "cuda", "commit")
                                   if k in meta}
        rows = [dict(r, source=name) for r in data["rows"]]
        latest["rows"] = merge(latest["rows"], rows)
        new_rows += [r for r in rows if not r.get("sweep")]
        metas.append(meta)
        labels.append(run_label(path, rows))
    used = {r["source"] for r in latest["rows"]}
    latest["sources"] = {k: v for k, v in latest["sources"].items() if k in used}

    paths = {"performance": os.path.join(root, "docs", "performance.md"),
             "readme": os.path.join(root, "README.md")}
    texts = {}
    for what, path in paths.items():
        with open(path) as f:
            text = f.read()
        draw = ((lambda old: performance_section(latest)) if what == "performance"
                else (lambda old: readme_section(old, latest)))
        try:
            texts[path] = replace_between(text, MARKERS[what], draw)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    row = None
    if result_paths:
        versions = {k: metas[-1][k] for k in ("torch", "cuda") if k in metas[-1]}
        measured = list(dict.fromkeys(m["commit"] for m in metas if m.get("commit")))
        row = dict(date=max(m.get("date", "") for m in metas), run=run or "+".join(labels),
                   device=" / ".join(dict.fromkeys(m.get("device", "?") for m in metas)),
                   commit=commit if commit is not None else (
                       "+".join(measured) if all(m.get("commit") for m in metas)
                       else git_commit(root)))
        if versions:
            row["versions"] = versions
        row["headline"] = history_ratios(new_rows)

    os.makedirs(os.path.dirname(latest_path), exist_ok=True)
    _write(latest_path, json.dumps(latest, indent=1) + "\n")
    for path, text in texts.items():
        _write(path, text)
    if row is not None and history:
        with open(os.path.join(root, "results", "history.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", help="benchmarks/run.py JSON files, oldest first")
    parser.add_argument("--no-history", action="store_true",
                        help="append no row to results/history.jsonl")
    parser.add_argument("--fresh", action="store_true",
                        help="start from the given files alone, not results/latest.json")
    parser.add_argument("--run", default=None, help="the history row's run label")
    parser.add_argument("--root", default=REPO, help="the repository to write (default: this one)")
    args = parser.parse_args(argv)
    row = publish(args.results, root=args.root, history=not args.no_history, run=args.run,
                  fresh=args.fresh)
    print(f"published {len(args.results)} file(s) into {args.root}: results/latest.json, "
          "docs/performance.md, README.md"
          + (", results/history.jsonl" if row is not None and not args.no_history else ""))


if __name__ == "__main__":
    main()
