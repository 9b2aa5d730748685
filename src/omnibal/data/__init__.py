"""Balanced data: packing, assignment to ranks and micro-batches, metrics, sampler, collate."""
