"""Every figure stands alone: a title, labelled axes with units, a legend outside the data;
the smoothing, the PCA's explained variance and the decision figure's numbers by hand."""

import math

import numpy as np
import pytest
from matplotlib.figure import Figure

from cluster_pipeline.evaluation import plots
from cluster_pipeline.evaluation.render import INLINE_MARKDOWN_LIMIT, worth_it_markdown
from cluster_pipeline.evaluation.report import (
    decision_points,
    render_report,
    report_numbers,
)
from cluster_pipeline.evaluation.statistics import Comparison
from cluster_pipeline_tests.helpers import evaluation_results

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _comparison(candidate, reference, difference, low, high, metric="heldout_loss"):
    return Comparison(
        metric=metric,
        candidate=candidate,
        reference=reference,
        difference=difference,
        low=low,
        high=high,
        standard_error=0.01,
        min_detectable=0.028,
        relative=difference / 1.5,
        lower_is_better=not metric.endswith("_pass@1"),
        items=50,
        candidate_seeds=2,
        reference_seeds=1,
        p_value=0.5 if low <= 0 <= high else 0.001,
    )


def _decision_points():
    return [
        plots.DecisionPoint(
            "peripheral r=0.5",
            "random_global r=0.5",
            "random_global",
            30.0,
            4.0,
            _comparison("peripheral r=0.5", "random_global r=0.5", 0.01, -0.02, 0.04),
            True,
            2,
        ),
        plots.DecisionPoint(
            "peripheral r=0.5",
            "full r=1.0",
            "full",
            30.0,
            4.0,
            _comparison("peripheral r=0.5", "full r=1.0", 0.05, 0.03, 0.07),
            True,
            2,
        ),
        plots.DecisionPoint(
            "random_global r=0.5",
            "full r=1.0",
            "full",
            45.0,
            0.0,
            _comparison("random_global r=0.5", "full r=1.0", 0.04, 0.01, 0.07),
            False,
        ),
    ]


def _figures() -> dict[str, Figure]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8))
    labels = np.arange(60) % 3
    steps = list(range(1, 20))
    vs_base = [
        _comparison("peripheral r=0.5", "base", -0.14, -0.19, -0.08),
        _comparison("random_global r=0.5", "base", -0.15, -0.20, -0.11),
        _comparison("peripheral r=0.5", "base", 0.125, 0.0, 0.25, "humaneval_pass@1"),
    ]
    return {
        "cluster sizes": plots.cluster_sizes_figure([27, 40, 14], [27, 36, 18], 36),
        "PCA map": plots.pca_map_figure(x, labels),
        "PCA map, selected": plots.pca_map_figure(x, labels, np.arange(60) % 2 == 0),
        "loss per rank": plots.loss_curves_figure(
            steps, [[2.0 - 0.01 * s + 0.1 * (s % 3), 2.1 - 0.02 * s] for s in steps]
        ),
        "useful compute": plots.useful_compute_figure([1, 2, 3], [0.89, 0.93, 0.93]),
        "loss per run": plots.run_loss_curves_figure(
            {
                "peripheral r=0.5, training seed 0, selection seed 0": [(1, 2.0), (2, 1.9)],
                "peripheral r=0.5, training seed 1, selection seed 1": [(1, 2.1), (2, 1.8)],
                "full r=1.0, training seed 0, selection seed 0": [(s, 2 - s / 50) for s in steps],
            },
            {
                "peripheral r=0.5, training seed 0, selection seed 0": "peripheral r=0.5",
                "peripheral r=0.5, training seed 1, selection seed 1": "peripheral r=0.5",
                "full r=1.0, training seed 0, selection seed 0": "full r=1.0",
            },
        ),
        "time vs fraction": plots.time_vs_fraction_figure(
            [(0.43, 20.0, "peripheral r=0.5"), (1.0, 47.0, "full r=1.0")], (0.43, 20.0)
        ),
        "metrics vs base": plots.metric_differences_figure(
            vs_base,
            {"heldout_loss": 5.99, "humaneval_pass@1": 0.125},
            {"heldout_loss": "nats/token", "humaneval_pass@1": "fraction of problems solved"},
        ),
        "decision": plots.decision_figure(_decision_points(), "nats/token", "the answer"),
    }


FIGURES = list(_figures())


@pytest.mark.parametrize("name", FIGURES)
def test_every_figure_has_a_title_labelled_axes_and_a_legend_outside_its_data(name):
    fig = _figures()[name]
    fig.draw_without_rendering()
    axes = fig.get_axes()
    assert axes
    titles = [ax.get_title() for ax in axes] + [fig.get_suptitle()]
    assert any(t.strip() for t in titles), name
    assert axes[0].get_ylabel().strip(), name  # panels right of it may share its y axis
    for ax in axes:
        assert ax.get_xlabel().strip(), name
        assert ax.get_legend() is None  # no legend inside the axes, over the data
    if name not in ("metrics vs base",):  # its groups are the y axis' labels
        (legend,) = fig.legends
        box = legend.get_window_extent()
        for ax in axes:
            assert not box.overlaps(ax.get_window_extent()), name
    data = plots.png(fig)
    assert data.startswith(PNG_SIGNATURE) and len(data) > 5000


