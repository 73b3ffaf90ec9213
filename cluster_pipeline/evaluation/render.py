"""The report's Markdown: the numbers of :mod:`cluster_pipeline.evaluation.report` turned into
text and tables (every table through :func:`~cluster_pipeline.storage.tables.markdown_table`).
No statistics here; rendering only."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from cluster_pipeline.evaluation.statistics import p_text
from cluster_pipeline.storage.tables import markdown_table

if TYPE_CHECKING:
    from cluster_pipeline.evaluation.plots import DecisionPoint
    from cluster_pipeline.evaluation.results import ModelResult, ReportNumbers
    from cluster_pipeline.evaluation.statistics import Comparison

# The Dagster UI (1.13) renders a Markdown metadata value inline below this many characters
# and behind a "[Show Markdown]" link from there on.
INLINE_MARKDOWN_LIMIT = 1000


def fmt(value: float | None, std: float, n: int, digits: int = 4) -> str:
    """``mean ± std`` where several runs were averaged, the value alone for one, ``-`` for
    none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f} ± {std:.{digits}f}" if n > 1 else f"{value:.{digits}f}"


def signed(v: float, digits: int = 4) -> str:
    """A difference with its sign (``+0.0123``)."""
    return f"{v:+.{digits}f}"


def _name(row: dict) -> str:
    return f"**{row['group']}**" if row["current"] else row["group"]


def summary_table(rows: list[dict], metric_names: list[str]) -> str:
    """The side-by-side table: one line per group, ``mean ± std`` where several seeds ran."""
    return markdown_table(
        ["model", "runs", "data fraction", "train s", *metric_names],
        (
            [
                _name(r),
                str(r["n"]),
                fmt(r["data_fraction"], r["data_fraction_std"], r["n"], 3),
                fmt(r["train_seconds"], r["train_seconds_std"], r["n"], 1),
                *(fmt(r[m], r[f"{m}_std"], r["n"]) for m in metric_names),
            ]
            for r in rows
        ),
    )


def cost_table(rows: list[dict], full_seconds: float | None) -> str:
    """Per group: selection and training seconds, the net time saved against full-data
    training (selection counted), the share of training compute spent on real tokens, beside it
    the model FLOPs utilisation where a run measured one (CUDA runs on a GPU of known peak; the
    column is left out when none did), and the mechanism: gradient diversity of the subset and
    the mean inter-rank gradient cosine during training."""
    shown = [r for r in rows if r["group"] != "base"]
    with_mfu = any(math.isfinite(r.get("mfu", math.nan)) for r in shown)

    def cells(r: dict) -> list[str]:
        n = r["n"]
        total = r["selection_seconds"] + r["train_seconds"]
        saved = full_seconds - total if full_seconds is not None else math.nan
        mfu = [fmt(r.get("mfu", math.nan), r.get("mfu_std", 0.0), n, 3)] if with_mfu else []
        return [
            _name(r),
            fmt(r["selection_seconds"], r["selection_seconds_std"], n, 1),
            fmt(r["train_seconds"], r["train_seconds_std"], n, 1),
            fmt(total, 0.0, 1, 1),
            fmt(saved, 0.0, 1, 1),
            fmt(r["useful_compute_fraction"], r["useful_compute_fraction_std"], n, 3),
            *mfu,
            fmt(r["gradient_diversity"], r["gradient_diversity_std"], n, 4),
            fmt(r["grad_cosine"], r["grad_cosine_std"], n, 4),
        ]

    head = [
        "model",
        "selection s",
        "train s",
        "selection + train s",
        "net saved s",
        "useful compute",
        *(["MFU"] if with_mfu else []),
        "gradient diversity",
        "inter-rank grad cosine",
    ]
    return markdown_table(head, (cells(r) for r in shown))


