"""The GPU tooling: the acceptance check (`python -m colograd.gpu.check`), its rows run each in a child process
(`runner`), and the proof that records the check, feature rows and the step benchmark (`proof`, `make gpu-proof`)."""
