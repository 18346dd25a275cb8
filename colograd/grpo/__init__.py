"""The GRPO step's math and its guards: the loss, entropy terms, the reference policy, the policy made ready and
placed, and the parity guard (the engine samples from the model trained, or the run stops)."""
