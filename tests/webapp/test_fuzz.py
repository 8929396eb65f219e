"""Property-based fuzzing of /api/v1 from its own OpenAPI document (schemathesis).

For every operation, schema-valid and schema-invalid requests are generated (hypothesis)
and sent to the real application on a real database with a valid operator token. Every
response must be a non-5xx that conforms to the document: documented status, JSON content
type, body matching the response schema; schema-valid input is not refused with a 4xx other
than 404/409 (the document is precise about what it accepts), schema-invalid input is
refused with a 4xx (a case whose mutation is the Authorization header goes without the
token, as generated, and must be refused 401; the negative cases of a copy of the document
without its security requirement mutate the input alone and carry the token). Path parameters are also pinned to existing jobs, projects and targets,
so the actions run on real rows, not only on 404s.

Bounded: ``PGDISPATCH_FUZZ_EXAMPLES`` examples per operation and mode (default 10, about
10 s here); raise it for a longer local hunt (300 ran clean in about 3 minutes). schemathesis' own pytest plugin does not run
under pytest 9 (it sets ``Node._nodeid``), so the cases are drawn with ``as_strategy`` and
run by hypothesis directly; a failure is shrunk, reported with a curl line, and the other
operations still run.
"""

from __future__ import annotations

import copy
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pgdispatch.sql import transitions
from pgdispatch.sql.accounts import create_api_token

from .support import ensure_account, make_uncertain_target

MAX_EXAMPLES = int(os.environ.get("PGDISPATCH_FUZZ_EXAMPLES", "10"))
DOCUMENT = "/api/v1/openapi.json"
HEALTH_CHECKS = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


def fuzz_api(app, token: str, *, max_examples: int, pinned: dict[str, list] | None = None,
             operations: set[str] | None = None, derandomize: bool = False,
             reset=None) -> list[str]:
    """Fuzz every operation (or those labelled in ``operations``, e.g. ``"POST /jobs"``);
    returns one report per failing (operation, mode), empty when all conformed.

    ``reset``, when given, is called before every example: it puts the pinned rows back in
    their first state, so that a replay meets what the failing call met (a pause that failed
    a check is replayed on the same unpaused project, not answered 409) and hypothesis
    reports the check instead of "unreliable results". The first failure of each run is
    also kept and added to its report."""
    schema = schemathesis.openapi.from_wsgi(DOCUMENT, app)
    inputs = {r.ok().label: r.ok() for r in _without_security(app).get_all_operations()}
    auth = {"Authorization": f"Bearer {token}"}
    failures: list[str] = []
    ran = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operations is not None and operation.label not in operations:
            continue
        params = [p.name for p in operation.path_parameters]
        runs = [("positive", operation.as_strategy(GenerationMode.POSITIVE)),
                ("negative", operation.as_strategy(GenerationMode.NEGATIVE)),
                # most negative cases of the document mutate its bearer header, and go without
                # the token (401); these mutate the input only, and carry the token
                ("negative, input only",
                 inputs[operation.label].as_strategy(GenerationMode.NEGATIVE))]
        values = [(p, pinned[p]) for p in params if pinned and p in pinned]
        if values:
            (name, choices), = values
            runs.append((f"positive, {name} of an existing row", st.one_of(
                [operation.as_strategy(GenerationMode.POSITIVE, path_parameters={name: v})
                 for v in choices])))
        for mode, strategy in runs:
            @settings(max_examples=max_examples, deadline=None, database=None,
                      derandomize=derandomize, phases=[Phase.generate, Phase.shrink],
                      suppress_health_check=HEALTH_CHECKS)
            @given(case=strategy)
            def check(case):
                if reset is not None:
                    reset()
                # a negative case whose mutation is the Authorization header is sent as
                # generated (and must be refused: 401); the operator's token over it would
                # undo that mutation and leave a case schemathesis still counts as invalid
                headers = {} if _negates_authorization(case) else auth
                response = case.call(headers=headers)
                try:
                    case.validate_response(response, headers=headers)
                except BaseException as exc:
                    if not first:
                        first.append(f"first failure: {case.method} {case.formatted_path} "
                                     f"answered {response.status_code} {response.text[:500]!r}: "
                                     f"{exc!r}")
                    raise

            ran += 1
            first: list[str] = []
            try:
                check()
            except BaseExceptionGroup as exc:  # schemathesis' FailureGroup, after shrinking
                failures.append(f"{operation.label} ({mode}):\n{exc}\n" + "\n".join(first))
            except Unsatisfiable:
                # an operation that takes no input (GET /overview) has no invalid input
                if mode != "negative, input only":
                    raise
    assert ran, "no operation was fuzzed"
    return failures