def comparison_table(comparisons: list[Comparison]) -> str:
    """One line per comparison: difference with its 95 % interval, relative difference, the
    sign-flip test's p, minimum detectable difference and the verdict."""
    head = ["model", "vs", "metric", "difference [95 % CI]", "relative", "p", "detectable", "runs"]
    return markdown_table(
        [*head, "verdict"],
        (
            [
                c.candidate,
                c.reference,
                c.metric,
                f"{signed(c.difference)} [{signed(c.low)}, {signed(c.high)}]",
                f"{100 * c.relative:+.2f} %" if math.isfinite(c.relative) else "-",
                p_text(c.p_value),
                f"{c.min_detectable:.4f}",
                f"{c.candidate_seeds} vs {c.reference_seeds}",
                f"**{c.verdict}**",
            ]
            for c in comparisons
        ),
    )


def verdict_sentences(comparisons: list[Comparison], group: str) -> list[str]:
    """Plain-words verdicts of one group against its references."""
    out = []
    for c in comparisons:
        if c.candidate != group:
            continue
        direction = "lower is better" if c.lower_is_better else "higher is better"
        out.append(
            f"- against **{c.reference}** on {c.metric} ({direction}): **{c.verdict}** "
            f"({signed(c.difference)}, 95 % CI [{signed(c.low)}, {signed(c.high)}], "
            f"p {p_text(c.p_value, equals=True)}, {c.items} items; "
            f"differences under {c.min_detectable:.4f} are not reliably detected here)"
        )
    return out


def plain_text(markdown: str) -> str:
    """One line of the report's Markdown as a log line reads it: the bold and code marks
    (``**``, ``__``, backticks) taken out, the words kept."""
    return re.sub(r"\*\*|__|`", "", markdown)


def net_saving_line(selection_s: float, train_s: float, full_s: float, measured: bool) -> str:
    """The report's first line: what this run cost against full-data training."""
    saved = full_s - selection_s - train_s
    pct = f" ({100 * saved / full_s:+.0f} % of full-data training)" if full_s > 0 else ""
    how = "measured" if measured else "estimated as training / data fraction"
    return (
        f"**Net time saved: {saved:.1f} s**{pct}: selection {selection_s:.1f} s + training "
        f"{train_s:.1f} s against full-data training {full_s:.1f} s ({how}).\n\n"
    )


def full_seconds_note(numbers: ReportNumbers) -> str:
    """How long full-data training took and how that was obtained (measured or estimated)."""
    how = "measured" if numbers.full_measured else "estimated as training / data fraction"
    return f"full-data training: {numbers.full_seconds:.1f} s, {how}"


def _interval(c: Comparison) -> str:
    return f"{signed(c.difference)} [{signed(c.low)}, {signed(c.high)}]"


def decision_answer(points: list[DecisionPoint]) -> str:
    """The decision figure's answer for this run's group, one sentence: its net time saved and
    its verdict against each reference drawn (empty when the group is not drawn)."""
    mine = [p for p in points if p.current]
    if not mine:
        return ""
    first = mine[0]
    verdicts = "; against ".join(
        f"{p.reference}: {p.comparison.verdict} ({_interval(p.comparison)})" for p in mine
    )
    runs = f", mean of its {first.runs} runs" if first.runs > 1 else ""
    alone = (
        " (no random_global or full-data run to compare with: make compare trains them)"
        if all(p.kind == "base" for p in points)
        else ""
    )
    return (
        f"{first.group} (this run's group): net time saved {first.saved_seconds:.1f} s{runs}; "
        f"{first.comparison.metric} against {verdicts}{alone}"
    )


