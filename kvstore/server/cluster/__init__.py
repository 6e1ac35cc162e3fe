"""Cluster mode wired into the server (DESIGN §12); imported only when --cluster is given."""

from kvstore.server.cluster.cluster_runtime import ClusterRuntime

__all__ = ["ClusterRuntime"]
