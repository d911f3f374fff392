"""What the suite shows and writes: PASS/FAIL checks, tables, plots, result files, the BENCHMARKS.md report.

Every scenario returns a JSON-ready dict with at least ``scenario``, ``machine``, ``tables``
(``[{"title", "header", "rows"}]``, what the Markdown shows) and ``checks`` (the issue's
targets: ``{"name", "value", "target", "verdict", "detail"}``, verdict PASS / FAIL / SKIPPED /
INFO). ``write_scenario`` writes ``<out>/<scenario>.json`` and ``<out>/<scenario>.md``;
``write_benchmarks_md`` writes the report of an ``all`` run. The standalone probes print with
``print_table`` and keep their JSON with ``write_results``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

PASS, FAIL, SKIPPED, INFO = "PASS", "FAIL", "SKIPPED", "INFO"
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def check(name: str, value: float | None, target: float, unit: str = "x", detail: str = "",
          skipped: str | None = None, higher_is_better: bool = True) -> dict[str, Any]:
    """One target line. ``value`` None (or ``skipped`` set) makes it SKIPPED with the reason."""
    if skipped is not None or value is None or (isinstance(value, float) and math.isnan(value)):
        return {"name": name, "value": None, "target": target, "unit": unit, "verdict": SKIPPED,
                "detail": skipped or detail or "not measured"}
    ok = value >= target if higher_is_better else value <= target
    return {"name": name, "value": round(float(value), 4), "target": target, "unit": unit,
            "verdict": PASS if ok else FAIL, "detail": detail, "higher_is_better": higher_is_better}


def info(name: str, value: Any, detail: str = "") -> dict[str, Any]:
    return {"name": name, "value": value, "target": None, "unit": "", "verdict": INFO, "detail": detail}


def _op(c: dict[str, Any]) -> str:
    """The comparison a check's target is read with (a SKIPPED check has no direction: >=)."""
    return ">=" if c.get("higher_is_better", True) else "<="


def check_line(c: dict[str, Any]) -> str:
    if c["verdict"] == INFO:
        return f"INFO  {c['name']}: {_fmt(c['value'])} {c['detail']}".rstrip()
    if c["verdict"] == SKIPPED:
        return f"SKIPPED  {c['name']} (target >= {c['target']}{c['unit']}): {c['detail']}"
    line = f"{c['verdict']}  {c['name']}: {_fmt(c['value'])}{c['unit']} (target {_op(c)} {c['target']}{c['unit']})"
    return f"{line}  {c['detail']}".rstrip()


