from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from .proxy import CommitDroppingProxy


def upstream_of(url: str):
    """The Unix socket path or (host, port) a libpq URL points at."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "localhost"])[0]
    port = int(query.get("port", [parts.port or 5432])[0])
    if host.startswith("/"):
        return f"{host}/.s.PGSQL.{port}"
    return (host, port)


@pytest.fixture
def proxy(db_url):
    """A CommitDroppingProxy in front of this test's database; ``proxy.db_url`` goes through it."""
    p = CommitDroppingProxy(upstream_of(db_url))
    p.db_url = p.url(urlsplit(db_url).path.lstrip("/"))
    yield p
    p.close()