def worth_it_markdown(
    numbers: ReportNumbers, selection_seconds: float, metric: str = "heldout_loss"
) -> str:
    """The report's answer, short enough for the Dagster UI to show inline (under
    :data:`INLINE_MARKDOWN_LIMIT` characters): the net time saved, then this run's verdicts on
    ``metric`` against each of its references (the last ones left out, and said so, where they
    would not fit), and where the figure and the full report are."""
    saving = net_saving_line(
        selection_seconds, numbers.train_seconds, numbers.full_seconds, numbers.full_measured
    ).strip()
    group = numbers.current_row["group"]
    mine = [c for c in numbers.comparisons if c.candidate == group and c.metric == metric]
    tail = "Figure: `decision_plot`; every metric and comparison: `report`."
    clauses = [f"{c.reference}: **{c.verdict}** ({_interval(c)})" for c in mine]
    for kept in range(len(clauses), -1, -1):
        if kept:
            more = "" if kept == len(clauses) else f"; {len(clauses) - kept} more in `report`"
            verdicts = (
                f"{metric} of **{group}** against " + "; against ".join(clauses[:kept]) + more + "."
            )
        else:
            verdicts = f"{metric} of **{group}**: no comparison." if not clauses else ""
        text = "\n\n".join(part for part in (saving, verdicts, tail) if part)
        if len(text) < INLINE_MARKDOWN_LIMIT:
            return text
    return saving[: INLINE_MARKDOWN_LIMIT - 1]


def sequence_note(sequences: dict[str, dict[str, int]]) -> str:
    """What the held-out split lost to skipping and truncation, in parentheses (or nothing)."""
    parts = [f"{n} skipped ({k})" for k, n in sequences.get("skipped", {}).items()]
    parts += [f"{n} truncated at {k}" for k, n in sequences.get("truncated", {}).items()]
    return f" ({', '.join(parts)})" if parts else ""


def selection_pass_rows(result: ModelResult) -> list[list[str]]:
    """The selection's model passes as cost-table rows: each pass's seconds and samples, the
    forward/backward passes and the largest rank's peak memory (none for a checkpoint trained
    before they were recorded)."""
    rows = [
        [
            f"  pass `{p['name']}` ({'cached, ' if not p.get('run_now') else ''}at its measured "
            "rate)",
            f"{p['seconds']:.1f} s, {p['samples']} samples"
            + (f", {p['backward']} backward" if p.get("backward") else ""),
        ]
        for p in result.selection_passes
    ]
    if result.selection_forward_passes is not None:
        rows.append(
            [
                "  per-sample forward / backward passes of the selection",
                f"{result.selection_forward_passes} / {result.selection_backward_passes}",
            ]
        )
    if result.selection_peak_rss_mib is not None:
        rows.append(
            [
                "  peak resident memory of the selection's largest rank",
                f"{result.selection_peak_rss_mib:.0f} MiB",
            ]
        )
    return rows


def run_cost_table(numbers: ReportNumbers, selection_seconds: float) -> str:
    """The bold run's own costs: selection, training, useful compute, weights, full-data time
    and the net saving."""
    current = numbers.current_result
    full_label = (
        "full-data training (measured, mean over its runs)"
        if numbers.full_measured
        else "full-data training (estimate: measured / fraction; no full-data run)"
    )
    rows = [
        [
            "selection: its model passes + clustering + subsets + shards (model load excluded)",
            f"{selection_seconds:.1f} s",
        ],
        *selection_pass_rows(current),
        [
            "training (measured)",
            f"{numbers.train_seconds:.1f} s at data fraction {numbers.data_fraction:.3f}",
        ],
    ]
    if current.useful_compute_fraction is not None:
        rows.append(
            [
                "useful compute (real tokens / ranks x busiest rank's tensor tokens, per step)",
                f"{current.useful_compute_fraction:.3f}",
            ]
        )
    if current.mfu is not None and current.mfu_record:
        m = current.mfu_record
        rows.append(
            [
                f"model FLOPs utilisation ({m['flops_per_token_per_parameter']} x parameters x "
                "real tokens / (seconds x ranks x peak), training/mfu.py)",
                f"{current.mfu:.3f} ({m['parameters'] / 1e9:.2f}B parameters, "
                f"{m['real_tokens']} real tokens, {m['seconds']:.1f} s, {m['ranks']} x "
                f"{m['device']} at {m['peak_flops_per_rank'] / 1e12:.0f} TFLOP/s)",
            ]
        )
    if current.rank_weights:
        rows.append(
            [
                "rank weights (loss multipliers w_c, rank order)",
                ", ".join(f"{w:.4f}" for w in current.rank_weights),
            ]
        )
    rows += [
        [full_label, f"{numbers.full_seconds:.1f} s"],
        [
            "net time saved (full - selection - training)",
            f"{numbers.full_seconds - selection_seconds - numbers.train_seconds:.1f} s",
        ],
    ]
    return markdown_table(["cost of the bold run", "value"], rows)


