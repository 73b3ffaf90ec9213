"""One module per pipeline stage, in DESIGN.md order."""
