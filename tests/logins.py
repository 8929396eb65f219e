"""Real database logins for the tests of runner hosts and approvals (tests/sql,
tests/scheduler): ``make_login(name)`` creates a LOGIN role with a password and returns a URL
of the test's database that logs in as it.

A login gets no privilege of its own: ``groups`` (e.g. ``("pgdispatch_scheduler",)``, the
group roles of sql/roles.sql) is what it may do, as in production. Every login made is
dropped at the end of the test.
"""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

from pgdispatch.sql import db

PASSWORD = "host-secret-1"


def url_as(url: str, login: str, password: str = PASSWORD) -> str:
    """``url`` with its user and password replaced."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    netloc = f"{login}:{password}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class Logins:
    """Creates logins on the server of ``db_url``; ``drop()`` removes them."""

    def __init__(self, db_url: str):
        self.db_url = db_url
        self.made: list[str] = []

    def make(self, stem: str, *, groups: tuple[str, ...] = ()) -> tuple[str, str]:
        """A new LOGIN role named ``stem_<random>``; returns (login, URL logging in as it)."""
        login = f"{stem}_{uuid.uuid4().hex[:6]}"
        with db.connect(self.db_url) as conn:
            conn.execute(f'CREATE ROLE "{login}" LOGIN PASSWORD \'{PASSWORD}\'')
            self.made.append(login)
            for group in groups:
                conn.execute(f'GRANT "{group}" TO "{login}"')
        return login, url_as(self.db_url, login)

    def drop(self) -> None:
        with db.connect(self.db_url) as conn:
            for login in self.made:
                conn.execute(f'DROP OWNED BY "{login}"')
                conn.execute(f'DROP ROLE "{login}"')
