"""docs/parameters.md, generated from the tunables catalog (``turnkv.params``), the one source of truth.

``python -m turnkv.params_doc --write`` rewrites the page; tests/unit/test_params_doc.py fails when the page and
the catalog are out of step. Pure apart from ``main``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from turnkv import params

PAGE = Path(__file__).resolve().parents[1] / "docs" / "parameters.md"

_SCOPES = {
    params.Scope.ENGINE: ("Engine tunables", "Read by the vLLM engines through turnkv's connector: `turnkv params "
                          "sync` on each node writes them to `" + params.DEFAULT_TUNABLES_FILE + "` (every minute "
                          "on AWS) and the connector hot-reloads that file; `turnkv local up --set NAME=VALUE` "
                          "passes them at start."),
    params.Scope.ROUTER: ("Router tunables", "Read by `turnkv router serve` (`--set NAME=VALUE`, or `set` in its "
                          "`--config` file); on AWS the router re-reads them from SSM every `params_refresh` "
                          "seconds, without a restart."),
}
_BINARY = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def _number(value: int | float, unit: str) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = f"{value:,}" if isinstance(value, int) else f"{value:g}"
    if unit == "bytes" or unit == "bytes/s":
        for name, size in _BINARY:
            if value >= size and value % size == 0:
                return f"{text} ({value // size:,} {name}{'/s' if unit == 'bytes/s' else ''})"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    lines = [
        "# Parameters (tunables)",
        "",
        "<!-- Generated from turnkv/params.py by `python -m turnkv.params_doc --write`; do not edit by hand "
        "(tests/unit/test_params_doc.py checks it). -->",
        "",
        "Every knob turnkv reads at run time, with its default, the range the catalog accepts and what it does. "
        "On AWS each lives in SSM Parameter Store at `" + params.SSM_PREFIX + "/<deployment>/<scope>/<name>`:",
        "",
        "```",
        "turnkv params catalog                                   # offline: this page's table",
        "turnkv params set decoder_kv_blocks_ttl=180 --dry-run   # offline: ranges and rules over the defaults",
        "turnkv params list --deployment prod --region us-east-2",
        "turnkv params get decoder_kv_blocks_ttl --deployment prod --region us-east-2",
        "turnkv params set decoder_kv_blocks_ttl=180 --deployment prod --region us-east-2",
        "turnkv params history decoder_kv_blocks_ttl --deployment prod --region us-east-2",
        "```",
        "",
        "A value outside its range, or a set of values that breaks a rule below, is refused (exit 2) with the "
        "reason. `turnkv plan` recommends `decoder_kv_blocks_ttl`, `conversation_ttl` and "
        "`kv_recompute_threshold` for a workload ([planning.md](planning.md)). A deploy config's `tunables:` "
        "section (NAME: VALUE) sets a deployment's initial values, checked against the same catalog and rules by "
        "`turnkv config validate` and the synth.",
        "",
        "## Rules across tunables",
        "",
    ]
    needed = params.eviction_grace_needed(params.defaults())
    for rule in params.CROSS_CHECKS:
        lines.append(f"- {rule}")
    lines += [f"  With the defaults the eviction grace must be at least {needed:g} s (it is "
              f"{params.get('retention_eviction_grace').default:g} s).", ""]
    for scope, (title, intro) in _SCOPES.items():
        tunables = [t for t in params.CATALOG if t.scope is scope]
        lines += [f"## {title} ({len(tunables)})", "", intro, "",
                  "| name | default | allowed | unit | what it does |", "|---|---:|---|---|---|"]
        for t in tunables:
            allowed = f"{_number(t.minimum, t.unit)} .. {_number(t.maximum, t.unit)}"
            kind = "" if t.kind is int else " (decimal)"
            lines.append(f"| `{t.name}` | {_number(t.default, t.unit)} | {allowed}{kind} | {t.unit} | "
                         f"{_cell(t.help)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--write" in argv:
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    elif "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of step with turnkv/params.py: run python -m turnkv.params_doc --write",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
