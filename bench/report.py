"""Result files of the suite: JSON + a Markdown table per scenario, PASS/FAIL checks, plots.

Every scenario returns a JSON-ready dict with at least ``scenario``, ``machine``, ``tables``
(``[{"title", "header", "rows"}]``, what the Markdown shows) and ``checks`` (the issue's
targets: ``{"name", "value", "target", "verdict", "detail"}``, verdict PASS / FAIL / SKIPPED /
INFO). ``write_scenario`` writes ``<out>/<scenario>.json`` and ``<out>/<scenario>.md``.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from bench.common import RESULTS_DIR, _fmt, print_table

PASS, FAIL, SKIPPED, INFO = "PASS", "FAIL", "SKIPPED", "INFO"


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


def check_line(c: dict[str, Any]) -> str:
    if c["verdict"] == INFO:
        return f"INFO  {c['name']}: {_fmt(c['value'])} {c['detail']}".rstrip()
    if c["verdict"] == SKIPPED:
        return f"SKIPPED  {c['name']} (target >= {c['target']}{c['unit']}): {c['detail']}"
    op = ">=" if c.get("higher_is_better", True) else "<="
    line = f"{c['verdict']}  {c['name']}: {_fmt(c['value'])}{c['unit']} (target {op} {c['target']}{c['unit']})"
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
