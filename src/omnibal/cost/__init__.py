"""Cost model: model specs, hardware specs, analytic per-layer costs, measured profiles."""
