"""An agent does not trust its JoinReply (issue 57): a service on a plaintext link can be
impersonated, and a buggy one can say anything. Each field out of range is a JoinError that
names it and its value, from ``join`` itself (a fake service answers), never a raw
OverflowError, gaierror or struct.error later, nor a renew thread that spins or dies."""

from __future__ import annotations

import math
import threading
import time
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")

from homagg.host_agent.membership import JoinError, Membership, check_reply, join  # noqa: E402
from homagg.membership import pb2, rpc  # noqa: E402

GOOD = dict(send_to_ip="127.0.0.1", send_to_port=0xBEE0, job_id=5, worker=1, workers=2,
            slots=16, place="s1", place_role="switch", run=7, lease_seconds=15.0,
            ip="127.0.0.1", secret="s" * 32, key=99)

BAD = [
    ("send_to_port", 70000, "send_to_port 70000 is not in 1 to 65535"),
    ("send_to_port", 0, "send_to_port 0 is not in 1 to 65535"),
    ("send_to_ip", "999.1.1.1", "send_to_ip '999.1.1.1' is not an IPv4 address"),
    ("send_to_ip", "::1", "send_to_ip '::1' is not an IPv4 address (the agent speaks IPv4 only)"),
    ("send_to_ip", "", "send_to_ip '' is not an IPv4 address"),
    ("send_to_ip", "0.0.0.0", "send_to_ip '0.0.0.0' is not a unicast address"),
    ("job_id", 2**32 - 1, "job_id 4294967295 is not in 1 to 63"),
    ("job_id", 0, "job_id 0 is not in 1 to 63"),
    ("worker", 2, "worker 2 is not in 0 to 1"),
    ("slots", 5000, "slots 5000 is not in 1 to 1024"),
    ("leaf_workers", 300, "leaf_workers 300 is not in 0 to 64"),
    ("lease_seconds", math.nan, "lease_seconds nan is not a finite number of seconds"),
    ("lease_seconds", math.inf, "lease_seconds inf is not a finite number of seconds"),
    ("lease_seconds", -1.0, "lease_seconds -1.0 is not a finite number of seconds"),
    ("lease_seconds", 0.0, "lease_seconds 0.0 is not a finite number of seconds"),
    ("lease_seconds", 1e12, "lease_seconds 1000000000000.0 is not a finite number of seconds"),
]


def test_a_good_reply_passes():
    check_reply(pb2.JoinReply(**GOOD), "job 'j' rank 1")


@pytest.mark.parametrize("field,value,said", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_each_field_out_of_range_is_named(field, value, said):
    with pytest.raises(JoinError) as e:
        check_reply(pb2.JoinReply(**{**GOOD, field: value}), "job 'j' rank 1")
    assert str(e.value).startswith("job 'j' rank 1: the controller's answer is unusable: "
                                   + said), str(e.value)


class _Fake(rpc.MembershipServicer):
    def __init__(self, reply):
        self.reply = reply

    def Join(self, request, context):
        return self.reply


@pytest.mark.parametrize("field,value,said", [BAD[0], BAD[2], BAD[3], BAD[6], BAD[11],
                                               BAD[12]], ids=lambda x: str(x)[:20])
def test_join_against_a_service_that_lies_is_a_join_error(field, value, said):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    rpc.add_MembershipServicer_to_server(_Fake(pb2.JoinReply(**{**GOOD, field: value})), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(JoinError, match=said.split(" is not")[0]):
            join(f"127.0.0.1:{port}", "", "j", 1, 2, wait=5.0, retry=0.0,
                 join_secret="a join secret of the test")
        assert not [t for t in threading.enumerate() if t.name.startswith("homagg-lease")]
    finally:
        server.stop(0)


def test_the_renew_thread_outlives_a_failure_that_is_not_grpcs():
    """A renewal that raises something else than an RpcError (a bug, a broken stub) is
    logged, and the next one goes on: the thread neither dies nor spins."""
    calls: list[float] = []

    class Stub:
        def Renew(self, request, timeout):
            calls.append(time.monotonic())
            if len(calls) == 1:
                raise OverflowError("a broken stub")

    m = Membership("127.0.0.1:1", "", "j", 5, 0, 1, 16, ("127.0.0.1", 0xBEE0), "127.0.0.1",
                   40000, 7, 0.3, "s1", _stub=Stub())
    m.start()
    try:
        time.sleep(0.75)
        assert m._thread is not None and m._thread.is_alive()
        assert 3 <= len(calls) <= 8 and m.renewals == len(calls) - 1, calls
    finally:
        m._stop.set()
        m._thread.join(5)


def test_an_agent_refuses_a_plain_join_secret_before_it_joins():
    from homagg.host_agent import AgentConfig, AgentError

    env = {"HOMAGG_CONTROLLER": "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", "HOMAGG_JOIN_SECRET": "a" * 16}
    with pytest.raises(AgentError, match=r"^\$HOMAGG_JOIN_SECRET: the join secret varies too "
                                         r"little \(1 distinct characters"):
        AgentConfig.from_env(env)
