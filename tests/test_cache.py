"""The cache of generated inputs (tiny datasets, warm starts): built once even when processes ask at once."""

from __future__ import annotations

import fcntl
import threading

from workloads.common import cache


def test_a_second_builder_waits_for_the_first_and_does_not_build_again(tmp_path, monkeypatch):
    """Two builders of one entry at once (two ranks' nodes, two test workers on one data folder): the second
    waits at the lock and finds the entry built, so an expensive build (a warm-start training) runs once."""
    root = tmp_path / "entry"
    writes, first_writing, second_waiting, release = [], threading.Event(), threading.Event(), threading.Event()
    real_flock = fcntl.flock

    def flock(fd, op):
        if threading.current_thread().name == "second":
            second_waiting.set()
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)

    def write(folder):
        writes.append(threading.current_thread().name)
        if threading.current_thread().name == "first":
            first_writing.set()
            assert release.wait(120)
        (folder / "done").write_text("x")

    first = threading.Thread(target=cache.build_once, args=(root, write), name="first")
    second = threading.Thread(target=cache.build_once, args=(root, write), name="second")
    first.start()
    assert first_writing.wait(120)
    second.start()
    # The second is at the lock, or (without one) has finished building its own copy.
    while not (second_waiting.wait(0.05) or not second.is_alive()):
        pass
    release.set()
    first.join(120)
    second.join(120)
    assert writes == ["first"] and (root / "done").read_text() == "x"
