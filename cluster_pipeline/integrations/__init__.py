"""Integrations with the tools users already run: Hugging Face datasets and Trainer/TRL. What the
pipeline decided (the selected subset, its shards and weights) handed over in those tools' own
forms, so a user can take it into a training setup of their own. Library code above training and
evaluation; the recipes, the Dagster layer and the CLI call it. Its modules are listed in
docs/design.md, "Code layout".
"""
