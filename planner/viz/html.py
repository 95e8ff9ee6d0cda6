"""The HTML summary of a plan that notebooks show (``Plan._repr_html_``)."""

from __future__ import annotations

import html
import numbers
from dataclasses import dataclass

from planner.simulate import simulate
from planner.units import mib
from planner.viz.style import BASELINE_COLOUR, BUDGET_COLOUR, PLAN_COLOUR, SEGMENT_COLOURS

__all__ = ["plan_html"]


@dataclass(frozen=True)
class _Row:
    segment: int
    start: int
    stop: int
    first: str
    last: str
    boundary_tensors: int
    boundary_bytes: int
    dropped_bytes: int
    recompute_share: float
    kept_nodes: int = 0  # nodes kept inside the segment (selective checkpointing)
    kept_bytes: int = 0
    replayed_nodes: int = 0  # nodes its recompute replays (planner.choice.replayed_nodes)
    nested: int = 0  # checkpointed segments nested inside it (planner.nested)


def _segment_rows(plan) -> list[_Row]:
    """``plan.segment_table()``, the one source of segment rows, for the HTML table."""
    step_seconds = plan.problem.step_seconds or 1.0
    return [
        _Row(
            segment=row["segment"],
            start=row["start"],
            stop=row["stop"],
            first=row["first"],
            last=row["last"],
            boundary_tensors=row["input_tensors"],
            boundary_bytes=row["input_bytes"],
            dropped_bytes=row["dropped_bytes"],
            recompute_share=row["recompute_seconds"] / step_seconds,
            kept_nodes=len(row["kept"]),
            kept_bytes=row["kept_bytes"],
            replayed_nodes=len(row.get("replayed", ())),
            nested=row.get("nested", 0),
        )
        for row in plan.segment_table()
    ]


def _bar(value: float, scale: float, colour: str, label: str) -> str:
    width = 0.0 if scale <= 0 else min(100.0, 100.0 * value / scale)
    return (
        f'<div style="display:flex;align-items:center;gap:6px;margin:1px 0">'
        f'<div style="width:9em;text-align:right;color:#555">{html.escape(label)}</div>'
        f'<div style="flex:1;max-width:22em;background:#f3f3f3;height:0.9em;position:relative">'
        f'<div style="width:{width:.1f}%;background:{colour};height:100%"></div></div>'
        f'<div style="width:7em">{mib(value)}</div></div>'
    )


def _step_rows(plan) -> list[tuple[str, str]]:
    """Rows for the loss and the optimizer step, when the plan was given them."""
    problem, rows = plan.problem, []
    if problem.has_loss:
        rows.append(("Loss", f"{mib(problem.created_bytes[-1])} kept for its backward, which "
                     f"allocates {mib(problem.activation_grad_alloc[-1])}"))  # fmt: skip
    if problem.optimizer_state_bytes or problem.optimizer_step_bytes:
        step = simulate(problem, plan.choice).optimizer_step_bytes
        peak = " (the step's peak)" if step >= plan.predicted_peak_bytes else ""
        rows.append(("Optimizer step", f"holds {mib(step)}{peak}, with "
                     f"{mib(problem.optimizer_step_bytes)} of temporaries"))  # fmt: skip
    return rows


