"""GET / MGET replies received straight into buffers (connector/resp.py), against a real server:
the same values redis-py's parser gives, error replies raised as redis-py raises them, and a
connection never left half read."""

from __future__ import annotations

import os
import time

import pytest
import redis

from connector.client import sync_client
from connector.resp import fetch_bulk

# Around the 256-byte line read (a value inside it, across it), CRLFs inside values, empty,
# and values larger than a socket buffer.
SIZES = [0, 1, 2, 200, 246, 247, 248, 255, 256, 257, 300 << 10, 5 << 20]


def _value(n: int) -> bytes:
    body = os.urandom(n)
    return body if n < 4 else b"\r\n" + body[2:-2] + b"\r\n"


@pytest.fixture
def client(redis_server):
    c = sync_client(redis_server.url, op_timeout=2.0, retries=1)
    yield c
    c.close()


def test_get_gives_the_bytes_redis_py_gives(client):
    for n in SIZES:
        value = _value(n)
        client.set(f"k{n}", value)
        [got] = fetch_bulk(client, "GET", f"k{n}")
        assert bytes(got) == value == client.get(f"k{n}")
        assert not got.readonly  # a buffer of its own, not a view of a parser's bytes


def test_mget_in_order_with_nils_and_small_values_sharing_one_read(client):
    values = {f"m{i}": _value(n) for i, n in enumerate(SIZES)}
    client.mset(values)
    keys = ["absent-first", *values, "absent-between", "m3", "absent-last"]
    got = fetch_bulk(client, "MGET", *keys)
    want = client.mget(keys)
    assert [None if g is None else bytes(g) for g in got] == want
    assert got[0] is None and got[-1] is None


def test_error_reply_is_raised_and_the_connection_stays_usable(client):
    client.rpush("a-list", "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        fetch_bulk(client, "GET", "a-list")
    client.set("after", b"ok")
    assert bytes(fetch_bulk(client, "GET", "after")[0]) == b"ok"
    assert client.get("after") == b"ok"  # redis-py's own reads on the same pooled connection
    assert len(client.connection_pool._available_connections) == 1


def test_a_timeout_drops_the_connection_and_the_next_call_reconnects(redis_server):
    client = sync_client(redis_server.url, op_timeout=0.2, retries=0)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        client.set("k", b"v" * 1000)
        fetch_bulk(client, "GET", "k")  # connected
        admin.client_pause(600)  # the server holds every client's commands for 0.6 s
        with pytest.raises(redis.TimeoutError):
            fetch_bulk(client, "GET", "k")
        time.sleep(0.7)
        # The late reply of the timed-out GET must not be read as this one's.
        client.set("k2", b"w" * 10)
        assert bytes(fetch_bulk(client, "GET", "k2")[0]) == b"w" * 10
        assert client.get("k") == b"v" * 1000
    finally:
        client.close()
        admin.close()


def test_a_server_that_went_away_is_a_connection_error_then_a_reconnect():
    from connector import EmbeddedRedis

    server = EmbeddedRedis().start()
    client = sync_client(server.url, op_timeout=1.0, retries=1)
    try:
        client.set("k", b"v")
        port = server.port
        server.stop()
        with pytest.raises(redis.ConnectionError):
            fetch_bulk(client, "GET", "k")
        server = EmbeddedRedis(port=port).start()
        assert fetch_bulk(client, "GET", "k") == [None]  # a fresh server: reconnected, a miss
    finally:
        client.close()
        server.stop()
