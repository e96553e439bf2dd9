"""Prefect tasks around one Ray Train fine-tune: its plan, the run, its report and chart."""
