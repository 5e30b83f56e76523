"""Scale-out on Ray (docs/cluster.md): engine replicas behind one endpoint, and experts held across nodes.

Ray is an optional extra, so nothing here imports it at module import time: core runs without it, and a cluster
command without it fails with one line naming the install.
"""

from __future__ import annotations

from types import ModuleType

from ..errors import ColibriError

CLUSTER_EXTRA = 'pip install "colibri-core[cluster]"'
NAMESPACE = "colibri"   # the Ray namespace of every colibri actor, so `coli cluster status` finds them


class MissingExtraError(ColibriError):
    """A cluster mode was asked for but Ray is not installed."""


def require_ray() -> ModuleType:
    """The ``ray`` module, or a one-line :class:`MissingExtraError` naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise MissingExtraError("the cluster modes need Ray, which is not installed", CLUSTER_EXTRA) from None
    return ray
