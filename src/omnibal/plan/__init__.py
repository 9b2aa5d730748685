"""Planning: pipeline partition, per-stage recompute, the Plan and its exports."""
