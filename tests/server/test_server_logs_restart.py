"""Every start keeps its own log, and `restart` stops and starts a profile with the options it was
started with: the stand-in server (tests/server/fake_server.py) over real SSH."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from toolkit.server import server


def starting_line(state) -> str:
    return f"launch.sh: starting profile {state.profile} (pid {state.pid})"


def host_run(host, command: str) -> str:
    with host.connect() as transport:
        done = transport.run(command)
    assert done.ok, done.stderr
    return done.stdout


def test_two_starts_of_a_profile_keep_two_logs(fake_host):
    first = server.start(fake_host, "fake", timeout=30)
    server.stop(fake_host, grace=5)
    second = server.start(fake_host, "fake", timeout=30)
    try:
        assert first.log_path != second.log_path
        kept = server.list_logs(fake_host)
        assert kept["profile"] == "fake"
        assert [entry["path"] for entry in kept["logs"]] == [first.log_path, second.log_path]
        assert [entry["current"] for entry in kept["logs"]] == [False, True]
        current = server.read_log(fake_host)
        assert starting_line(second) in current and starting_line(first) not in current
        previous = server.read_log(fake_host, run=1)
        assert starting_line(first) in previous and starting_line(second) not in previous
        both = server.read_log(fake_host, since_start=False)
        assert both.index(starting_line(first)) < both.index(starting_line(second))
        assert starting_line(first) in host_run(fake_host, f"cat {first.log_path}")   # the first log is intact
        link = posixpath_join(fake_host.state_dir, "server", "fake", "server.log")
        assert host_run(fake_host, f"readlink -f {link}").strip() == second.log_path
        with pytest.raises(server.ServerError, match="profile fake has 2 kept log"):
            server.read_log(fake_host, run=2)
    finally:
        server.stop(fake_host, grace=5)


def posixpath_join(*parts: str) -> str:
    return "/".join(part.rstrip("/") for part in parts)


def test_rank_filter_reads_this_runs_log(fake_host):
    server.start(fake_host, "fake-tp", timeout=30)
    server.stop(fake_host, grace=5)
    server.start(fake_host, "fake-tp", timeout=30, overrides={"dyn_threshold": 9})
    try:
        rank3 = server.read_log(fake_host, rank=3)
        assert rank3.count("threshold=9") == 1 and "threshold=5" not in rank3 and "TP2]" not in rank3
        assert server.read_log(fake_host, rank=3, run=1).count("threshold=5") == 1
    finally:
        server.stop(fake_host, grace=5)


def test_logs_beyond_keep_logs_are_removed_oldest_first_and_old_layout_logs_are_adopted(fake_host):
    folder = posixpath_join(fake_host.state_dir, "server", "fake")
    # a log written by a toolkit before per-start logs: a plain server.log (and its .prev)
    host_run(fake_host, f"mkdir -p {folder} && echo old-run > {folder}/server.log && echo older-run > {folder}/server.log.prev")
    host = dataclasses.replace(fake_host, server={**fake_host.server, "keep_logs": 3})
    first = server.start(host, "fake", timeout=30)
    server.stop(host, grace=5)
    kept = [entry["path"] for entry in server.list_logs(host)["logs"]]
    assert len(kept) == 3 and kept[-1] == first.log_path
    assert [host_run(host, f"cat {path}").strip() for path in kept[:2]] == ["older-run", "old-run"]
    second = server.start(host, "fake", timeout=30)
    server.stop(host, grace=5)
    assert any("removed 1 old log(s) of fake beyond the newest 3" in note for note in second.notes)
    kept = [entry["path"] for entry in server.list_logs(host)["logs"]]
    assert len(kept) == 3 and kept[1:] == [first.log_path, second.log_path]
    assert host_run(host, f"cat {kept[0]}").strip() == "old-run"


def test_restart_keeps_the_options_it_was_started_with(fake_host):
    first = server.start(fake_host, "fake-tp", timeout=30, overrides={"dyn_threshold": 7})
    try:
        again = server.restart(fake_host, timeout=30)
        assert again.stopped.was_running and again.stopped.stopped and again.stopped.pid == first.pid
        started = again.started
        assert (started.profile, started.dyn_threshold, started.overrides) == ("fake-tp", 7, {"dyn_threshold": 7})
        assert started.pid != first.pid and started.log_path != first.log_path
        assert server.read_log(fake_host, rank=0).count("threshold=7") == 1
        # an option given now replaces the recorded one; the others stay
        changed = server.restart(fake_host, overrides={"dyn_threshold": 11}).started
        assert changed.dyn_threshold == 11 and changed.overrides == {"dyn_threshold": 11}
        # another profile starts with the options given now only
        other = server.restart(fake_host, "fake").started
        assert other.profile == "fake" and other.overrides == {}
        assert server.status(fake_host).pid == other.pid
    finally:
        server.stop(fake_host, grace=5)


def test_restart_with_bad_options_stops_nothing(fake_host):
    running = server.start(fake_host, "fake-tp", timeout=30)
    try:
        with pytest.raises(server.profiles.ProfileError, match="dyn_hysteresis must satisfy"):
            server.restart(fake_host, overrides={"dyn_threshold": 4, "dyn_hysteresis": 4})
        assert server.status(fake_host).pid == running.pid
    finally:
        server.stop(fake_host, grace=5)


def test_restart_with_nothing_running_starts_the_last_profile_and_says_so(fake_host):
    with pytest.raises(server.ServerRefused, match="nothing to restart; start one with: invoke server start PROFILE"):
        server.restart(fake_host)
    server.start(fake_host, "fake-tp", timeout=30, overrides={"dyn_threshold": 6})
    server.stop(fake_host, grace=5)
    again = server.restart(fake_host, timeout=30)
    try:
        assert again.stopped is None
        assert again.started.profile == "fake-tp" and again.started.dyn_threshold == 6
        assert any("nothing is running; starting fake-tp, the last profile started" in n for n in again.started.notes)
    finally:
        server.stop(fake_host, grace=5)


def test_following_the_log_moves_to_the_next_run(fake_host):
    first = server.start(fake_host, "fake", timeout=30)
    seen: list[str] = []
    follower = threading.Thread(target=server.follow_log, args=(fake_host,),
                                kwargs={"lines": 0, "duration": 20, "interval": 0.2, "emit": seen.append,
                                        "should_stop": lambda: any("listening on" in s for s in seen[1:])})
    follower.start()
    try:
        second = server.restart(fake_host, timeout=30).started
        follower.join(timeout=40)
        text = "\n".join(seen)
        marker = f"--- a new run of fake: {second.log_path} ---"
        assert text.index(starting_line(first)) < text.index(marker) < text.index(starting_line(second))
    finally:
        follower.join(timeout=40)
        server.stop(fake_host, grace=5)


def test_starts_within_one_second_keep_their_order_and_the_units_log_is_not_one_of_them(tmp_path):
    """Two starts in the same second get PROFILE-STAMP.log and PROFILE-STAMP-2.log; plain name
    order would put the second first and `logs --run 1` would find no earlier run. Logs adopted
    from the old layout in that second stay before them."""
    from toolkit.hostside import server_ctl

    names = ["fake-20261130T090001Z.log", "fake-20261130T090000Z-2.log", "fake-20261130T090000Z-10.log",
             "fake-20261130T085959Z-old-1.log", "fake-20261130T090000Z.log", "fake-20261130T090000Z-old-2.log",
             "fake-systemd.log"]   # the installed unit's log: not a start's, never the current one
    for name in names:
        (tmp_path / name).write_text("")
    order = [p.rsplit("/", 1)[1] for p in server_ctl._run_logs({"logs": str(tmp_path)})]
    assert order == ["fake-20261130T085959Z-old-1.log", "fake-20261130T090000Z-old-2.log",
                     "fake-20261130T090000Z.log", "fake-20261130T090000Z-2.log", "fake-20261130T090000Z-10.log",
                     "fake-20261130T090001Z.log"]


def test_following_a_log_moves_past_a_chunk_without_a_line_end(tmp_path, monkeypatch):
    """A line longer than one read (a dumped tensor, binary noise) must not hold the follower at its
    offset for good; a short partial line still waits for its end."""
    from toolkit.hostside import server_ctl

    monkeypatch.setattr(server_ctl, "FOLLOW_CHUNK_BYTES", 64)
    log = tmp_path / "server.log"
    log.write_bytes(b"first\n" + b"x" * 100 + b"\nlast part")
    text, offset = server_ctl._follow_chunk(str(log), 0)
    assert (text, offset) == ("first\n", 6)
    text, offset = server_ctl._follow_chunk(str(log), offset)
    assert (text, offset) == ("x" * 64, 70)
    text, offset = server_ctl._follow_chunk(str(log), offset)
    assert (text, offset) == ("x" * 36 + "\n", 107)
    assert server_ctl._follow_chunk(str(log), offset) == ("", 107)   # "last part" waits for its line end
