"""Example pipelines built on distemb's public API: datasets, walks, evaluation, plots."""
