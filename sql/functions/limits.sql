-- Limit changes from the admin area (sql/limits.py): an organization's limit, a project's
-- running bound and fairness weight, a pool's slots. Each locks one row, compares it with
-- what the admin saw (p_expected_*; a stale form loses with PDALR naming who changed it
-- last), changes it, and audits the change in the same transaction; an unchanged save
-- writes nothing and audits nothing. Entry points of pgdispatch_web and pgdispatch_admin
-- (sql/grants.sql), authorized as 'admin' (pgd_authorize, sql/functions/audit.sql).
-- Lowering a limit below the running count stops new claims only (pgd_sync_stripes,
-- sql/functions/capacity.sql). Returns {<kind>, <the values>, running, changed}.

CREATE OR REPLACE FUNCTION pgd_set_organization_limit(p_organization text, p_max_running integer,
                                                      p_expected_max_running integer,
                                                      p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v organizations%ROWTYPE;
    v_subject text := 'organization:' || p_organization;
    v_running integer;
    v_changed boolean;
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    SELECT * INTO v FROM organizations WHERE name = p_organization FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown organization %', p_organization USING ERRCODE = 'PD404';
    END IF;
    v_running := pgd_organization_running(v.id);
    IF v.max_running IS DISTINCT FROM p_expected_max_running THEN
        RAISE EXCEPTION 'organization %''s limit is now % (last change by %); reload and try again',
            p_organization, v.max_running, pgd_last_actor(v_subject) USING ERRCODE = 'PDALR';
    END IF;
    v_changed := p_max_running IS DISTINCT FROM v.max_running;
    IF v_changed THEN
        UPDATE organizations SET max_running = p_max_running WHERE id = v.id;
        PERFORM pgd_audit(p_actor, 'set_organization_limit', v_subject, p_reason,
                          jsonb_build_object('from', jsonb_build_object('max_running', v.max_running),
                                             'to', jsonb_build_object('max_running', p_max_running)));
    END IF;
    RETURN jsonb_build_object('organization', p_organization, 'max_running', p_max_running,
                              'running', v_running, 'changed', v_changed);
END;
$$;

CREATE OR REPLACE FUNCTION pgd_set_project_limits(p_project text, p_max_running integer,
                                                  p_weight integer, p_expected_max_running integer,
                                                  p_expected_weight integer, p_reason text,
                                                  p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v projects%ROWTYPE;
    v_subject text := 'project:' || p_project;
    v_running integer;
    v_changed boolean;
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    SELECT * INTO v FROM projects WHERE name = p_project FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown project %', p_project USING ERRCODE = 'PD404';
    END IF;
    v_running := pgd_project_running(v.id);
    IF v.max_running IS DISTINCT FROM p_expected_max_running OR v.weight IS DISTINCT FROM p_expected_weight THEN
        RAISE EXCEPTION 'project %''s limits are now bound %, weight % (last change by %); reload and try again',
            p_project, coalesce(v.max_running::text, 'none'), v.weight, pgd_last_actor(v_subject)
            USING ERRCODE = 'PDALR';
    END IF;
    v_changed := p_max_running IS DISTINCT FROM v.max_running OR p_weight IS DISTINCT FROM v.weight;
    IF v_changed THEN
        UPDATE projects SET max_running = p_max_running, weight = p_weight WHERE id = v.id;
        PERFORM pgd_audit(p_actor, 'set_project_limits', v_subject, p_reason,
                          jsonb_build_object('from', jsonb_build_object('max_running', v.max_running,
                                                                        'weight', v.weight),
                                             'to', jsonb_build_object('max_running', p_max_running,
                                                                      'weight', p_weight)));
    END IF;
    RETURN jsonb_build_object('project', p_project, 'max_running', p_max_running, 'weight', p_weight,
                              'running', v_running, 'changed', v_changed);
END;
$$;

CREATE OR REPLACE FUNCTION pgd_set_pool_slots(p_pool text, p_slots integer, p_expected_slots integer,
                                              p_reason text, p_actor text)
RETURNS jsonb LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v pools%ROWTYPE;
    v_subject text := 'pool:' || p_pool;
    v_running integer;
    v_changed boolean;
BEGIN
    p_actor := pgd_authorize(p_actor, 'admin');
    SELECT * INTO v FROM pools WHERE name = p_pool FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown pool %', p_pool USING ERRCODE = 'PD404';
    END IF;
    v_running := pgd_pool_running(v.id);
    IF v.slots IS DISTINCT FROM p_expected_slots THEN
        RAISE EXCEPTION 'pool % now has % slots (last change by %); reload and try again',
            p_pool, v.slots, pgd_last_actor(v_subject) USING ERRCODE = 'PDALR';
    END IF;
    v_changed := p_slots IS DISTINCT FROM v.slots;
    IF v_changed THEN
        UPDATE pools SET slots = p_slots WHERE id = v.id;
        PERFORM pgd_audit(p_actor, 'set_pool_slots', v_subject, p_reason,
                          jsonb_build_object('from', jsonb_build_object('slots', v.slots),
                                             'to', jsonb_build_object('slots', p_slots)));
    END IF;
    RETURN jsonb_build_object('pool', p_pool, 'slots', p_slots, 'running', v_running,
                              'changed', v_changed);
END;
$$;
