"""Prompts: datasets loaded, tokenized and streamed, and the tasks colograd generates locally."""