def summary_markdown(
    dataset: str,
    numbers: ReportNumbers,
    heldout_samples: int,
    heldout_tokens: int,
    suite_sizes: dict[str, int],
    skipped: dict[str, str],
    selection_seconds: float,
    heldout_sequences: dict[str, dict[str, int]] | None = None,
    unsafe_sandbox: str | None = None,
) -> str:
    """The report's text: the unsafe-sandbox warning, the net saving, what was measured, the
    verdicts of the current run, the side-by-side table, the comparisons, and cost and
    mechanism."""
    heldout = [c for c in numbers.comparisons if c.metric == "heldout_loss"]
    mdd = ""
    if heldout:
        low, high = (f"{f(c.min_detectable for c in heldout):.4f}" for f in (min, max))
        mdd = (
            " The smallest held-out loss difference "
            + ("this comparison detects" if len(heldout) == 1 else "these comparisons detect")
            + f" reliably (80 % power, 5 % level) is {low if low == high else f'{low}-{high}'}"
            " nats/token."
        )
    group = numbers.current_row["group"]
    sentences = verdict_sentences(numbers.comparisons, group)
    benchmarks = ", ".join(f"{k} ({v})" for k, v in suite_sizes.items()) or "none"
    parts = [
        f"## eval_report: `{dataset}`\n\n",
        (
            f"**Generated code ran without isolation** (`unsafe_sandbox: true`; {unsafe_sandbox}"
            ") so pass@1 programs could read and write what the evaluator can.\n\n"
            if unsafe_sandbox
            else ""
        ),
        net_saving_line(
            selection_seconds, numbers.train_seconds, numbers.full_seconds, numbers.full_measured
        ),
        f"Held-out split: {heldout_samples} samples, {heldout_tokens} response tokens"
        + sequence_note(heldout_sequences or {})
        + f". Benchmarks: {benchmarks}"
        + (f"; skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}" if skipped else "")
        + ". Greedy decoding; bold = the checkpoint of this run; ± = std over seeds.\n\n",
        f"### Was the subset worth it? `{group}`\n\n",
        "\n".join(sentences) if sentences else "- no reference to compare with",
        "\n\nPaired 95 % bootstrap intervals over the same held-out samples / problems "
        "(seeds resampled too where several ran); a verdict of better or worse also needs the "
        "paired sign-flip test's p < 0.05 (exact up to 13 items), since a bootstrap over a few "
        "items claims too much. Held-out loss is measured on a random split of "
        "the same pool, which favours a random subset by construction; judge the benchmark rows "
        "(solution NLL, pass@1, accuracy) as well." + mdd + "\n\n",
        summary_table(numbers.rows, numbers.metric_names),
        (
            "\n\n"
            + "; ".join(f"every model scores 0 on {m}" for m in numbers.zero_metrics)
            + " (not plotted: the benchmark is too hard for these models)."
            if numbers.zero_metrics
            else ""
        ),
        "\n\n### Comparisons\n\n",
        comparison_table(numbers.comparisons) if numbers.comparisons else "no pairs to compare",
        "\n\n### Cost and mechanism\n\n",
        cost_table(numbers.rows, numbers.full_seconds),
        "\n\n",
        run_cost_table(numbers, selection_seconds),
        "\n",
    ]
    return "".join(parts)