def test_axis_labels_carry_units():
    figs = _figures()
    assert figs["loss per rank"].axes[0].get_ylabel() == "loss (nats/token)"
    assert figs["time vs fraction"].axes[0].get_ylabel() == "training time (s)"
    loss, solved = figs["metrics vs base"].axes
    assert "(nats/token); lower is better" in loss.get_xlabel()
    assert "(fraction of problems solved); higher is better" in solved.get_xlabel()
    assert "base model: 5.99" in loss.get_title()
    assert figs["decision"].axes[0].get_xlabel().startswith("net time saved (s)")
    assert "(nats/token)" in figs["decision"].axes[0].get_ylabel()


def test_smoothing_is_a_centred_mean_that_shrinks_at_the_ends():
    assert plots.smooth([1, 2, 3, 4, 5], 3).tolist() == [1.5, 2.0, 3.0, 4.0, 4.5]
    assert plots.smooth([1, 2, 3, 4, 9], 5).tolist() == [2.0, 2.5, 3.8, 4.5, 16 / 3]
    assert plots.smooth([1.0, math.nan, 3.0], 3).tolist() == [1.0, 2.0, 3.0]
    assert plots.smooth([4.0, 1.0], 1).tolist() == [4.0, 1.0]
    with pytest.raises(ValueError, match="odd"):
        plots.smooth([1.0], 2)
    assert [plots.smoothing_window(n) for n in (1, 5, 6, 19, 100)] == [1, 1, 3, 5, 25]


def test_the_loss_curve_draws_each_step_faint_and_its_smoothed_line_bold():
    steps = list(range(1, 20))
    values = [2.0 + 0.3 * (-1) ** s for s in steps]  # a zig-zag around 2
    ax = plots.loss_curves_figure(steps, [[v] for v in values]).axes[0]
    faint, bold = ax.get_lines()
    assert faint.get_alpha() == 0.3 and np.asarray(faint.get_ydata()).tolist() == values
    assert bold.get_linewidth() == 2.0
    assert np.allclose(bold.get_ydata(), plots.smooth(values, 5))
    assert "mean over 5 steps" in ax.get_title()


def test_the_pca_axes_say_the_share_of_variance_they_explain():
    # Variance 2 x 1^2 along x, 2 x 0.5^2 along y: 80 % and 20 %.
    x = np.array([[1.0, 0, 0], [-1.0, 0, 0], [0, 0.5, 0], [0, -0.5, 0]])
    xy, share = plots.explained_variance(x)
    assert share == pytest.approx([0.8, 0.2])
    assert np.abs(xy[:, 0]).tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0])
    ax = plots.pca_map_figure(x, np.array([0, 0, 1, 1])).axes[0]
    assert ax.get_xlabel() == "PC 1 (80.0 % of the variance)"
    assert ax.get_ylabel() == "PC 2 (20.0 % of the variance)"
    assert "PC 1 + PC 2 explain 100.0 % of the variance" in ax.get_title()
    _, flat = plots.explained_variance(np.ones((3, 2)))
    assert np.isnan(flat).all()


def test_the_cluster_size_bars_are_labelled_and_the_axis_clears_the_cap():
    ax = plots.cluster_sizes_figure([27, 40], [31, 36], 36).axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["27", "40", "31", "36"]
    assert ax.get_ylim()[1] == pytest.approx(40 * 1.15)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]


def test_the_decision_figure_shades_the_quadrants_and_draws_each_group_once_in_the_legend():
    fig = plots.decision_figure(_decision_points(), "nats/token", "the answer")
    rg, full = fig.axes
    assert "random_global at the same ratio" in rg.get_title()
    assert "full-data training" in full.get_title()
    # Both axes show 0: the quadrants' corners.
    for ax in (rg, full):
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert x0 < 0 < x1 and y0 < 0 < y1
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == [
        "peripheral r=0.5 (this run)",
        "random_global r=0.5",
        "saves time and better: worth it",
        "costs time and worse",
    ]
    assert fig.get_suptitle() == "Was the subset worth it?\nthe answer"


def _runs():
    return evaluation_results()


def test_decision_points_are_net_time_saved_against_the_random_global_and_full_comparisons():
    numbers = report_numbers(_runs(), n_resamples=100)
    assert numbers.full_measured and numbers.full_seconds == 100.0
    points = decision_points(_runs(), numbers)
    by = {(p.group, p.reference): p for p in points}
    assert list(by) == [
        ("peripheral r=0.5", "random_global r=0.5"),
        ("peripheral r=0.5", "full r=1.0"),
        ("random_global r=0.5", "full r=1.0"),
    ]
    p = by[("peripheral r=0.5", "full r=1.0")]
    # Runs saved 100 - (10 + 40) = 50 and 100 - (12 + 44) = 44 s.
    assert p.saved_seconds == pytest.approx(47.0)
    assert p.saved_std == pytest.approx(math.sqrt(18.0))
    assert p.current and p.runs == 2 and p.kind == "full"
    g = by[("random_global r=0.5", "full r=1.0")]
    assert g.saved_seconds == pytest.approx(57.0) and g.saved_std == 0.0 and not g.current
    assert g.comparison.difference == pytest.approx(0.05)


