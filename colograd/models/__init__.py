"""The policy's model: the built-in tiny models, pretrained loading, logit transforms, model-file checks."""
