"""Pipeline parallelism: schedules, stage partitioning, the scanned engine, pictures."""
