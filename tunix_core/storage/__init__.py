"""Where a run's files live: local disk or object storage (`gs://bucket/path`), behind
one small path layer (`storage.paths`)."""