def plan_html(plan, *, max_rows: int = 24) -> str:
    """A compact HTML summary of ``plan`` for notebooks (what ``Plan._repr_html_`` shows).

    Parameters
    ----------
    plan : planner.Plan
    max_rows : int
        Show at most this many segment rows (the first ones and the last few), with a note on
        how many were left out.

    Returns
    -------
    str
        A self-contained ``<div>`` (inline styles only, no scripts).
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 0:
        raise ValueError(f"max_rows must be a non-negative integer, not {max_rows!r}")
    max_rows = int(max_rows)  # numpy's integers too (found by review)
    problem = plan.problem
    e = html.escape
    saved = problem.saved_bytes_per_node()
    rows = _segment_rows(plan)
    dropped = sum(r.dropped_bytes for r in rows)
    boundary = sum(r.boundary_bytes for r in rows)
    covered = sum(stop - start for start, stop in plan.segments)
    fits = plan.predicted_peak_bytes <= plan.budget_bytes
    verdict = (
        '<span style="color:#2e7d32">fits</span>'
        if fits
        else '<span style="color:#c62828">over budget</span>'
    )
    scale = max(plan.budget_bytes, plan.baseline_peak_bytes, plan.predicted_peak_bytes)
    summary = [
        ("Solver", f"{e(str(plan.solver))} &middot; solved in {plan.solve_seconds:.3f} s "
         f"(planning {plan.planning_seconds:.2f} s, captured by {e(str(plan.capture_method))})"),
        ("Graph", f"{problem.size} nodes; {len(plan.segments)} checkpointed segments "
         f"cover {covered} of them"
         + (f", keeping {len(plan.keep)} nodes inside them" if getattr(plan, "keep", ())
            else "")
         + (f", replaying {len(plan.replayed)} in their recomputes"
            if getattr(plan, "replayed", ()) else "")),
        ("Predicted peak", f"<b>{mib(plan.predicted_peak_bytes)}</b> of a "
         f"{mib(plan.budget_bytes)} budget: {verdict} "
         f"(baseline {mib(plan.baseline_peak_bytes)}, "
         f"{plan.predicted_peak_bytes / plan.baseline_peak_bytes - 1:+.0%} vs baseline)"
         if plan.baseline_peak_bytes else f"<b>{mib(plan.predicted_peak_bytes)}</b>"),
        ("Fixed memory", f"{mib(problem.fixed_bytes)} (parameters, buffers, inputs"
         + (f"; optimizer state {mib(problem.optimizer_state_bytes)}"
            if problem.optimizer_state_bytes else "")
         + (f"; autocast cache {mib(problem.autocast_cache_bytes)}"
            if problem.autocast_cache_bytes else "") + f"); gradients "
         f"{mib(problem.gradient_bytes)}"),
        ("Activations", f"{mib(int(saved.sum()))} saved for backward without checkpointing; "
         f"the plan recomputes {mib(dropped)} of them and keeps {mib(boundary)} of segment "
         "inputs"),
        ("Recompute", f"<b>{plan.predicted_overhead:.1%}</b> of a step "
         f"({plan.recompute_flops:.3g} FLOPs)"),
    ] + _step_rows(plan)  # fmt: skip
    out = [
        '<div class="planner-plan" style="font-family:system-ui,sans-serif;font-size:13px;'
        'line-height:1.35">',
        '<div style="font-weight:600;margin-bottom:4px">Checkpointing plan</div>',
        '<table style="border-collapse:collapse;margin-bottom:6px">',
    ]
    for key, value in summary:
        out.append(
            f'<tr><td style="text-align:left;padding:1px 10px 1px 0;color:#555;'
            f'vertical-align:top;white-space:nowrap">{key}</td>'
            f'<td style="text-align:left;padding:1px 0">{value}</td></tr>'
        )
    out.append("</table>")
    out.append(_bar(plan.baseline_peak_bytes, scale, BASELINE_COLOUR, "baseline peak"))
    out.append(_bar(plan.predicted_peak_bytes, scale, PLAN_COLOUR, "planned peak"))
    out.append(_bar(plan.budget_bytes, scale, BUDGET_COLOUR, "budget"))
    if rows:
        shown: list[_Row | None] = list(rows)  # None: the "..." row
        if len(rows) > max_rows:  # the first ones and the last few (none at max_rows=0)
            tail = min(max(3, max_rows // 5), max_rows)
            shown = [*rows[: max_rows - tail], None, *rows[len(rows) - tail :]]
        open_attr = " open" if len(rows) <= 12 else ""
        selective = bool(getattr(plan, "keep", ()))
        replays = bool(getattr(plan, "replayed", ()))
        nested = getattr(plan, "nesting", None) is not None
        titles = [
            ("seg", "right"), ("nodes", "right"), ("from", "left"), ("to", "left"),
            ("boundary tensors", "right"), ("recomputed", "right"), ("recompute cost", "right"),
        ] + ([("kept nodes", "right")] if selective else []) + (
            [("replayed nodes", "right")] if replays else []
        ) + (
            [("nested segments", "right")] if nested else []
        )  # fmt: skip
        head = "".join(
            f'<th style="text-align:{align};padding:2px 8px;border-bottom:1px solid #ccc">'
            f"{title}</th>"
            for title, align in titles
        )
        out.append(
            f'<details{open_attr} style="margin-top:6px"><summary>{len(rows)} checkpointed '
            "segments (boundary tensors are kept; the rest is recomputed in backward"
            + (", but for the kept nodes' outputs" if selective else "")
            + ")</summary>"
            f'<table style="border-collapse:collapse;font-size:12px"><tr>{head}</tr>'
        )
        for r in shown:
            if r is None:
                out.append(
                    f'<tr><td colspan="{len(titles)}" '
                    'style="text-align:center;color:#777">&hellip; '
                    f"{len(rows) - len(shown) + 1} more segments &hellip;</td></tr>"
                )
                continue
            swatch = SEGMENT_COLOURS[r.segment % len(SEGMENT_COLOURS)]
            cells = [
                (f'<span style="display:inline-block;width:0.8em;height:0.8em;'
                 f'background:{swatch};margin-right:4px"></span>{r.segment}', "right"),
                (str(r.stop - r.start), "right"),
                (f"<code>{e(r.first)}</code>", "left"),
                (f"<code>{e(r.last)}</code>", "left"),
                (f"{r.boundary_tensors} &middot; {mib(r.boundary_bytes)}", "right"),
                (mib(r.dropped_bytes), "right"),
                (f"{r.recompute_share:.1%}", "right"),
            ] + ([(f"{r.kept_nodes} &middot; {mib(r.kept_bytes)}", "right")]
                 if selective else []) + ([(str(r.replayed_nodes), "right")]
                 if replays else []) + ([(str(r.nested), "right")]
                 if nested else [])  # fmt: skip
            out.append(
                "<tr>"
                + "".join(
                    f'<td style="text-align:{align};padding:1px 8px">{cell}</td>'
                    for cell, align in cells
                )
                + "</tr>"
            )
        out.append("</table></details>")
    else:
        out.append(
            '<div style="margin-top:6px;color:#555">No segment is checkpointed: the model fits '
            "the budget as it is.</div>"
        )
    out.append("</div>")
    return "\n".join(out)
