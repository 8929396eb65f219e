-- name: read_queue_history
-- Per pool and bucket of :step seconds over the last :seconds: the most waiting and running,
-- the longest oldest wait, the claims, their claim-weighted p50 and the largest p95
-- (sql/history.py). One range of queue_history's primary key. Read-only.
SELECT to_timestamp(floor(extract(epoch FROM h.at) / :step) * :step) AS at, q.name AS pool,
       max(h.waiting) AS waiting, max(h.running) AS running,
       max(h.oldest_wait_seconds) AS oldest_wait_seconds,
       sum(h.claimed)::integer AS claimed,
       sum(h.wait_p50_seconds * h.claimed) / nullif(sum(h.claimed) FILTER (WHERE h.wait_p50_seconds IS NOT NULL), 0)
           AS wait_p50_seconds,
       max(h.wait_p95_seconds) AS wait_p95_seconds
  FROM queue_history h
  JOIN pools q ON q.id = h.pool_id
 WHERE h.at > now() - make_interval(secs => :seconds)
 GROUP BY 1, q.name
 ORDER BY 1, q.name;

-- name: read_reason_history
-- Per bucket of :step seconds over the last :seconds, the waiting jobs by primary reason of
-- one minute of it: the minute with the most waiting jobs (the latest of equals), whole, so
-- that a bucket's counts are one snapshot (each minute's rows are one, written together by
-- pgd_record_reason_counts) and never count a job under two reasons. One range of
-- queue_reason_history's primary key. Read-only.
WITH minutes AS (
    SELECT h.at, to_timestamp(floor(extract(epoch FROM h.at) / :step) * :step) AS bucket,
           sum(h.waiting) AS total
      FROM queue_reason_history h
     WHERE h.at > now() - make_interval(secs => :seconds)
     GROUP BY h.at
), picked AS (
    SELECT DISTINCT ON (bucket) bucket, at FROM minutes ORDER BY bucket, total DESC, at DESC
)
SELECT p.bucket AS at, h.reason, h.waiting
  FROM picked p
  JOIN queue_reason_history h ON h.at = p.at
 ORDER BY 1, 2;

-- name: list_pool_names
-- Every pool's name, sorted: the charts draw each, with or without history. Read-only.
SELECT name FROM pools ORDER BY name;