def test_without_random_global_or_full_runs_the_decision_weighs_against_the_base_model():
    runs = _runs()[:3]
    numbers = report_numbers(runs, n_resamples=100)
    assert not numbers.full_measured
    points = decision_points(runs, numbers)
    assert [(p.reference, p.kind) for p in points] == [("base", "base")]
    report = render_report("d", runs, 60, 600, {}, {}, 10.0, n_resamples=100)
    assert list(report.pngs) == ["decision.png", "metrics.png", "time_vs_fraction.png"]


def test_the_answer_fits_inline_and_names_every_reference_that_fits():
    runs = _runs()
    report = render_report("d", runs, 60, 600, {}, {}, 10.0, n_resamples=100)
    assert list(report.pngs)[0] == "decision.png"
    answer = report.answer
    assert len(answer) < INLINE_MARKDOWN_LIMIT
    # Full 100 s - selection 10 s - the group's mean training 42 s.
    assert answer.startswith("**Net time saved: 48.0 s** (+48 % of full-data training)")
    assert "heldout_loss of **peripheral r=0.5** against random_global r=0.5: **" in answer
    assert "; against full r=1.0: **worse**" in answer and "; against base: **better**" in answer
    # Many references do not fit: the last ones are counted instead.
    numbers = report_numbers(runs, n_resamples=100)
    many = [
        _comparison("peripheral r=0.5", f"reference number {i} with a long name", 0.1, 0.05, 0.2)
        for i in range(20)
    ]
    crowded = type(numbers)(**{**numbers.__dict__, "comparisons": many})
    text = worth_it_markdown(crowded, 10.0)
    assert len(text) < INLINE_MARKDOWN_LIMIT and text.count("reference number") >= 3
    assert "more in `report`." in text


def test_each_interval_of_the_metrics_figure_carries_its_verdict_and_p():
    fig = _figures()["metrics vs base"]
    texts = [[t.get_text() for t in ax.texts] for ax in fig.get_axes() if ax.get_visible()]
    # heldout_loss: two groups, intervals clear of 0, p 0.001; pass@1: clear of 0 only at its
    # edge (low = 0.0) with p 0.5, so no verdict.
    assert texts == [
        ["better, p = 0.001", "better, p = 0.001"],
        ["no detectable difference, p = 0.5"],
    ]


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk (bytes 16-24, big-endian)."""
    assert data.startswith(PNG_SIGNATURE)
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# Dagster's Markdown dialog, where an asset page opens a figure, is 1,120 px wide in a
# 1,400-px window (issue 44); a figure must fit it whole.
DIALOG_PX = 1100


@pytest.mark.parametrize("name", FIGURES)
def test_every_figure_fits_the_ui_dialog_of_a_1400_px_window(name):
    width, _ = _png_size(plots.png(_figures()[name]))
    assert width <= DIALOG_PX, (name, width)


@pytest.mark.parametrize("metrics", [3, 4, 5])
def test_the_metrics_figure_wraps_its_panels_instead_of_growing_wider(metrics):
    names = ["heldout_loss", "humaneval_solution_nll", "mbpp_pass@1", "mmlu_accuracy", "x_y"]
    comparisons = [
        _comparison(group, "base", -0.1, -0.2, 0.05, names[m])
        for m in range(metrics)
        for group in ("peripheral r=0.5", "random_global r=0.5", "full r=1.0")
    ]
    fig = plots.metric_differences_figure(
        comparisons, dict.fromkeys(names, 1.0), dict.fromkeys(names, "nats/token")
    )
    width, height = _png_size(plots.png(fig))
    assert width <= DIALOG_PX
    shown = [ax for ax in fig.get_axes() if ax.get_visible()]
    assert [ax.get_title().split("\n")[0] for ax in shown] == names[:metrics]
    assert plots.panel_grid(metrics) == (math.ceil(metrics / 2), 2)
    assert height > width / 3  # rows, not one strip


def test_the_decision_figure_with_three_references_fits_too():
    points = [
        *_decision_points(),
        plots.DecisionPoint(
            "peripheral r=0.5",
            "base",
            "base",
            30.0,
            4.0,
            _comparison("peripheral r=0.5", "base", -0.2, -0.3, -0.1),
            True,
            2,
        ),
    ]
    fig = plots.decision_figure(points, "nats/token", "a long answer " * 12, "estimated " * 6)
    width, _ = _png_size(plots.png(fig))
    assert width <= DIALOG_PX
    assert sum(ax.get_visible() for ax in fig.get_axes()) == 3
