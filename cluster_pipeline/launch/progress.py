"""What a running process says while it has nothing else to say: a heartbeat line that names
what still runs, so that a person reading a run's log never waits over 30 s for a line (issue
44). Torch-free: the Dagster step process (the built-in model's conversion) and every rank
(``training/distributed.Reporter``) use it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

# Seconds without a line after which a heartbeat says what still runs (issue 44: a person
# watching the log should never wait over 30 s without a line; 25 s leaves room for the line's
# way through Pipes to the run's log).
HEARTBEAT_S = 25.0


def cut(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its first ``limit`` - 1, cut at
    the last space there where one is, and "…" (a heartbeat names what runs, it does not
    repeat a long line: issue 44's 321-character one)."""
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    return (head[:space] if space > limit // 2 else head).rstrip() + "…"


class Heartbeat:
    """Says what runs when nothing else was said for ``every_s`` seconds: a phase that has
    no progress of its own (loading a model, the first training step, a held-out loss, a
    long batch on a busy machine) still gets a line at least that often.

    What runs is the last :meth:`doing` (``"training step 1/7"``), else the last line logged;
    :meth:`line` gives the heartbeat due at the clock's time (None when something was said
    within ``every_s`` seconds); :meth:`running` starts a thread that logs it, checking every
    ``poll_s`` seconds. Thread-safe: the thread and the caller log through one lock.
    """

    def __init__(
        self,
        log: Callable[[str], None],
        every_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log, self.every_s, self.clock = log, every_s, clock
        self._lock = threading.Lock()
        self._last = self._since = clock()
        self._last_line = ""
        self._doing: str | None = None

    def say(self, message: str, log: Callable[[str], None] | None = None) -> None:
        """Log ``message`` now (with ``log``, default the heartbeat's) and count it as said."""
        with self._lock:
            (log or self._log)(message)
            self._last, self._last_line, self._doing = self.clock(), message, None

    def doing(self, what: str, say: bool = True) -> None:
        """``what`` runs from now on (logged unless ``say`` is False): what the heartbeat names."""
        if say:
            self.say(what)
        with self._lock:
            self._doing, self._since = what, self.clock()

    def line(self) -> str | None:
        """The heartbeat due now, or None."""
        with self._lock:
            now = self.clock()
            if now - self._last < self.every_s or not (self._doing or self._last_line):
                return None
            if self._doing:
                return f"{cut(self._doing, 100)}: still running, {now - self._since:.0f} s so far"
            # The last line quoted as such: a finished result must not read as if it still ran.
            return f'still working, {now - self._last:.0f} s after "{cut(self._last_line, 60)}"'

    def beat(self) -> None:
        """Log the heartbeat due now, if any."""
        due = self.line()
        if due is not None:
            with self._lock:
                self._log(due)
                self._last = self.clock()

    @contextlib.contextmanager
    def running(self, poll_s: float = 1.0) -> Iterator[Heartbeat]:
        """A daemon thread calls :meth:`beat` every ``poll_s`` seconds until the block ends."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(poll_s):
                self.beat()

        thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


# Characters of a log message, Dagster's prefix aside (``<time> - dagster - INFO - <job> - <run
# id> - <step> - `` takes 100-130): a line of the run's log stays under 300 (issue 44).
LOG_MESSAGE_CHARS = 170


def short_lines(text: str, limit: int = LOG_MESSAGE_CHARS) -> list[str]:
    """``text`` cut at its list separators (``"; "``, then ``", "``) into lines of at most
    ``limit`` characters, for a log that a person reads line by line: every line after the first
    starts with two spaces. A piece longer than ``limit`` with no separator stays whole.

    Example: ``short_lines("a: x, y; b: z", 9)`` is ``["a: x, y;", "  b: z"]``.
    """
    if len(text) <= limit:
        return [text]
    lines: list[str] = []
    current = ""
    for major in _split_keep(text, "; "):
        for piece in _split_keep(major, ", ") if len(major) > limit else [major]:
            if current and len(current) + len(piece) > limit:
                lines.append(current.rstrip())
                current = "  " + piece
            else:
                current += piece
    lines.append(current.rstrip())
    return lines


def _split_keep(text: str, separator: str) -> list[str]:
    """``text`` split after each ``separator``, which stays at its piece's end."""
    parts = text.split(separator)
    return [p + separator for p in parts[:-1]] + [parts[-1]]
