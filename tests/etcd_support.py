"""A real etcd server for the cluster tests (`lockgate.cluster.etcd_server.LocalEtcd`).

Without an etcd binary the tests that need one are skipped, except under CI=true where they fail
(`scripts/system-deps.sh` installs Debian's etcd-server for `make test`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lockgate.cluster.etcd_server import EtcdMissing, LocalEtcd, free_port

__all__ = ["EtcdServer", "free_port"]


class EtcdServer(LocalEtcd):
    def __init__(self, data_dir: Path) -> None:
        try:
            super().__init__(data_dir)
        except EtcdMissing as exc:
            if os.environ.get("CI") == "true":
                pytest.fail(str(exc))
            pytest.skip(str(exc))
