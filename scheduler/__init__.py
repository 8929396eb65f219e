"""The scheduler process: claims work for its pools, runs each job's command in a
subprocess, keeps its lease alive, reports the outcome; also expires lapsed leases and
refreshes the queue summary. It talks to PostgreSQL only through ``sql``.

Entry point: ``pgdispatch.scheduler.main.run`` (``pgdispatch scheduler``, or ``python -m scheduler``).
"""
