"""AgentConfig.from_env: what a program started by homagg-net exec finds in its environment."""

from __future__ import annotations

import pytest

from homagg import wire
from homagg.host_agent import AgentConfig, AgentError

ENV = {"HOMAGG_JOB": "3", "HOMAGG_WORKER": "1", "HOMAGG_WORKERS": "4",
       "HOMAGG_SWITCH": "10.0.0.254:48864", "HOMAGG_BIND": "10.0.0.2:50000", "HOMAGG_SLOTS": "16"}


def test_from_env_reads_every_setting():
    cfg = AgentConfig.from_env(ENV, mode="union")
    assert (cfg.job, cfg.worker, cfg.workers, cfg.slots) == (3, 1, 4, 16)
    assert cfg.switch == ("10.0.0.254", 48864) and cfg.bind == ("10.0.0.2", 50000)
    assert cfg.mode == "union"


def test_ports_default_when_left_out():
    env = {**ENV, "HOMAGG_SWITCH": "10.0.0.254", "HOMAGG_BIND": "10.0.0.2"}
    del env["HOMAGG_SLOTS"]
    cfg = AgentConfig.from_env(env)
    assert cfg.switch[1] == wire.HOMAGG_UDP_PORT_MIN and cfg.bind[1] == wire.DEFAULT_AGENT_PORT
    assert cfg.slots == 64


def test_a_worker_under_a_trees_leaf_reads_its_leaf_settings():
    env = {**ENV, "HOMAGG_WORKERS": "8", "HOMAGG_LOCAL_WORKERS": "4",
           "HOMAGG_SIBLINGS": "leaf1,leaf2"}
    cfg = AgentConfig.from_env(env)
    assert (cfg.worker, cfg.workers, cfg.local_workers) == (1, 8, 4)
    assert cfg.siblings == ("leaf1", "leaf2")
    assert AgentConfig.from_env(ENV).local_workers is None  # a star's worker


@pytest.mark.parametrize("change,message", [
    ({"HOMAGG_LOCAL_WORKERS": "four"}, "must be integers"),
    ({"HOMAGG_LOCAL_WORKERS": "1"}, "worker 1 of 1 at its switch"),
    ({"HOMAGG_JOB": ""}, r"\$HOMAGG_JOB is not set"),
    ({"HOMAGG_WORKERS": "four"}, "must be integers"),
    ({"HOMAGG_BIND": "10.0.0.2:x"}, r"\$HOMAGG_BIND='10.0.0.2:x'"),
    ({"HOMAGG_WORKER": "4"}, "need 0 <= worker < workers"),
])
def test_bad_environment_is_one_clear_error(change, message):
    with pytest.raises(AgentError, match=message):
        AgentConfig.from_env({**ENV, **change})


# -- joining through the controller service (HOMAGG_CONTROLLER): what is missing, before any
# request; the joins themselves are tests/test_service.py's

TORCHRUN = {"HOMAGG_CONTROLLER": "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
            "HOMAGG_JOIN_SECRET": "a-join-secret-of-16+"}


@pytest.mark.parametrize("change,message", [
    ({"RANK": ""}, r"\$RANK is not set: with HOMAGG_CONTROLLER, start the program with torchrun"),
    ({"WORLD_SIZE": "two"}, "RANK, WORLD_SIZE, HOMAGG_SLOTS, HOMAGG_JOIN_TIMEOUT, "
                            "HOMAGG_JOIN_RETRY and HOMAGG_BIND's port must be numbers"),
    ({"MASTER_PORT": ""}, r"\$MASTER_PORT is not set"),
    ({"HOMAGG_CONTROLLER": "ctl-host"}, "HOMAGG_CONTROLLER 'ctl-host': expected HOST:PORT"),
    ({"HOMAGG_JOIN_SECRET": ""}, r"\$HOMAGG_JOIN_SECRET is not set: with HOMAGG_CONTROLLER, "
                                 "every rank of a job presents the same join secret"),
    ({"HOMAGG_JOIN_SECRET": "short"}, r"\$HOMAGG_JOIN_SECRET is too short"),
])
def test_joining_through_the_service_needs_torchruns_settings(change, message):
    with pytest.raises(AgentError, match=message):
        AgentConfig.from_env({**TORCHRUN, **change})


def test_the_services_settings_take_precedence_over_homagg_execs():
    """With HOMAGG_CONTROLLER set, HOMAGG_JOB and the like are not read: the service says."""
    with pytest.raises(AgentError, match=r"cannot reach the controller at 127\.0\.0\.1:1"):
        AgentConfig.from_env({**ENV, **TORCHRUN, "HOMAGG_BIND": "127.0.0.1",
                              "HOMAGG_JOIN_TIMEOUT": "2", "HOMAGG_JOIN_RETRY": "0"})


def test_a_worker_the_service_placed_in_a_tree_speaks_its_leafs_numbering(monkeypatch):
    """The service's reply for a job on a tree of switches: the worker's id and job size at
    its leaf (what its packets carry), the leaf's parent's children; the lease stays the
    service's worker (``Membership.worker``). On one switch (leaf_workers 0): the worker."""
    from homagg.host_agent import membership

    def join(controller, token, name, rank, world, bind, *args, **kwargs):
        tree = rank == 5
        return membership.Membership(
            controller, token, name, job_id=3, worker=rank, workers=world, slots=16,
            send_to=("10.0.0.201", 48864), ip="127.0.0.1", udp_port=40000, run=7, lease=5.0,
            place="leaf2" if tree else "s1", leaf_worker=2 if tree else 0,
            leaf_workers=8 if tree else 0, siblings=("leaf1", "leaf2") if tree else ())

    monkeypatch.setattr(membership, "join", join)
    env = {"HOMAGG_CONTROLLER": "ctl:9600", "RANK": "5", "WORLD_SIZE": "16",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "HOMAGG_JOIN_SECRET": "a join secret of this test"}
    cfg = AgentConfig.from_env(env)
    assert (cfg.job, cfg.worker, cfg.workers, cfg.local_workers) == (3, 2, 16, 8)
    assert cfg.siblings == ("leaf1", "leaf2") and cfg.switch == ("10.0.0.201", 48864)
    assert cfg.membership is not None and cfg.membership.worker == 5  # the lease's identity
    star = AgentConfig.from_env(env | {"RANK": "4"})
    assert (star.worker, star.workers, star.local_workers, star.siblings) == (4, 16, None, ())
