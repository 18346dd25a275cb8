"""Images: pixels for the trainer and the engine, and the checks every image row passes."""
