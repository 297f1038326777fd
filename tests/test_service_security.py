"""What a token holder who is not one of a job's workers can do to it through the service:
take a rank that has not joined yet, learn its key or its name, forge a log line. Nothing."""

from __future__ import annotations

import logging

import grpc
import pytest

pytest.importorskip("p4runtime_sh")

from homagg.controller.serve import ONE_LINE_LOGGERS, one_line  # noqa: E402
from homagg.membership import pb2  # noqa: E402
from tests.staging import wait_for  # noqa: E402
from tests.test_service import (  # noqa: E402
    TOKEN,
    Rig,
    join_all,
    not_yours,
    refused,
    secret_of,
)

VICTIM = "10.9.8.7:29500/victim-run-42"


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def test_a_token_holder_without_the_join_secret_cannot_take_a_pending_rank(rig):
    """Rank 0 waits for rank 1 (a slow start, a restart); a squatter with the token and the
    job's name asks for rank 1 with a secret of its own: refused, told nothing of rank 0, and
    the real rank 1 joins as if it had not been there."""
    fut = rig.stub.Join.future(pb2.JoinRequest(
        token=TOKEN, job=VICTIM, rank=0, world_size=2, udp_port=41000, wait_seconds=20,
        join_secret=secret_of(VICTIM)), timeout=30)
    try:
        wait_for(lambda: VICTIM in rig.svc._pending, 10, "rank 0's join to wait")
        e = refused(lambda: rig.join(VICTIM, 1, 2, 41666, join_secret="squatters-own-secret"))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.details().startswith(f"job {VICTIM!r}: this join's secret is not the one the "
                                      "job's first rank gave")
        assert "41000" not in e.details() and "rank 0" not in e.details()
        assert rig.svc._pending[VICTIM].ranks == {0: ("127.0.0.1", 41000)}
        real = rig.join(VICTIM, 1, 2, 41001)
        first = fut.result()
    finally:
        fut.cancel()
    assert first.job_id == real.job_id and first.key == real.key != 0
    (job,) = rig.jobs()
    assert sorted(w["udp_port"] for w in job["workers"]) == [41000, 41001]


@pytest.mark.parametrize("secret", ["", "too-short"])
def test_a_join_without_a_join_secret_is_refused(rig, secret):
    e = refused(lambda: rig.join("j", 0, 1, 40000, join_secret=secret))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith("job 'j': a join secret of 16 to 512 characters is required")
    assert rig.jobs() == []


@pytest.mark.parametrize("secret,distinct", [("a" * 16, 1), ("ab" * 12, 2),
                                             ("abcdefg" * 4, 7)])
def test_a_join_secret_that_varies_too_little_is_refused_saying_the_rule(rig, secret, distinct):
    e = refused(lambda: rig.join("j", 0, 1, 40000, join_secret=secret))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith(f"job 'j': the join secret varies too little ({distinct} "
                                  "distinct characters, about "), e.details()
    assert "at least 8 distinct characters and 48 bits" in e.details()
    assert rig.jobs() == []


def test_a_competing_join_is_said_to_hold_the_name(rig):
    """A squatter joined the name first with its own secret: the real rank's refusal says
    that another attempt holds the name, not only that its own secret is wrong."""
    fut = rig.stub.Join.future(pb2.JoinRequest(
        token=TOKEN, job=VICTIM, rank=0, world_size=2, udp_port=41666, wait_seconds=20,
        join_secret="squatters-own-secret"), timeout=30)
    try:
        wait_for(lambda: VICTIM in rig.svc._pending, 10, "the squatter's join to wait")
        e = refused(lambda: rig.join(VICTIM, 0, 2, 41000))
    finally:
        fut.cancel()
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "another attempt, with a different join secret, holds this name now (a competing " \
           "join by the same name" in e.details(), e.details()
    assert "41666" not in e.details()


def test_a_lease_request_is_told_of_a_job_only_by_its_own_worker(rig):
    """After the job is gone, Renew's NOT_FOUND says why to its own workers (their address
    and secret), and to anyone else nothing of it: not its name, nor its workers."""
    got = join_all(rig, VICTIM, 2, ports=[41000, 41001])
    job_id = got[0].job_id
    assert rig.stub.Leave(rig.lease(job_id, 0, 41000, got[0].secret)).removed is False
    assert rig.stub.Leave(rig.lease(job_id, 1, 41001, got[1].secret)).removed is True
    for asked in ((0, 41000, "a-guess"), (0, 41666, got[0].secret), (5, 41000, got[0].secret)):
        e = refused(lambda a=asked: rig.stub.Renew(rig.lease(job_id, *a)))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.details() == not_yours(job_id, asked[0], asked[1])
    e = refused(lambda: rig.stub.Renew(rig.lease(job_id, 0, 41000, got[0].secret)))
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert e.details() == f"job {job_id} ({VICTIM}) was removed: every worker left"


