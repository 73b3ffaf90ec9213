"""The project's Dagster instance settings (``dagster.yaml`` beside this file): one run per
dataset partition at a time through the run queue, and run monitoring."""

from pathlib import Path

INSTANCE_SETTINGS = Path(__file__).with_name("dagster.yaml")
