"""A Redis client for a URL that may name one server or a Redis Cluster.

``DOCQA_REDIS_URL`` names either; which one is asked of the server itself (``INFO cluster``),
so the same URL form (``redis://host:port/0``, any node of a cluster) works for both;
``redis+cluster://`` (``rediss+cluster://``) says it is a cluster outright. A cluster
client routes each key to the master holding its slot and splits a pipeline by node; commands
on the keys of a master that is gone fail alone (the tier counts them as misses), the rest go
on.
"""

from __future__ import annotations

import logging

log = logging.getLogger("docqa.tier")


def is_cluster(url: str, timeout_s: float = 1.0) -> bool:
    """Whether the server at ``url`` runs in cluster mode; False where it does not answer (a
    plain client then, which the tier's health check retries)."""
    import redis

    probe = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(probe.info("cluster").get("cluster_enabled"))
    except (redis.RedisError, OSError):
        return False
    finally:
        probe.close()


def node_url(url: str) -> tuple[str, bool | None]:
    """(``url`` as one node's ``redis://``/``rediss://`` URL, True where it said
    ``+cluster`` and None where it did not)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.endswith("+cluster"):
        return f"{scheme.removesuffix('+cluster')}://{rest}", True
    return url, None


def redis_client(url: str, timeout_s: float, cluster: bool | None = None):
    """A synchronous client for ``url``: a ``RedisCluster`` where the server is a cluster node
    (``cluster`` None: asked of it), else a plain ``Redis``. Raises ``redis.ConnectionError``
    where a cluster's nodes do not answer (a plain client connects on its first call)."""
    import redis

    url, said = node_url(url)
    cluster = said or cluster
    if cluster is None:
        cluster = is_cluster(url, min(timeout_s, 1.0))
    common = dict(socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 1.0))
    if not cluster:
        return redis.Redis.from_url(url, health_check_interval=0, **common)
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    # one attempt a call: a master that is gone is a miss now, not a wait of several timeouts
    try:
        return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 0), **common)
    except redis.exceptions.RedisClusterException as e:  # no node answered
        raise redis.ConnectionError(str(e)) from e
