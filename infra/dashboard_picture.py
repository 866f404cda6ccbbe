"""A picture of the deployment's CloudWatch dashboard, drawn from the synthesized template's dashboard body: each
widget where CloudWatch puts it (its x, y, width and height on the 24-column grid), with its title and the labels of
its metrics. A layout, not data: nothing here has been measured (docs/dashboard.png; README "From deploy to the
TTFT graph").

    python -m infra.dashboard_picture cdk.out/turnkv-demo-observability.template.json --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

#: CloudWatch's dashboard grid: 24 columns; a row unit is drawn at this fraction of a column's width.
GRID_COLUMNS = 24
ROW_ASPECT = 0.55


def dashboard_body(template: dict) -> dict:
    """The (one) ``AWS::CloudWatch::Dashboard``'s body as JSON, its CloudFormation tokens as ``<Ref>`` text."""
    bodies = [r["Properties"]["DashboardBody"] for r in template.get("Resources", {}).values()
              if r.get("Type") == "AWS::CloudWatch::Dashboard"]
    if len(bodies) != 1:
        raise ValueError(f"expected one AWS::CloudWatch::Dashboard in the template, found {len(bodies)}")
    body = bodies[0]
    if isinstance(body, dict) and "Fn::Join" in body:
        separator, parts = body["Fn::Join"]
        body = separator.join(p if isinstance(p, str) else f"<{next(iter(p.values()))}>" for p in parts)
    return json.loads(body)


def metric_labels(properties: dict) -> list[str]:
    """A metric widget's series, as its legend would name them: the label, else the expression or the metric."""
    labels = []
    for entry in properties.get("metrics", []):
        options = entry[-1] if entry and isinstance(entry[-1], dict) else {}
        names = [e for e in entry if isinstance(e, str)]
        per = _search_dimensions(options.get("expression", ""))
        if options.get("label"):
            labels.append(options["label"] + (f" (a line per {per})" if per else ""))
        elif options.get("expression"):
            labels.append(_short(options["expression"]))
        elif len(names) >= 2:
            labels.append(names[1] if names[0] != "." else names[-1])
    for annotation in properties.get("annotations", {}).get("horizontal", []):
        labels.append(f"- - {annotation.get('label', 'threshold')} ({annotation.get('value')})")
    return labels


def _search_dimensions(expression: str) -> str:
    """A SEARCH draws one line per value of its schema's dimensions past the deployment: name them."""
    match = re.search(r"SEARCH\('\{([^}]*)\}", expression)
    if not match:
        return ""
    dims = [d for d in match.group(1).split(",")[1:] if d not in ("Deployment",)]
    return " x ".join(dims)


def _short(expression: str) -> str:
    match = re.search(r'MetricName="([^"]+)"', expression)
    return f"SEARCH {match.group(1)}" if match else expression[:40]


def render(body: dict, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    widgets = body.get("widgets", [])
    rows = max((w["y"] + w["height"] for w in widgets), default=1)
    fig_w = 16.0
    unit = fig_w / GRID_COLUMNS
    fig, ax = plt.subplots(figsize=(fig_w, rows * unit * ROW_ASPECT + 0.6))
    ax.set_xlim(0, GRID_COLUMNS)
    ax.set_ylim(rows, -0.8)
    ax.axis("off")
    ax.text(0, -0.45, title, fontsize=12, weight="bold", va="center")
    for w in widgets:
        x, y, width, height = w["x"], w["y"], w["width"], w["height"]
        props = w.get("properties", {})
        if w["type"] == "text":
            text = props.get("markdown", "").lstrip("#").strip().splitlines()[0]
            ax.text(x + 0.1, y + height / 2, text, fontsize=10.5, weight="bold", va="center", color="#16191f")
            continue
        ax.add_patch(FancyBboxPatch((x + 0.08, y + 0.08), width - 0.16, height - 0.16,
                                    boxstyle="round,pad=0,rounding_size=0.08", facecolor="#fafafa",
                                    edgecolor="#aab7b8", linewidth=0.8))
        kind = "alarm" if w["type"] == "alarm" else props.get("view", "timeSeries")
        ax.text(x + 0.3, y + 0.55, props.get("title", w["type"]), fontsize=8.5, weight="bold", va="center",
                clip_on=True)
        ax.text(x + width - 0.3, y + 0.55, kind, fontsize=6.5, color="#687078", va="center", ha="right")
        labels = metric_labels(props) if w["type"] == "metric" else [
            a.split(":")[-1] for a in props.get("alarms", [])]
        lines = max(1, int((height - 1.2) / 0.5))
        shown = labels[:lines] if len(labels) <= lines else [*labels[:lines - 1], f"+ {len(labels) - lines + 1} more"]
        for i, label in enumerate(shown):
            ax.text(x + 0.45, y + 1.15 + i * 0.5, f"\u25cf {label}", fontsize=7, color=f"C{i % 10}", va="center",
                    clip_on=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("template", type=Path, help="the observability stack's synthesized template (cdk.out)")
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args(argv)
    try:
        template: Any = json.loads(args.template.read_text())
        body = dashboard_body(template)
    except (OSError, ValueError) as exc:
        print(f"dashboard_picture: {args.template}: {exc}; pass the observability stack's template "
              "(node_modules/.bin/cdk synth writes it to cdk.out/)", file=sys.stderr)
        return 2
    name = args.template.name.removesuffix(".template.json")
    widgets = len(body.get("widgets", []))
    render(body, args.out, f"{name}: CloudWatch dashboard layout ({widgets} widgets; labels, no data)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
