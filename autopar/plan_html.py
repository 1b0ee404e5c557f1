"""A plan as one self-contained HTML page (`Plan.to_html`): the mesh, each layer's specs, the
collectives by layer, kind and mesh axes, the memory over the step with its peak, and the
predicted figures beside the compiled ones where the step was compiled. Inline CSS and SVG,
no script and nothing fetched: the page opens offline and attached to a bug report."""
from __future__ import annotations

import html
import math
import re
from collections import defaultdict
from typing import Any

from autopar.cost.estimate import mib
from autopar.cost.resharding import reshard_sequence
from autopar.explain import partial_sums
from autopar.mesh import mesh_shape
from autopar.plan_record import PlanRecord
from autopar.plan_text import bound_line
from autopar.rules.factors import to_partition_spec

STYLE = """body{font:14px system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:2px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}td.n{text-align:right}
code{font-size:13px}.peak{fill:#c0392b}.note{color:#666}"""
LAYER = re.compile(r"(?:^|/)([A-Za-z][A-Za-z0-9]*_\d+)(?:/|$)")  # block_3, layers_0, Dense_1


def plan_page(plan: PlanRecord, title: str = "autopar plan") -> str:
    """The page's HTML."""
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
             f"<h1>{_e(title)}</h1>", _overview(plan), "<h2>Mesh</h2>", _mesh(plan),
             "<h2>Layers</h2>", _layers(plan), "<h2>Collectives</h2>", _collectives(plan),
             "<h2>Memory over the step</h2>", _memory(plan), "</body></html>"]
    return "\n".join(parts)


def _overview(plan: PlanRecord) -> str:
    c, m = plan.cost, plan.memory
    rows = [("mesh", ", ".join(f"{n}={s}" for n, s in plan.mesh)), ("search", plan.search),
            ("hardware profile", plan.hardware)]
    for seconds, what in ((c.compute_s, "compute"), (c.communication_s, "communication"),
                          (c.total_s, "step")):
        if seconds is not None:
            rows.append((f"predicted {what}", f"{seconds * 1e3:.3f} ms"))
    if c.peak_memory_bytes is not None:
        rows.append(("predicted peak memory", mib(c.peak_memory_bytes)))
    if m.get("compiled_bytes"):
        rows.append(("compiled peak memory (XLA)", mib(m["compiled_bytes"])))
    if m.get("limit_bytes"):
        rows.append(("memory limit", mib(m["limit_bytes"])))
    if plan.search_stats.bounded:
        rows.append(("bound", bound_line(plan.search, plan.search_stats).split(", ", 1)[1]))
    if plan.recompute:
        rows.append(("recomputed layers", ", ".join(plan.recompute)))
    return _table(None, rows)


