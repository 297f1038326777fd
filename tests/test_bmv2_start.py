"""Starting bmv2 waits for it to serve, and a start that fails says why (no bmv2 needed: a
stand-in program plays simple_switch_grpc, found through $HOMAGG_BMV2)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from homagg.targets.bmv2 import Bmv2Error, Bmv2Switch

FAKE = textwrap.dedent("""\
    #!{python}
    import socket, sys, time
    args = sys.argv[1:]
    host, port = args[args.index("--grpc-server-addr") + 1].rsplit(":", 1)
    print("starting up", flush=True)
    if {fail}:
        print("Error: interface veth9 not found", flush=True)
        sys.exit(3)
    time.sleep({delay})
    s = socket.socket()
    s.bind((host, int(port)))
    s.listen()
    print("Server listening on", port, flush=True)
    time.sleep(60)
""")


def fake(tmp_path, monkeypatch, delay=0.0, fail=False):
    exe = tmp_path / "simple_switch_grpc"
    exe.write_text(FAKE.format(python=sys.executable, delay=delay, fail=fail))
    exe.chmod(0o755)
    monkeypatch.setenv("HOMAGG_BMV2", str(exe))
    return Bmv2Switch({}, tmp_path / "logs")


def test_a_slow_start_is_waited_for_while_the_switch_lives(tmp_path, monkeypatch):
    sw = fake(tmp_path, monkeypatch, delay=2.0)
    try:
        assert sw.start(timeout=30) is sw  # two seconds of start-up: no fixed 1 s would do
    finally:
        sw.stop()


def test_a_failed_start_says_why_with_the_switchs_last_lines(tmp_path, monkeypatch):
    sw = fake(tmp_path, monkeypatch, fail=True)
    with pytest.raises(Bmv2Error, match="exited with 3 before serving P4Runtime") as e:
        sw.start(timeout=30)
    assert "interface veth9 not found" in str(e.value)


def test_a_start_past_the_limit_says_it_was_still_starting(tmp_path, monkeypatch):
    sw = fake(tmp_path, monkeypatch, delay=30.0)
    monkeypatch.setenv("HOMAGG_BMV2_START_TIMEOUT", "1")
    with pytest.raises(Bmv2Error, match="still starting") as e:
        sw.start()
    assert "starting up" in str(e.value) and sw.proc is None  # and it was stopped
