"""`redis+sentinel://` URLs: what they say, what the settings accept, what messages show."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from omni_runtime.errors import FatalError
from omni_runtime.redis_io.clients import probe, redacted
from omni_runtime.sentinel_url import is_sentinel_url, parse_sentinel_url
from omni_runtime.settings import Settings


def test_a_url_names_every_sentinel_the_service_the_db_and_the_servers_auth() -> None:
    url = "redis+sentinel://app:s%40cret@s1:26380,s2,[::1]:26381/cache/2?socket_timeout=3"
    target = parse_sentinel_url(url)
    assert target.sentinels == [("s1", 26380), ("s2", 26379), ("::1", 26381)]
    assert target.service == "cache"
    assert target.connection_kwargs == {
        "username": "app",
        "password": "s@cret",
        "db": 2,
        "socket_timeout": 3.0,
    }
    assert target.sentinel_kwargs == {}


def test_the_sentinels_own_auth_and_tls_come_from_the_query_and_the_scheme() -> None:
    target = parse_sentinel_url(
        "rediss+sentinel://:pw@s1:1/svc?sentinel_password=sp&sentinel_username=su"
    )
    assert target.sentinel_kwargs == {"password": "sp", "username": "su"}
    assert target.connection_kwargs == {"password": "pw", "ssl": True}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://s1:26379", "must name its service"),
        ("redis+sentinel://s1:26379/", "must name its service"),
        ("redis+sentinel://s1:26379/a/0/x", "must name its service"),
        ("redis+sentinel://s1:99999/svc", "bad sentinel address"),
        ("redis+sentinel://s1:1,,s2:2/svc", "bad sentinel address"),
    ],
)
def test_a_url_without_a_service_or_with_a_bad_address_is_refused(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sentinel_url(url)
    with pytest.raises(ValidationError, match=says):
        Settings(redis_url=url)


def test_the_settings_take_a_sentinel_url() -> None:
    url = "redis+sentinel://s1:26379,s2:26379/omni/0"
    assert Settings(redis_url=url).require_redis_url() == url
    assert is_sentinel_url(url) and not is_sentinel_url("redis://s1:6379/0")


def test_messages_hide_the_password_of_a_url_with_many_hosts() -> None:
    url = "redis+sentinel://app:secret@s1:1,s2:2/svc/0"
    assert redacted(url) == "redis+sentinel://app:***@s1:1,s2:2/svc/0"
    assert redacted("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


def test_no_sentinel_answering_is_one_fatal_line() -> None:
    with pytest.raises(FatalError, match="no primary for service 'svc' of sentinels"):
        probe("redis+sentinel://127.0.0.1:1/svc")


def test_a_sentinel_url_is_never_taken_for_a_cluster() -> None:
    with pytest.raises(FatalError, match="is no Redis Cluster"):
        probe("redis+sentinel://127.0.0.1:1/svc", "yes")
