"""Scoring of predictions against this project's datasets: change masks, change captions, QA answers."""
