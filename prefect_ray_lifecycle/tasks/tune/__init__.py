"""Prefect tasks around one Tune sweep: its settings, the run, its trials, report and chart."""
