"""A dependency-free progress line on stderr: redrawn in place on a terminal, one line every
few seconds otherwise (logs, the GPU machine's captured output)."""

from __future__ import annotations

import sys
import time


def fmt_seconds(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, label: str, total: int | None = None, every_s: float = 10.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = -1e9

    def update(self, done: int, info: str = "", force: bool = False, eta_s: float | None = None) -> None:
        now = time.monotonic()
        if not force and now - self.last < (0.2 if self.tty else self.every_s):
            return
        self.last = now
        if self.total:
            frac = min(done / self.total, 1.0)
            bar = "#" * int(frac * 20)
            head = f"[{self.label}] [{bar:<20}] {done}/{self.total}"
            if eta_s is None and done:
                eta_s = (now - self.t0) * (self.total - done) / done
        else:
            head = f"[{self.label}] {done}"
        tail = f" | {info}" if info else ""
        eta = f" | eta {fmt_seconds(eta_s)}" if eta_s is not None else ""
        line = f"{head} | {fmt_seconds(now - self.t0)}{eta}{tail}"
        sys.stderr.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self, done: int, info: str = "") -> None:
        self.update(done, info, force=True)
        if self.tty:
            sys.stderr.write("\n")
