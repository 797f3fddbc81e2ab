"""Scale-out through etcd: sidecars publish their engines, central gateways discover them.

One module per concept: `config` (the `cluster:` section), `keys` (the key layout and records),
`store` (the etcd client), `lease` (a key kept under a lease), `publisher` (the sidecar role),
`discovery` (the central role), `member` (`join()`: either role for a running gateway).
docs/cluster.md describes the layout and the failure behaviour. Only the config is imported here
(`lockgate.config` needs it); the roles are imported where a gateway joins a cluster.
"""

from .config import ClusterConfig

__all__ = ["ClusterConfig"]
