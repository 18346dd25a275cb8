"""Every check that runs before the engine starts: the recipe, data, model, environment and engine fit."""