def test_renew_cannot_tell_a_held_job_from_none(rig):
    """Without the secret, a Renew or Leave of a held job (any worker, any port) is refused
    exactly as one of a job id nobody holds: no list of the jobs held, nor of their workers'
    ports, from about 24k Renews."""
    got = join_all(rig, VICTIM, 2, ports=[41000, 41001])
    held = got[0].job_id
    free = held + 1
    for call in (rig.stub.Renew, rig.stub.Leave):
        for worker, port in ((0, 41000), (1, 41001), (0, 41001), (1, 41666)):
            said = []
            for job in (held, free):
                e = refused(lambda c=call, j=job, w=worker, p=port: c(rig.lease(j, w, p, "")))
                said.append((e.code(), e.details().replace(f"job {job} ", "job N ")))
            assert said[0] == said[1] == (grpc.StatusCode.PERMISSION_DENIED,
                                          not_yours(held, worker, port).replace(
                                              f"job {held} ", "job N ")), said
    assert [j["id"] for j in rig.jobs()] == [held]


def test_a_running_jobs_lease_refusals_name_nothing_of_it(rig):
    got = join_all(rig, VICTIM, 1, ports=[41000])
    e = refused(lambda: rig.stub.Renew(rig.lease(got[0].job_id, 0, 41000, "a-guess")))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "victim" not in e.details()


def test_one_line_escapes_what_is_not_printable():
    assert one_line("job 'j'") == "job 'j'"
    assert one_line("a\nb\rc\x1b[2Jd\te") == "a\\nb\\rc\\x1b[2Jd\\te"


def test_a_line_break_in_a_claimed_address_cannot_start_a_log_line(rig, caplog):
    forged = "10.0.0.1\n2026-11-29 INFO homagg.service: job 9 removed"
    with caplog.at_level(logging.INFO):
        e = refused(lambda: rig.join("j", 0, 1, 40000, ip=forged))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        e = refused(lambda: rig.stub.Renew(pb2.LeaseRequest(token=TOKEN, job_id=1, worker=0,
                                                            udp_port=40000, ip=forged)))
    said = [r.getMessage() for r in caplog.records if r.name in ONE_LINE_LOGGERS]
    assert len(said) == 2, said
    assert all("\n" not in m and "\\n2026-11-29 INFO" in m for m in said), said


def test_a_malformed_request_is_logged_in_one_line(rig, caplog):
    """gRPC logs a request it cannot parse with a traceback of about 1 KB: here, one line."""
    join = rig.channel.unary_unary("/homagg.membership.Membership/Join",
                                   request_serializer=None, response_deserializer=None)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                join(b"\xff\xff\xff\xff not a JoinRequest", timeout=10)
            assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    said = [r for r in caplog.records if r.name.startswith("grpc")]
    assert said, "gRPC logged nothing of the malformed requests"
    for r in said:
        assert r.exc_info is None and r.exc_text is None
        assert "\n" not in r.getMessage() and len(r.getMessage()) < 400, r.getMessage()


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (what a client may send, valid or not)."""
    n, varint = len(payload), b""
    while True:
        varint += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return bytes([number << 3 | 2]) + varint + payload


def test_a_huge_malformed_join_adds_a_few_hundred_bytes_to_the_log(rig):
    """A Join whose job field is 3.9 MB of 0xff (not UTF-8), with no token, 3 times: the
    service's log (every record as its handler writes it) grows by at most a few hundred
    bytes a request, not by the request's repr (4 bytes a byte received)."""
    import io

    join = rig.channel.unary_unary("/homagg.membership.Membership/Join",
                                   request_serializer=None, response_deserializer=None)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                join(_field(2, b"\xff" * 3_900_000), timeout=30)
            assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    text = out.getvalue()
    assert "deserializ" in text, text[:2000]
    assert len(text) < 3 * 600, (len(text), text[:2000])
    assert "characters in all]" in text  # cut, and said so


def test_any_record_of_the_one_line_loggers_is_bounded(caplog):
    """Not only gRPC's: a service record with a long argument, and one with a long
    exception, each stay within the line's and the traceback's caps."""
    from homagg.controller import serve

    log = logging.getLogger("homagg.serve.test-cap")
    log.addFilter(serve._OneLine())
    with caplog.at_level(logging.INFO, logger="homagg.serve.test-cap"):
        log.info("job %r refused: %s", "\x00" * 100_000, "y" * 100_000)
        try:
            raise ValueError("z" * 100_000)
        except ValueError:
            log.exception("a request failed: %d", 7)
    first, second = caplog.records[-2:]
    assert len(first.getMessage()) <= serve.LINE_LIMIT + 60, len(first.getMessage())
    assert "\n" not in first.getMessage() and "characters in all]" in first.getMessage()
    assert second.getMessage() == "a request failed: 7"
    assert second.exc_text is not None and len(second.exc_text) <= serve.TRACEBACK_LIMIT + 60


