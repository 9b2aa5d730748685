"""Step-time simulation of DP x PP schedules, and reports."""
