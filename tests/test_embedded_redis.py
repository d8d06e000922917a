"""The embedded Redis-compatible server fixture: a real server, private, and gone after stop."""

from __future__ import annotations

import redis

from common.process import port_is_free
from connector import EmbeddedRedis


def test_fixture_serves_real_commands(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    assert client.ping()
    assert client.set("k", b"\x00\x01", nx=True, ex=10)
    assert not client.set("k", b"other", nx=True, ex=10)
    assert client.get("k") == b"\x00\x01"
    assert client.config_get("save")["save"] == ""
    assert redis_server.data_dir.is_dir()


def test_stop_frees_port_and_removes_directory():
    server = EmbeddedRedis(maxmemory="8mb").start()
    client = redis.Redis.from_url(server.url)
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
    data_dir, port = server.data_dir, server.port
    client.close()
    server.stop()
    assert not data_dir.exists()
    assert port_is_free("127.0.0.1", port)


def test_two_servers_are_independent():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port
        redis.Redis.from_url(a.url).set("only-in-a", 1)
        assert redis.Redis.from_url(b.url).get("only-in-a") is None
