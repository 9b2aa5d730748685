"""Reference trainer: single-device model code, plus distributed wrapping applied from a plan."""