def test_the_ranks_of_a_group_share_one_secret_through_its_store():
    dist = pytest.importorskip("torch.distributed")
    from homagg.host_agent.distributed.backend import shared_join_secret

    store = dist.HashStore()
    one = shared_join_secret(dist.PrefixStore("attempt_0/default_pg/", store))
    assert len(one) == 32
    assert shared_join_secret(dist.PrefixStore("attempt_0/default_pg/", store)) == one
    # another attempt (torchrun's prefix) or another group draws its own
    assert shared_join_secret(dist.PrefixStore("attempt_1/default_pg/", store)) != one


def test_a_plain_serve_and_its_metrics_are_not_reachable_off_loopback(tmp_path):
    """``homagg-ctl serve`` with no --listen serves this host only, and its metrics where it
    serves; a worker on another host needs an address given on purpose."""
    import socket
    import urllib.request

    from homagg.controller.cli import parser
    from homagg.controller.serve import start
    from homagg.controller.service import JobService
    from homagg.udpio import route_source

    a = parser().parse_args(["serve"])
    host, _, _ = a.listen.rpartition(":")
    assert host == "127.0.0.1" and a.metrics_addr is None
    rig = Rig(tmp_path)
    try:
        rig.stop_service()
        svc = JobService(rig.agg.config, rig.svc._connect, rig.opts)
        srv = start(svc, f"{host}:0", metrics_port=0)
        try:
            port = int(srv.address.rpartition(":")[2])
            assert srv.metrics.server_address[0] == "127.0.0.1"
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics",
                                        timeout=5) as r:
                assert r.status == 200
            try:
                other = route_source(("192.0.2.1", 9))  # an address of this host's, not lo
            except OSError:
                other = None
            if other is None or other.startswith("127."):
                pytest.skip("this host has no address but loopback to try from")
            for p in (port, srv.metrics_port):
                with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                    s.settimeout(5)
                    s.connect((other, p))
        finally:
            srv.stop()
    finally:
        rig.agg.stop()


def test_p4runtime_over_tls_without_a_client_ca_is_refused_unless_said(tmp_path, caplog):
    """The aggregator's P4Runtime over TLS takes only controllers its client CA signed; one
    that takes any client is asked for by name, and said in a warning."""
    import argparse

    pytest.importorskip("cryptography.x509")
    from homagg.errors import HomaggError
    from homagg.targets.soft import SoftSwitch
    from homagg.targets.soft.cli import _p4runtime, parser
    from tests.test_service_tls import make_pki

    _, cert, key = make_pki(tmp_path, "switch")
    tls = ["--grpc", "127.0.0.1:0", "--grpc-tls-cert", str(cert), "--grpc-tls-key", str(key)]
    a: argparse.Namespace = parser().parse_args(tls)
    with pytest.raises(HomaggError, match=r"^P4Runtime over TLS without --grpc-tls-client-ca "
                                          r"takes any client as primary"):
        _p4runtime(a, None, SoftSwitch())
    with caplog.at_level(logging.WARNING):
        srv = _p4runtime(parser().parse_args(tls + ["--grpc-tls-any-client"]), None,
                         SoftSwitch())
        srv.stop()
        plain = _p4runtime(parser().parse_args(["--grpc", "0.0.0.0:0"]), None, SoftSwitch())
        plain.stop()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("over TLS WITHOUT client certificates (--grpc-tls-any-client)" in m
               for m in said), said
    assert any("in clear, WITHOUT client certificates" in m for m in said), said


def test_a_record_of_any_logger_through_the_roots_handlers_is_bounded():
    """What the service's process writes comes through the root logger's handlers: once
    ``serve`` bounded them, a record of any logger (the placement's, a library's) is one
    bounded line too."""
    import io

    from homagg.controller import serve

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        serve.one_line_logs()
        logging.getLogger("homagg.placement.test-cap").warning("job %s:\n%s", "x" * 50_000,
                                                               "\xff" * 50_000)
    finally:
        root.removeHandler(handler)
    text = out.getvalue()
    assert text.count("\n") == 1 and len(text) <= serve.LINE_LIMIT + 60, len(text)
    assert "characters in all]" in text