def _without_security(app):
    """The API's document with no security requirement (none at the top, none per operation,
    no scheme), loaded for ``app`` as schemathesis' from_wsgi loads the real one: its
    negative cases mutate the query, path and body only, never the Authorization header."""
    raw = copy.deepcopy(app.test_client().get(DOCUMENT).get_json())
    raw.pop("security", None)
    for item in raw["paths"].values():
        for operation in item.values():
            if isinstance(operation, dict):
                operation.pop("security", None)
    raw.get("components", {}).pop("securitySchemes", None)
    schema = schemathesis.openapi.from_dict(raw)
    schema.app, schema.location = app, DOCUMENT
    return schema


def _negates_authorization(case) -> bool:
    """Whether ``case`` is a negative case one of whose mutations is the Authorization header
    (removed or mangled: the bearer scheme of the document is a required header to it)."""
    data = case.meta.phase.data if case.meta is not None else None
    return any(m.parameter_location == "header"  # a str Enum: ParameterLocation.HEADER
               and (m.parameter or "").lower() == "authorization"
               for m in getattr(data, "mutations", None) or ())


@pytest.fixture
def fuzz_world(world):
    """Rows for the pinned path parameters: jobs in every waiting and finished state, an
    uncertain target, a paused project; and alice's operator token."""
    make_uncertain_target(world)
    world.project("api", org="acme", pools=("linux",))
    transitions.pause_project(world.conn, project="api", reason="freeze", actor="test")
    runner = world.runner(pools=("linux",), slots=4)
    failed = world.job(command=["false"])
    world.complete(world.claim(runner), "failed", exit_code=1)
    jobs = [failed["id"], world.job(requires_approval=True)["id"], world.job()["id"]]
    transitions.cancel_job(world.conn, job_id=jobs[-1], actor="test")
    jobs.append(world.job(command=["make"])["id"])
    ensure_account(world.conn, "alice", "alice-password", "operator")
    token = create_api_token(world.conn, username="alice", name="fuzz")
    names = ["web", "api", "production", "linux", "deploy"]

    def reset():
        """web running, api paused: the projects' first state, before each example."""
        world.conn.execute("UPDATE projects SET paused_at = NULL, pause_reason = NULL, "
                           "paused_by = NULL WHERE name = 'web'")
        world.conn.execute("UPDATE projects SET paused_at = coalesce(paused_at, now()), "
                           "pause_reason = coalesce(pause_reason, 'freeze'), "
                           "paused_by = coalesce(paused_by, 'test') WHERE name = 'api'")

    return {"token": token, "pinned": {"job_id": jobs, "name": names}, "reset": reset}


def test_the_api_never_answers_5xx_and_conforms_to_its_document(app, fuzz_world, world):
    failures = fuzz_api(app, fuzz_world["token"], max_examples=MAX_EXAMPLES,
                        pinned=fuzz_world["pinned"], reset=fuzz_world["reset"])
    assert not failures, "\n\n".join(failures)
    # the run reached real rows, not only 404s: some action was audited
    assert world.conn.execute("SELECT count(*) AS n FROM audit_events WHERE actor = 'alice'"
                              ).fetchone()["n"] > 0


def test_the_fuzzer_reports_a_route_that_breaks(app, fuzz_world):
    """A deliberately broken variant: resume crashes whenever a reason is given. The fuzz
    run must report it as a server error, with the request that triggers it."""
    view = app.view_functions["api.resume_project"]

    def broken(name: str):
        from flask import request

        body = request.get_json(silent=True)
        if isinstance(body, dict) and body.get("reason"):
            raise ZeroDivisionError("deliberately broken for this test")
        return view(name)

    app.view_functions["api.resume_project"] = broken
    failures = fuzz_api(app, fuzz_world["token"], max_examples=50, derandomize=True,
                        operations={"POST /projects/{name}/resume"})
    assert failures, "the fuzzer missed a route answering 500"
    report = "\n".join(failures)
    assert "Server error" in report and "curl -X POST" in report, report
