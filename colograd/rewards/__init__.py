"""Rewards: resolving and scoring reward functions, early scoring, and code rewards run in a sandbox."""
