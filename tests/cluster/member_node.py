"""A cluster member as a child process (for SIGSTOP/SIGKILL tests): joins, prints one line
per state change (``<state> <epoch>``), and leaves on SIGTERM.

    python tests/cluster/member_node.py ENDPOINT CLUSTER NODE_ID TTL_S
"""

from __future__ import annotations

import asyncio
import signal
import sys

from kvstore.cluster.etcd import EtcdClient
from kvstore.cluster.membership import Member, Membership, MembershipConfig, MemberState


async def main(endpoint: str, cluster: str, node_id: str, ttl_s: int) -> None:
    client = EtcdClient([endpoint], call_timeout_s=1.0)
    config = MembershipConfig(cluster=cluster, node_id=node_id, ttl_s=ttl_s)
    membership = Membership(client, config, Member(node_id, f"127.0.0.1:{7000 + ttl_s}", "127.0.0.1:0", ("host",)))

    def report(state: MemberState, epoch: int) -> None:
        print(f"{state.value} {epoch}", flush=True)

    membership.on_state(report)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await membership.start()
    await stop.wait()
    await membership.close()
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
