"""Everything that runs models to measure them: sits above train."""
