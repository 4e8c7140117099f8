"""Reaching Redis: plain and ``sentinel://`` URLs, for the store and for Celery,
and the replica wait on acknowledged writes."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from router_queue.broker.celery_app import make_celery
from router_queue.requests.record import Submission
from router_queue.settings import Settings, SettingsError
from router_queue.store.connect import ClusterAddress, RedisUrlError, SentinelAddress, bounded, celery_broker, connect
from router_queue.store.replication import Replication

SENTINELS = "sentinel://:s3cret@10.0.0.1:26379;sentinel://10.0.0.2:26380;sentinel://10.0.0.3/2?master_name=rq"


def test_a_sentinel_url_names_every_sentinel_the_primary_and_the_database():
    address = SentinelAddress.parse(SENTINELS)
    assert address == SentinelAddress(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379)),
        master_name="rq", db=2, password="s3cret")


def test_a_plain_url_is_not_a_sentinel_one():
    assert SentinelAddress.parse("redis://127.0.0.1:6379/0") is None
    assert celery_broker("amqp://guest@127.0.0.1//") == ("amqp://guest@127.0.0.1//", {})


@pytest.mark.parametrize("url,complaint", [
    ("sentinel://10.0.0.1:26379", "master_name"),
    ("sentinel://10.0.0.1:26379;redis://10.0.0.2:6379?master_name=rq", "sentinel://HOST:PORT"),
    ("sentinel://10.0.0.1:26379/zero?master_name=rq", "database"),
])
def test_a_sentinel_url_that_cannot_work_is_refused_at_startup(url, complaint):
    with pytest.raises(RedisUrlError, match=complaint):
        SentinelAddress.parse(url)
    with pytest.raises(SettingsError, match="REDIS_URL"):
        Settings.from_env({"REDIS_URL": url})
    with pytest.raises(SettingsError, match="CELERY_BROKER_URL"):
        Settings.from_env({"CELERY_BROKER_URL": url})


def test_celery_reaches_the_same_primary_through_kombus_sentinel_transport():
    app = make_celery(Settings(redis_url=SENTINELS))
    connection = app.connection_for_write()
    assert connection.transport_cls == "sentinel"
    assert connection.alt == ["sentinel://:s3cret@10.0.0.1:26379/2", "sentinel://10.0.0.2:26380/2",
                              "sentinel://10.0.0.3:26379/2"]
    assert connection.virtual_host == "2"  # kombu's db: the store's, so scripts push where workers read
    options = app.conf.broker_transport_options
    assert options["master_name"] == "rq"
    assert options["visibility_timeout"] == Settings().visibility_timeout_s


def test_a_sentinel_client_and_its_bounded_twin_ask_the_sentinels_for_the_primary():
    client = connect(SENTINELS, wait_s=5.0, connect_s=2.0)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "rq"
    assert (pool.connection_kwargs["socket_timeout"], pool.connection_kwargs["socket_connect_timeout"]) == (5.0, 2.0)
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (2, "s3cret")
    side = bounded(client, 0.25).connection_pool
    assert isinstance(side, SentinelConnectionPool) and side is not pool
    assert side.sentinel_manager is pool.sentinel_manager
    assert (side.connection_kwargs["socket_timeout"], side.connection_kwargs["db"]) == (0.25, 2)


def test_a_write_answered_before_its_replicas_had_it_is_counted_and_still_made(services, client, workspace):
    if not isinstance(client, redis.Redis) or type(client).__module__.startswith("fakeredis"):
        pytest.skip("WAIT needs a real Redis")
    store = services.store
    store.acknowledged.replication = Replication(replicas=1, timeout_ms=50)  # this Redis has no replica
    request_id = services.ids.mint(workspace, "bfl/flux-2-pro")
    outcome = store.admit(Submission(request_id=request_id, workspace=workspace, model="bfl/flux-2-pro", provider="bfl",
                          body="{}"))
    assert outcome.outcome == "ADMITTED"
    assert store.status_view(request_id, "bfl").record is not None
    assert store.unreplicated == 1
    assert store.cancel(request_id=request_id, workspace=workspace, model="bfl/flux-2-pro", provider="bfl") in (
        "CANCELLED", "REQUESTED")
    assert store.unreplicated == 2


CLUSTER = "redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001"


def test_a_cluster_url_names_its_seeds():
    assert ClusterAddress.parse(CLUSTER) == ClusterAddress((("10.0.0.1", 7000), ("10.0.0.2", 7001)), "pw")
    assert ClusterAddress.parse("redis://127.0.0.1:6379/0") is None


@pytest.mark.parametrize("url,complaint", [
    ("redis+cluster://10.0.0.1", "HOST:PORT"),
    ("redis+cluster://10.0.0.1:7000,:7001", "HOST:PORT"),
    ("redis+cluster://10.0.0.1:7000/3", "database 0"),
])
def test_a_cluster_url_that_cannot_work_is_refused_at_startup(url, complaint):
    with pytest.raises(SettingsError, match=f"REDIS_URL: .*{complaint}"):
        Settings.from_env({"REDIS_URL": url, "CELERY_BROKER_URL": "amqp://guest@127.0.0.1//"})


@pytest.mark.parametrize("env,complaint", [
    ({"REDIS_URL": CLUSTER}, "set CELERY_BROKER_URL to RabbitMQ"),
    ({"REDIS_URL": "redis://127.0.0.1:6379/0", "CELERY_BROKER_URL": CLUSTER}, "kombu has no transport"),
    ({"REDIS_URL": CLUSTER, "CELERY_BROKER_URL": "amqp://x//", "REDIS_READ_URL": "redis://r:6379/0"},
     "REDIS_READ_URL"),
])
def test_a_cluster_store_needs_a_broker_of_its_own_and_no_single_server_options(env, complaint):
    with pytest.raises(SettingsError, match=complaint):
        Settings.from_env(env)
    assert Settings.from_env({"REDIS_URL": CLUSTER, "CELERY_BROKER_URL": "redis://127.0.0.1:6380/0"}).redis_url == \
        CLUSTER.rstrip("/")
    # a write waits for its slot's replica as it would for one primary's (store/replication.py)
    assert Settings.from_env({"REDIS_URL": CLUSTER, "CELERY_BROKER_URL": "amqp://x//",
                              "REDIS_WAIT_REPLICAS": "1"}).wait_replicas == 1
    # the cluster's own URL as the read URL: its replicas serve the reads
    assert Settings.from_env({"REDIS_URL": CLUSTER, "REDIS_READ_URL": CLUSTER,
                              "CELERY_BROKER_URL": "amqp://x//"}).redis_read_url == CLUSTER
