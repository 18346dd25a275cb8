"""Multi-turn rollouts: the tool-calling loop and its tool-call parsers."""
