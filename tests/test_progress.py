"""Progress: plain lines with ETA when not on a terminal, a live tqdm line on one."""

from __future__ import annotations

import io
import os
import pty

from workloads.common import progress as P


def test_plain_lines_off_a_terminal(monkeypatch):
    monkeypatch.setattr(P, "LINE_INTERVAL_S", 0.0)
    out = io.StringIO()
    bar = P.Progress(total_steps=10, desc="run 1/1", show=True, stream=out)
    bar.set(epoch="1/2")
    bar.advance(5, loss=0.5)
    bar.message("run 1/1 epoch 1: eval top-1 0.5000")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("run 1/1 | step 5/10 |") and "ETA" in lines[0] and "loss 0.5" in lines[0]
    assert lines[1] == "run 1/1 epoch 1: eval top-1 0.5000"


def test_hidden_on_other_ranks():
    out = io.StringIO()
    bar = P.Progress(total_steps=10, desc="run", show=False, stream=out)
    bar.advance(10)
    bar.line()
    bar.message("done")
    assert out.getvalue() == ""


def test_live_line_on_a_terminal():
    leader, follower = pty.openpty()
    os.set_blocking(leader, False)
    import fcntl
    import struct
    import termios

    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    with os.fdopen(follower, "w") as stream:
        bar = P.Progress(total_steps=4, desc="run 1/1", show=True, stream=stream)
        bar.advance(2, loss=1.0)
        bar.set(top1=0.75)
        bar.close()
    text = os.read(leader, 65536).decode()
    os.close(leader)
    assert "\r" in text and "2/4" in text and "top1=0.75" in text
