"""What a run is told: `GRPOConfig` and its topic groups, their ranges, the recipe parser, and TRL's names."""
