"""The P4Runtime server over a sharded software aggregator: tests/test_p4runtime_server.py's
tests of the controller's writes, reads, counters, resets and pipeline loads, run again with
the data plane on two shards (``agg`` here is a ``ShardedSwitch``'s; every test below is that
module's own). Counters read over P4Runtime are the shards' sums."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc")

from homagg.targets.p4runtime_server import P4RuntimeServer  # noqa: E402
from homagg.targets.soft import SoftSwitchServer  # noqa: E402
from homagg.targets.soft.shards import ShardedSwitch  # noqa: E402
from tests.test_p4runtime_server import (  # noqa: E402,F401 - collected here, on shards
    SWITCH_IP,
    LoopbackHosts,
    test_a_foreign_p4info_is_refused_and_homaggs_loads_afresh,
    test_a_half_written_job_is_not_active,
    test_controller_installs_aggregates_counts_resets_and_removes,
    test_reads_one_entry_one_cell_or_everything,
    test_results_go_where_the_group_and_result_dst_say,
    test_the_aggregator_runs_homaggs_pipeline_from_the_start,
    test_write_errors_are_p4runtimes,
)

pytestmark = pytest.mark.slow  # (conftest.py) aggregator processes, one per shard


@pytest.fixture
def agg():
    """tests/test_p4runtime_server.py's ``agg``, on a two-shard aggregator."""
    sw = ShardedSwitch(shards=2)
    udp = SoftSwitchServer(sw, (SWITCH_IP, 0)).start()
    p4rt = P4RuntimeServer(sw, "127.0.0.1:0").start()
    hosts = LoopbackHosts(udp.address)
    hosts.sw, hosts.grpc = sw, p4rt.address
    yield hosts
    hosts.close()
    p4rt.stop()
    udp.stop()
