"""One module per pipeline stage, in docs/design.md order."""
