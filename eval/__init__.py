"""Evaluation: prompt sets (tasks) and the sweep over tasks x methods x settings."""