def _mesh(plan: PlanRecord) -> str:
    """The devices as a grid: the first axis down, the others across (row-major)."""
    names, sizes = [n for n, _ in plan.mesh], [s for _, s in plan.mesh]
    down = sizes[0] if len(sizes) > 1 else 1
    across = max(1, (sizes[0] if len(sizes) == 1 else 1) * math.prod(sizes[1:]))
    cell = max(6, min(28, 560 // max(across, 1)))
    if down * across > 4096:
        return (f"<p>{' x '.join(map(str, sizes))} devices ({_e(', '.join(names))}): too "
                "many to draw.</p>")
    rects = [f"<rect x='{x * cell}' y='{y * cell}' width='{cell - 1}' height='{cell - 1}' "
             f"fill='#{_shade(x, y)}'><title>device {y * across + x}</title></rect>"
             for y in range(down) for x in range(across)]
    label = (f"{names[0]} ({sizes[0]}) down; {' x '.join(f'{n} ({s})' for n, s in plan.mesh[1:])}"
             " across" if len(names) > 1 else f"{names[0]} ({sizes[0]}) across")
    return (f"<svg width='{across * cell}' height='{down * cell}' role='img' "
            f"aria-label='mesh'>{''.join(rects)}</svg><p class='note'>{_e(label)}, row-major"
            "</p>")


def _layers(plan: PlanRecord) -> str:
    """Per layer: its parameters' specs, and with a detailed plan its products' results."""
    params: dict[str, list] = defaultdict(list)
    for t in plan.inputs:
        params[_layer(t.path)].append(t)
    acts: dict[str, list] = defaultdict(list)
    for o in plan.ops:
        if o.primitive == "dot_general" and not o.backward:
            acts[_layer(o.scope)].append(o)
    out = []
    for layer in sorted(set(params) | set(acts), key=_natural):
        rows = [(t.path, str(t.shape), str(t.partition_spec), f"{t.bytes_per_device:,}")
                for t in params.get(layer, [])]
        rows += [(f"{o.scope} (product result)", str(o.out_shapes[0]),
                  str(to_partition_spec(o.out_specs[0])), "") for o in acts.get(layer, [])]
        out.append(f"<h3>{_e(layer)}</h3>" + _table(("value", "shape", "spec", "bytes/device"),
                                                     rows))
    if not plan.ops:
        out.append("<p class='note'>A plan read from compact JSON holds no operators: the "
                   "products' results show for a plan made in this process.</p>")
    return "\n".join(out)


def _collectives(plan: PlanRecord) -> str:
    """Seconds per step by layer, collective kind and mesh axes: operators' partial sums and
    the plan's reshardings."""
    mesh = mesh_shape(dict(plan.mesh))
    seconds: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for o in plan.ops:
        sums = partial_sums(o) if o.communication_s > 0 else []
        for kind, axes in sums:  # the op's seconds shared by its collectives
            key = (_layer(o.scope), kind, ",".join(axes))
            seconds[key][0] += 1
            seconds[key][1] += o.communication_s / len(sums)
    scopes = {o.index: o.scope for o in plan.ops}
    for r in plan.redistributions:
        steps = reshard_sequence(r.from_spec, r.to_spec, mesh)
        op = re.search(r"#(\d+)", r.where)  # "operand 1 of dot_general #96 (source)"
        scope = scopes.get(int(op.group(1)), r.where) if op else r.where
        for kind, _, _, _, axes in steps:
            key = (_layer(scope), kind, ",".join(axes))
            seconds[key][0] += 1
            seconds[key][1] += r.cost_s / max(len(steps), 1)
    rows = [(layer, kind, axes, str(n), f"{s * 1e3:.4f}")
            for (layer, kind, axes), (n, s) in sorted(seconds.items(),
                                                      key=lambda kv: (_natural(kv[0][0]),
                                                                      kv[0][1:]))]
    if not rows:
        return "<p>No collectives.</p>"
    return _table(("layer", "kind", "mesh axes", "count", "ms per step"), rows)


def _memory(plan: PlanRecord) -> str:
    m = plan.memory
    out = []
    points = m.get("timeline") or []
    if points:
        out.append(_curve(points, int(m.get("peak_bytes", 0)), m.get("limit_bytes")))
    if "at_peak" in m:
        out.append(f"<p>Peak {mib(m.get('peak_bytes', 0))} at <code>{_e(m.get('where', ''))}"
                   "</code>: live then, by kind:</p>")
        out.append(_table(("kind", "MiB"), [(k.replace("_", " "), f"{v / 2**20:.2f}")
                                             for k, v in m["at_peak"].items() if v]))
    if m.get("largest"):
        out.append("<p>The largest buffers then:</p>" +
                   _table(("buffer", "MiB"), [(w, f"{b / 2**20:.2f}") for w, b in m["largest"]]))
    if m.get("compiled_bytes"):
        out.append(f"<p>Predicted {mib(m.get('peak_bytes', 0))} beside XLA's compiled "
                   f"{mib(m['compiled_bytes'])}.</p>")
    return "\n".join(out) or "<p>No memory estimate in this plan.</p>"


def _curve(points: list, peak: int, limit: Any) -> str:
    """An SVG line of live bytes over the step's times, the peak marked."""
    width, height = 800, 220
    last = max(t for t, _ in points) or 1
    top = max([b for _, b in points] + [peak, limit or 0]) or 1
    xy = [(20 + (width - 40) * t / last, height - 20 - (height - 40) * b / top)
          for t, b in points]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    at = max(range(len(points)), key=lambda i: points[i][1])
    b_peak = points[at][1]
    px, py = xy[at]
    limit_line = ""
    if limit and limit <= top:
        ly = height - 20 - (height - 40) * limit / top
        limit_line = (f"<line x1='20' x2='{width - 20}' y1='{ly:.1f}' y2='{ly:.1f}' "
                      f"stroke='#999' stroke-dasharray='4'/><text x='{width - 20}' "
                      f"y='{ly - 4:.1f}' text-anchor='end' font-size='11'>limit "
                      f"{mib(limit)}</text>")
    return (f"<svg width='{width}' height='{height}' role='img' aria-label='memory over the "
            f"step'><polyline points='{line}' fill='none' stroke='#2c7fb8' stroke-width='2'/>"
            f"{limit_line}<circle class='peak' cx='{px:.1f}' cy='{py:.1f}' r='5'><title>peak "
            f"{mib(b_peak)}</title></circle><text x='{px + 8:.1f}' y='{max(py, 14):.1f}' "
            f"font-size='12'>peak {mib(b_peak)}</text></svg><p class='note'>Bytes live per "
            "device over the step's program order (forward, backward, update), the most in "
            "each of up to 100 spans.</p>")


def _layer(text: str) -> str:
    found = LAYER.search(text or "")
    return found.group(1) if found else "outside the layers"


def _natural(text: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _table(columns: tuple[str, ...] | None, rows: list[tuple]) -> str:
    """A table of `rows`, headed by `columns` (None: no heading)."""
    head = ("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in columns) + "</tr>"
            if columns else "")
    body = "".join("<tr>" + "".join(f"<td>{_e(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table>{head}{body}</table>"


def _shade(x: int, y: int) -> str:
    return "9ecae1" if (x + y) % 2 else "c6dbef"


def _e(text: str) -> str:
    return html.escape(str(text), quote=True)