def percentiles(values: Sequence[float], qs: Iterable[int] = (50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles (numpy's default); None for an empty list."""
    vals = sorted(v for v in values if v is not None)
    out: dict[str, float | None] = {}
    for q in qs:
        if not vals:
            out[f"p{q}"] = None
            continue
        pos = (len(vals) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
    return out


def median(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    return {"title": title, "header": list(header), "rows": [list(r) for r in rows]}


def markdown_table(t: dict[str, Any]) -> str:
    lines = [f"**{t['title']}**", "", "| " + " | ".join(t["header"]) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(t["header"]))) + "|"]
    for row in t["rows"]:
        lines.append("| " + " | ".join(_fmt(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def scenario_markdown(result: dict[str, Any], image_dir: str | None = None, heading: str = "##") -> str:
    """The scenario as Markdown: heading, notes, tables, checks, plots (``image_dir``: link prefix)."""
    out = [f"{heading} {result.get('title', result['scenario'])}", ""]
    m = result.get("machine", {})
    if m:
        foreign = m.get("foreign_cpu_cores")
        out += [f"_{m.get('time')}, threads {m.get('threads')}, load average (1 min) at the end "
                f"{m.get('loadavg_1m')}" + (f", other processes used {foreign} cores meanwhile" if foreign is not None
                                            else "") + "_", ""]
    for note in result.get("notes", []):
        out += [note, ""]
    for t in result.get("tables", []):
        out += [markdown_table(t), ""]
    if result.get("checks"):
        out += ["```", *[check_line(c) for c in result["checks"]], "```", ""]
    for plot in result.get("plots", []):
        name = Path(plot).name
        src = f"{image_dir.rstrip('/')}/{name}" if image_dir else name
        out += [f"![{result['scenario']}]({src})", ""]
    return "\n".join(out)


def write_scenario(result: dict[str, Any], out_dir: str | os.PathLike | None = None) -> Path:
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['scenario']}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    (out / f"{result['scenario']}.md").write_text(scenario_markdown(result) + "\n")
    return path


def print_result(result: dict[str, Any]) -> None:
    for t in result.get("tables", []):
        print_table(t["title"], t["rows"], t["header"])
    for note in result.get("notes", []):
        print(f"  {note}")
    if result.get("checks"):
        print()
        for c in result["checks"]:
            print("  " + check_line(c))
    for plot in result.get("plots", []):
        print(f"  plot: {plot}")


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure on the Agg backend (no display), or None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, None
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height))
    return fig, axes


def finish_axes(ax: Any, title: str, xlabel: str, ylabel: str, legend: bool = True) -> None:
    """The suite's common axis dressing: labels, title, a small legend, a light grid."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def save_figure(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)



def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def verdict(value: float | None, target: float) -> str:
    return "PASS" if value is not None and value >= target else "FAIL"


def print_table(title: str, rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def write_results(name: str, result: dict[str, Any], path: str | os.PathLike | None = None) -> Path:
    """Write ``result`` as JSON to ``path`` or ``bench/results/<name>-<timestamp>.json``."""
    if path is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


@dataclass
class Progress:
    """A tqdm bar (to stderr) when tqdm is installed and enabled; a no-op otherwise."""

    total: int
    desc: str
    enabled: bool = True
    _bar: Any = field(default=None, init=False)

    def __enter__(self) -> "Progress":
        if self.enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=self.total, desc=self.desc, unit="req", leave=False, file=sys.stderr)
            except ImportError:
                self._bar = None
        return self

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()


# ---- the BENCHMARKS.md report of an `all` run ---------------------------------------------------
def summary_markdown(results: list[dict[str, Any]], run: dict[str, Any]) -> str:
    lines = ["| target | value | verdict |", "|---|---:|---|"]
    for r in results:
        for c in r.get("checks", []):
            if c["verdict"] in (PASS, FAIL, SKIPPED):
                target = f" ({_op(c)} {c['target']}{c['unit']})" if c.get("target") is not None else ""
                value = "-" if c["value"] is None else f"{c['value']:.3g}{c['unit']}"
                verdict = c["verdict"] + (f": {c['detail']}" if c["verdict"] == SKIPPED else "")
                lines.append(f"| {c['name']}{target} | {value} | {verdict} |")
    return "\n".join(lines)


NOTES_BEGIN, NOTES_END = "<!-- notes: kept when the file is regenerated -->", "<!-- /notes -->"


def _kept_notes(path: Path) -> str:
    """The hand-written block between the notes markers of an existing report, if any."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    if NOTES_BEGIN in text and NOTES_END in text:
        return text.split(NOTES_BEGIN, 1)[1].split(NOTES_END, 1)[0].strip("\n")
    return ""


def write_benchmarks_md(results: list[dict[str, Any]], run: dict[str, Any], path: Path, plots_dir: Path) -> None:
    """The Markdown report: command, machine, load, the targets, then every scenario with its
    plots (copied into ``plots_dir``). A block between the notes markers survives regeneration."""
    notes = _kept_notes(path)
    plots_dir.mkdir(parents=True, exist_ok=True)
    for r in results:
        for plot in r.get("plots", []):
            shutil.copyfile(plot, plots_dir / Path(plot).name)
    rel = os.path.relpath(plots_dir, path.parent)
    m = run["machine"]
    out = [
        "# kvserve benchmarks",
        "",
        "Generated by the suite itself (`bench/`, issue 7); rerun with the command below, which rewrites this file.",
        "Numbers move with the machine: it is shared, so compare the ratios (kvserve and its peers run back to back",
        "in one run), not the absolute tokens/s across runs.",
        "",
        "```",
        run["command"],
        "```",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores visible, {m['mem_gib']} GiB RAM; Python {m['python']}, "
        f"torch {m['torch']}, transformers {m['transformers']}, {m['threads']} torch threads",
        f"- run: {run['started']} to {run['finished']} ({run['wall_s'] / 60:.1f} min), mode "
        f"{'quick' if run['quick'] else 'full'}",
        f"- load: load average {run['loadavg_before']} before, {run['loadavg_after']} after; other processes used "
        f"{run['foreign_cpu_cores']} cores on average during the run (the machine is shared with other engineers' "
        "test runs, so absolute numbers are pessimistic)",
        f"- peers: {run.get('peers_versions', '-')}",
        "",
        "## Targets",
        "",
        summary_markdown(results, run),
        "",
        NOTES_BEGIN,
        notes,
        NOTES_END,
        "",
    ]
    for r in results:
        out.append(scenario_markdown(r, image_dir=rel))
    path.write_text("\n".join(out).rstrip() + "\n")
